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

In an agent the recomputation runs in a helper process (`BuddyOpinions(helper=True)`: one
`concurrent.futures` process at nice 19, which imports torch itself; spawned when the agent
waiting for its job starts its standbys (`prestart`), else at the first fingerprinted copy),
never in the agent's own, which imports no torch. The first opinion used to import it in a
thread of the agent, and an import holds the interpreter's lock for hundreds of milliseconds
at a time (the shared libraries load under it). A spare's first copy arrives just after it
is promoted into the world, so its heartbeats stopped for 0.5-1.1 s at every node loss of a
bench run: the driver held the node as starved rather than losing it, and the resume waited
(bench-recovery, node loss: 0.48 s of 1.31 between the first step and the resume; 0.03 s of
0.72 with the helper).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import multiprocessing
import os
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import psutil
import structlog

from unbroken.common import autogroup
from unbroken.common.sdckeys import MASK64, SDC_META
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.flashcopy import (
    CopyRef,
    CorruptCopyError,
    open_copy,
    read_manifest,
    tensor_views,
)
from unbroken.recovery.persist import TIMELINE_META

log = structlog.get_logger(__name__)

DEVICE_ENV = "UNBROKEN_BUDDY_DEVICE"
KEPT = 16  # opinions kept for the heartbeats (a few steps of a node's ranks)
BEATS = 20  # heartbeats that carry each opinion (the driver may miss a few)
MAX_KEYS = 16  # keys of one opinion passed on (a rank's fingerprint carries a few)
HELPER_NICE = 19  # the helper process's niceness: opinions wait for idle CPU
# A recomputation whose helper used no CPU for this long is hung (its first waits for the
# helper's torch import too). One whose helper works, only slowly, is waited for up to
# HELPER_MAX_S: at nice 19 beside two CPU hogs on 2 cores the helper gets ~1.5 % of a core,
# and its torch import alone took over 60 s (a CI run under `stress-ng -c 2` saw the first
# opinion fail, the helper killed mid-import and the next one start the import again).
HELPER_TIMEOUT_S = 60.0
HELPER_MAX_S = 900.0


def recompute(ref: CopyRef, meta: dict[str, Any], device: str) -> tuple[dict[str, int], str]:
    """The fingerprints of `ref` that `meta` asks for, recomputed on `device`, or why
    there are none (the helper process's job; in-process with `helper=False`)."""
    import torch

    from unbroken.recovery.statehash import opinion

    try:
        manifest, data = open_copy(ref)
        try:
            views = tensor_views(data, manifest.entries)
            fps = opinion(manifest.entries, views, meta, torch.device(device))
            views = []
        finally:
            with contextlib.suppress(BufferError):  # a view still held: closed by GC
                data.close()
    except (CorruptCopyError, ValueError, RuntimeError) as e:
        return {}, f"{type(e).__name__}: {e}"[:500]
    return fps, ""


def _lower_priority() -> None:
    """Make this process wait for idle CPU: nice 19, in a session of its own whose autogroup
    is nice 19 too (common/autogroup.py): in the agent's session a nice-19 helper took the
    session's share, and importing torch beside a promoted spare's first step it ran at 20 %
    of a core (a /proc sampler, `make run`, 2026-12-07)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, HELPER_NICE)
    with contextlib.suppress(OSError):
        os.setsid()  # its own autogroup; the agent still kills it (its parent and reaper)
        autogroup.set_nice(0, HELPER_NICE)


def _orphan_watch(parent: int, every_s: float = 1.0) -> None:
    """Exit once this process is re-parented (its agent died): a pool's process waits for
    its next task for ever, and an agent SIGKILLed without its reaper (one that started no
    workers) left its helper, torch and all, running (found after a test's SIGKILL)."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(0)


def _helper_start(parent: int) -> None:
    """The helper process's start: gone with its agent (`parent`, passed in: it may have
    died before this runs), low priority, one thread, torch imported now rather than at the
    first copy."""
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True, name="orphan").start()
    _lower_priority()
    import torch

    torch.set_num_threads(1)
    from unbroken.recovery import statehash  # noqa: F401  (imported for the first copy)


def _noop() -> None:
    """A task for the helper that only makes its pool start it (`BuddyOpinions.prestart`)."""


def _unchanged(ref: CopyRef) -> bool:
    """Whether `ref`'s slot still holds that copy (its manifest, of the same generation)."""
    try:
        now = read_manifest(ref.rank_dir, ref.slot)
    except (OSError, ValueError, CorruptCopyError):
        return False
    return now is not None and now.generation == ref.manifest.generation


def _procs(pool: concurrent.futures.ProcessPoolExecutor) -> list[Any]:
    """`pool`'s processes (its process table is private, hence the guard)."""
    return list((getattr(pool, "_processes", None) or {}).values())


