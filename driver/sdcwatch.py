"""The driver's fingerprint watch (docs/sdc.md): the asyncio shell around driver/sdc.py.

Every heartbeat interval while the job runs it reads the world nodes' newest heartbeats,
feeds the ranks' fingerprints (`WorkerStatus.fingerprints`) to a `FingerprintBook` and
records what each complete step says: `StepVerified` when every group agreed, or
`SdcSuspected` (the machine decides the rollback) when one did not. The book starts over
whenever the job leaves RUNNING or the world changes, so a restored timeline is never
compared with the one it replaced. After an SdcSuspected nothing more is judged until the
log moved past it and the job runs again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import structlog

from unbroken.driver import sdc as sdclib
from unbroken.driver.buddies import ring_order
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:
    from unbroken.driver.loop import RecoveryLoop

log = structlog.get_logger(__name__)


async def watch(loop: RecoveryLoop) -> None:
    """Run the fingerprint watch for `loop` until cancelled."""
    period = loop.service.config.live.heartbeat_interval_ms / 1000.0
    book: sdclib.FingerprintBook | None = None
    world_key: Any = None
    suspected_at = -1  # the state's last_seq when the last SdcSuspected was queued
    probe_ref: int | None = None  # kept across books
    stale: set[tuple[str, int, int, int]] = set()  # opinions heard before the book began
    fed: dict[str, dpb.Heartbeat] = {}  # each node's heartbeat fed to this book last
    node_of: dict[int, str] = {}  # rank -> node, from the heartbeats fed to this book
    while True:
        await asyncio.sleep(period)
        s = loop.state
        if book is not None and book.probe_ref is not None:
            probe_ref = book.probe_ref
        if s.phase != ev.PHASE_RUNNING or s.last_seq <= suspected_at:
            book = None
            continue
        try:
            w = s.world
            key = (tuple(w.node_ids), w.workers_per_node, s.goodput.incidents)
            if book is None or key != world_key:
                size = len(w.node_ids) * w.workers_per_node
                # the probe's agreed value is the same in any world of the same devices
                ref = book.probe_ref if book is not None else probe_ref
                book, world_key = sdclib.FingerprintBook(size, probe_ref=ref), key
                # heartbeats repeat an opinion a while: those of the run before this book
                # (a step trained again after a restart) are not about this run's copies
                stale = set(_opinions(loop, tuple(w.node_ids)))
                fed, node_of = {}, {}
            _feed(loop, book, key[0], stale, fed, node_of)
            for v in book.ready(time.monotonic()):
                if v.disagreed:
                    suspected_at = s.last_seq
                    loop.service.emit(ev.Event(sdc_suspected=_suspected(loop, s, v, node_of)))
                    log.warning("sdc suspected", step=v.step, ranks=v.suspects, detail=v.detail)
                    probe_ref, book = book.probe_ref, None
                    break
                if v.verified:
                    loop.service.emit(
                        ev.Event(
                            step_verified=ev.StepVerified(
                                step=v.step,
                                ranks=book.world_size,
                                groups=v.groups,
                                buddy_checked=v.checked,
                            )
                        )
                    )
        except Exception:
            log.exception("fingerprint watch failed; continuing")
            book = None


def _opinion_key(op: dpb.BuddyOpinion) -> tuple[str, int, int, int]:
    return (op.node, op.fingerprint.global_rank, op.fingerprint.step, op.timeline)


def _opinions(loop: RecoveryLoop, nodes: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """The opinions in `nodes`' newest heartbeats."""
    out: list[tuple[str, int, int, int]] = []
    for n in nodes:
        slot = loop.view.nodes.get(n)
        if slot is not None:
            out.extend(_opinion_key(op) for op in slot.hb.buddy_opinions)
    return out


def _feed(
    loop: RecoveryLoop,
    book: sdclib.FingerprintBook,
    nodes: tuple[str, ...],
    stale: Collection[tuple[str, int, int, int]] = (),
    fed: dict[str, dpb.Heartbeat] | None = None,
    node_of: dict[int, str] | None = None,
) -> dict[int, str]:
    """Add every world rank's heartbeat fingerprints to `book`, and the opinions each
    node formed as the buddy of the node before it in the ring (`ring_order`) on that
    node's ranks (not those in `stale`); returns {rank: node}.

    `fed` (kept by the caller for the same book): each node's heartbeat fed last; a node
    whose newest heartbeat is still that one is skipped (the book keeps the first report
    of a rank's step, so feeding it again adds nothing). At 10,240 nodes a whole feed read
    81,920 workers' statuses every 100 ms: 13 % of the driver's samples. `node_of`: the
    ranks' nodes found so far (kept with `fed`)."""
    node_of = {} if node_of is None else node_of
    changed: list[tuple[str, dpb.Heartbeat]] = []
    views = loop.view.nodes
    for n in nodes:
        slot = views.get(n)
        if slot is None or not slot.alive:
            continue
        hb = slot.hb
        if fed is not None:
            if fed.get(n) is hb:
                continue
            fed[n] = hb  # (kept: its id is never reused while it is compared)
        changed.append((n, hb))
        if hb.HasField("fingerprint_ranks") and not hb.fingerprint_ranks:
            continue  # no rank's status carries one (an older agent does not say: read all)
        for ws in hb.workers:
            node_of[ws.global_rank] = n
            for fp in ws.fingerprints:
                book.add(fp.global_rank, fp.step, dict(zip(fp.keys, fp.hashes, strict=False)))
    buddy_of: dict[str, str] | None = None  # the ring, once an opinion needs it
    timeline = int(getattr(loop, "_timeline", 0))
    for n, hb in changed:
        for op in hb.buddy_opinions:
            if buddy_of is None:
                ring = ring_order(list(nodes), views)
                buddy_of = {x: ring[(i + 1) % len(ring)] for i, x in enumerate(ring)}
            fp = op.fingerprint
            # only the node's buddy speaks for its ranks, and only of this timeline
            if buddy_of.get(op.node) != n or _foreign_rank(views, node_of, fp.global_rank, op.node):
                continue
            if op.timeline < timeline or _opinion_key(op) in stale:
                continue
            fps = {} if op.error else dict(zip(fp.keys, fp.hashes, strict=False))
            book.add_opinion(fp.global_rank, fp.step, fps)
    return node_of


def _foreign_rank(views: Any, node_of: dict[int, str], rank: int, node: str) -> bool:
    """Whether `rank` is not `node`'s: by the ranks fed so far, else by `node`'s newest
    heartbeat (a node whose heartbeats carry no fingerprint is not walked by `_feed`)."""
    if rank in node_of:
        return node_of[rank] != node
    slot = views.get(node)
    if slot is None or not any(w.global_rank == rank for w in slot.hb.workers):
        return True
    node_of[rank] = node
    return False


def _suspected(
    loop: RecoveryLoop, s: ev.JobState, v: sdclib.Verdict, node_of: dict[int, str]
) -> ev.SdcSuspected:
    held = loop._ring_held(tuple(s.world.node_ids))
    before = [x for x in s.verified_steps if x < v.step]
    return ev.SdcSuspected(
        step=v.step,
        suspect_ranks=list(v.suspects),
        suspect_nodes=[node_of.get(r, "") for r in v.suspects],
        resolved=v.resolved,
        keys=list(v.keys),
        verified_step=max(before) if before else 0,
        detail=v.detail,
        memory_steps=sorted(x for x in held or () if x < v.step),
    )
