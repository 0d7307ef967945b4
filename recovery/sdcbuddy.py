"""The buddy's third opinion on silent data corruption (docs/sdc.md).

A rank fingerprints its state every few steps (trainer/sdc.py) and marks its flash copy of
that step with what the fingerprints covered (recovery/statehash.py `SDC_META`). When such
a copy arrives at the buddy (recovery/replica.py `ReplicaServer.on_stored`), the buddy
recomputes the rank's fingerprints from the copy's bytes, and replays the rank's own
weights on a fixed input, on its own device (`BuddyOpinions.device`: the CPU unless
`UNBROKEN_BUDDY_DEVICE` names another, e.g. `cuda`). The results go to the driver in the
agent's heartbeats (`Heartbeat.buddy_opinions`), where a rank whose own report differs from
its buddy's recomputation of its copy is the suspect (driver/sdc.py).

The copy is read while the replica server holds the rank's slot lock, so no newer copy
overwrites it meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field

import structlog

from unbroken.common.sdckeys import MASK64, SDC_META
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.flashcopy import CopyRef, CorruptCopyError, open_copy, tensor_views
from unbroken.recovery.persist import TIMELINE_META

log = structlog.get_logger(__name__)

DEVICE_ENV = "UNBROKEN_BUDDY_DEVICE"
KEPT = 16  # opinions kept for the heartbeats (a few steps of a node's ranks)
BEATS = 20  # heartbeats that carry each opinion (the driver may miss a few)
MAX_KEYS = 16  # keys of one opinion passed on (a rank's fingerprint carries a few)


@dataclass(slots=True)
class Opinion:
    """One copy's recomputed fingerprints (or why there are none)."""

    node: str
    rank: int
    step: int
    timeline: int
    fingerprints: dict[str, int]
    error: str = ""
    seconds: float = 0.0
    beats: int = 0  # heartbeats that carried it


@dataclass(slots=True)
class BuddyOpinions:
    """The opinions this buddy formed, newest first, for the heartbeats (thread-safe: the
    replica server runs on the flash thread, heartbeats on the agent's loop)."""

    # where the recomputation runs (a torch device name; torch is imported only then: the
    # agent does not import it to start)
    device: str = field(default_factory=lambda: os.environ.get(DEVICE_ENV, "") or "cpu")
    kept: collections.deque[Opinion] = field(default_factory=lambda: collections.deque(maxlen=KEPT))
    formed: int = 0  # opinions formed (metrics, tests)
    failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def form(self, node: str, ref: CopyRef) -> Opinion | None:
        """Recompute the fingerprints of `node`'s copy `ref` when it is a fingerprinted one
        (blocking: call it off the event loop); keeps and returns the opinion."""
        meta = ref.manifest.meta.get(SDC_META)
        if not isinstance(meta, dict):
            return None
        import torch

        from unbroken.recovery.statehash import opinion

        t0 = time.perf_counter()
        m = ref.manifest
        fps: dict[str, int] = {}
        error = ""
        try:
            manifest, data = open_copy(ref)
            try:
                views = tensor_views(data, manifest.entries)
                fps = opinion(manifest.entries, views, meta, torch.device(self.device))
                views = []
            finally:
                with contextlib.suppress(BufferError):  # a view still held: closed by GC
                    data.close()
        except (CorruptCopyError, ValueError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"[:500]
        timeline = m.meta.get(TIMELINE_META, 0)
        op = Opinion(
            node=node,
            rank=m.rank,
            step=int(meta.get("step", m.step)),
            timeline=timeline if isinstance(timeline, int) else 0,
            fingerprints=fps,
            error=error,
            seconds=time.perf_counter() - t0,
        )
        with self._lock:
            self.kept.appendleft(op)
            if error:
                self.failed += 1
            else:
                self.formed += 1
        log.info(
            "sdc.buddy_opinion",
            node=node,
            rank=op.rank,
            step=op.step,
            error=error or None,
            ms=round(op.seconds * 1000, 1),
        )
        return op

    def to_send(self) -> list[Opinion]:
        """The opinions for this heartbeat: each newest one until it was in `BEATS`."""
        with self._lock:
            out = [op for op in self.kept if op.beats < BEATS]
            for op in out:
                op.beats += 1
        return out


def opinion_messages(ops: list[Opinion]) -> list[dpb.BuddyOpinion]:
    """Opinions as heartbeat entries (keys cut to `MAX_KEYS` of 128 characters)."""
    out = []
    for op in ops:
        keys = sorted(op.fingerprints)[:MAX_KEYS]
        out.append(
            dpb.BuddyOpinion(
                node=op.node,
                timeline=op.timeline,
                error=op.error,
                fingerprint=ev.RankFingerprint(
                    step=op.step,
                    keys=[k[:128] for k in keys],
                    hashes=[op.fingerprints[k] & MASK64 for k in keys],
                    global_rank=op.rank,
                ),
            )
        )
    return out