def _helper_cpu_s(pool: concurrent.futures.ProcessPoolExecutor) -> float | None:
    """The CPU seconds `pool`'s helper process used so far (None: it has none, or it is
    gone)."""
    procs = _procs(pool)
    if not procs:
        return None
    try:
        return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)
    except (psutil.Error, OSError, ValueError):
        return None


def _result(
    pool: concurrent.futures.ProcessPoolExecutor, fut: concurrent.futures.Future[Any]
) -> Any:
    """`fut`'s result: waited for while the helper uses CPU (a starved helper is slow, not
    hung), up to HELPER_MAX_S; TimeoutError once it used none for HELPER_TIMEOUT_S."""
    deadline = time.monotonic() + HELPER_MAX_S
    used = _helper_cpu_s(pool)
    while True:
        try:
            return fut.result(HELPER_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            now = _helper_cpu_s(pool)
            if used is None or now is None or now <= used or time.monotonic() > deadline:
                raise
            used = now
            log.info("sdc.buddy_opinion_slow", helper_cpu_s=round(now, 2),
                     why="the helper works, slowly (a busy host): waiting on")  # fmt: skip


def _stop(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Shut `pool` down without waiting, its process killed: a helper that hangs in a
    recomputation would outlive a plain shutdown (this Python's executor has no
    `terminate_workers`)."""
    procs = _procs(pool)
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()


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

    # where the recomputation runs (a torch device name; torch is imported only there: in
    # the helper process with `helper`, else in this one at the first opinion)
    device: str = field(default_factory=lambda: os.environ.get(DEVICE_ENV, "") or "cpu")
    kept: collections.deque[Opinion] = field(default_factory=lambda: collections.deque(maxlen=KEPT))
    formed: int = 0  # opinions formed (metrics, tests)
    failed: int = 0
    skipped: int = 0  # copies written over before their opinion was formed
    # recompute in a helper process (an agent's), not in this one (tests, tools)
    helper: bool = False
    _pool: concurrent.futures.ProcessPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _helper(self) -> concurrent.futures.ProcessPoolExecutor:
        """The helper process, started if there is none (call under `_lock`)."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),  # not a fork of the agent
                initializer=_helper_start,
                initargs=(os.getpid(),),
            )
        return self._pool

    def prestart(self) -> bool:
        """Start the helper now, if it is to be one and none runs: its torch import then
        happens while this agent idles, not when the first fingerprinted copy arrives.
        A spare's first copies arrive right after its promotion, and the import (~3 s of
        CPU) ran beside the new world's first step: in `make run`'s node loss the helper
        took 0.29 s of CPU during that 0.68 s step (a /proc sampler, 2026-12-07). Returns
        whether it started one."""
        if not self.helper:
            return False
        with self._lock:
            if self._pool is not None:
                return False
            pool = self._helper()
        try:
            pool.submit(_noop)  # a process pool spawns its process at the first task
        except (BrokenProcessPool, RuntimeError, OSError) as e:
            log.warning("sdc.helper_not_started", error=str(e))  # the first copy retries
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            _stop(pool)
            return False
        log.info("sdc.helper_started", why="prestarted while the agent idles")
        return True

    def close(self) -> None:
        """Stop the helper process (the agent is going away)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            _stop(pool)

    def form(self, node: str, ref: CopyRef) -> Opinion | None:
        """Recompute the fingerprints of `node`'s copy `ref` when it is a fingerprinted one
        (blocking: call it off the event loop); keeps and returns the opinion."""
        meta = ref.manifest.meta.get(SDC_META)
        if not isinstance(meta, dict):
            return None
        t0 = time.perf_counter()
        m = ref.manifest
        if not self.helper:
            fps, error = recompute(ref, meta, self.device)
        else:
            with self._lock:
                pool = self._helper()
            try:
                fps, error = _result(pool, pool.submit(recompute, ref, meta, self.device))
            except (BrokenProcessPool, concurrent.futures.TimeoutError, OSError) as e:
                # the helper died or hangs: this copy has no opinion, the next one a new helper
                fps, error = {}, f"the opinion helper failed: {type(e).__name__}: {e}"[:500]
                with self._lock:
                    if self._pool is pool:
                        self._pool = None
                _stop(pool)
        if not _unchanged(ref):
            # a newer copy took its slot meanwhile (the replica server receives on while an
            # opinion forms): what was read may be part of either, so no opinion of it
            with self._lock:
                self.skipped += 1
            log.info("sdc.buddy_opinion_skipped", node=node, rank=m.rank, step=m.step,
                     why="the copy was written over while its opinion formed")  # fmt: skip
            return None
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
