"""Flash checkpoints: each rank's sharded state copied into node-local shared memory.

Why files under /dev/shm and not `multiprocessing.shared_memory`: in Python 3.11 a
`SharedMemory` segment is registered with the creating process's resource tracker, which
unlinks it when that process dies, which is the exact moment a flash copy must survive.
Plain tmpfs files have no such tracker: they live until someone unlinks them. The node
agent is that someone (the *owner* side, `FlashOwner`: create and size slots, list copies,
delete, retention); a worker only maps the files its owner sized for it (the *writer* side,
`FlashWriter`: save and load). The narrow interface between them is `SlotProvider`, which
the agent can serve over its local hook socket and tests serve in-process.

Each rank has two slots (double buffering). A save first invalidates the slot that does
not hold the newest valid copy (its manifest is unlinked), copies every tensor into it,
and only then writes the slot's manifest atomically (write to a temporary file, rename).
A manifest is what makes a copy valid, so a crash mid-copy leaves the last complete copy
intact. An overlapped save's copy and manifest run on one writer thread, one after the
other, so a copy is valid a few milliseconds after the save returns and a killed worker
loses only the step it was in. A save does not hash its bytes: a writer's copy is
*unsealed*, and whoever sends it out of this memory (the agent's buddy sender and
persister, a restore's broadcast) hashes it then (`flashcopy.seal`), about once a second
instead of every step.

Two ways to save. `save` copies in the caller's thread: on CPU it blocks for one memcpy
(~0.2 s per GB here). `save_async` (the mode for training loops) snapshots only what
training changes before the next optimizer step (the small values: step, data position,
param groups, RNG) and copies the tensors on the writer's thread while the next step's
forward and backward run (they do not modify parameters or optimizer state; torch and
xxhash release the GIL while they copy and hash). `guard(optimizers)` makes every
`optimizer.step()` wait until the copy is out, so a loop that cannot be edited (the
embedded trainer) stays exact. What blocks is the snapshot plus any wait in the guard;
on a 2-core machine the copy still competes with the compute for cores and memory
bandwidth, which bench/checkpoint.py measures as step-time overhead. The checksum (taken
when a copy is sealed, and verified on every read of a sealed copy) is xxh3-64 (xxhash):
measured here at
6.5 GB/s against 0.8 GB/s for zlib.crc32 and 2.0 GB/s for xxh64 on the same buffer (under
load; crc32 reached 2.4 GB/s on an idle machine), so verifying a restore costs about as
much as the copy itself instead of several times it. On GPUs the device-to-host copy runs
on a side stream into the shared memory registered as pinned memory, and the training
stream waits for it on the device. The training thread enqueues those copies at the save
(one `cudaMemcpyAsync` per tensor: 2-9 ms of host time for the 333 tensors of the gpt3d
125m preset on an H200); `CUDA_COPY_ON_WRITER` leaves that to the writer's thread (0.5-1 ms
on the training thread), which measured slower there: its copies start later, while the
next step already runs. Allocating and faulting in the slots is paid once, in
`FlashWriter.prepare` at start-up.

Layout: `{root}/{job}/{store}/rank-{r:05d}/slot-{i}.data` and `slot-{i}.manifest`, where
`store` is `local` for this node's own ranks and `replica-{node}` for a buddy's copies.
The format of a copy (manifest, checksum, reading and verifying) lives in
`unbroken.recovery.flashcopy`, the plan of what a save copies in `flashplan`, the ring of
slots (mapping, slot choice, pinning) in `flashring`, and the GPU copies in `cudacopy`;
this module is the save pipeline (`FlashWriter`, `SaveHandle`) and the load.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from unbroken.common.loopthread import current_cpu, lower_this_thread, pin_this_thread
from unbroken.common.sdckeys import SDC_META
from unbroken.recovery import cudacopy, stepguard
from unbroken.recovery.cudacopy import CudaCopier
from unbroken.recovery.flashcopy import (
    PERSIST_META,
    UNSEALED,
    Manifest,
    find_copy,
    load_object,
    read_copy,
    tensor_view,
    write_manifest,
)
from unbroken.recovery.flashowner import SlotProvider
from unbroken.recovery.flashplan import (
    Plan,
    PlanCache,
    Snapshot,
    immutable,
    local_tensor,
    make_plan,
    resolve_stateful,
)
from unbroken.recovery.flashring import WriterRing

log = structlog.get_logger(__name__)
_T = TypeVar("_T")


#: Environment variable: "0" keeps the writer's threads at the training thread's priority.
IDLE_THREADS_ENV = "UNBROKEN_FLASH_IDLE_THREADS"
#: Environment variable: "0" lets the copy thread run on any core (it follows the training
#: thread's core by default: `FlashWriter._follow_to`).
FOLLOW_CORE_ENV = "UNBROKEN_FLASH_FOLLOW_CORE"


def _yield_to_training() -> None:
    """Run the calling thread (a writer's copy and manifest thread) only on CPU time the
    training does not want: Linux's SCHED_IDLE, else the lowest niceness.

    At normal priority a save's copy thread, woken while the training thread still sent
    the step's report, took that thread's core: bench-recovery measured the report at
    0.56 ms (median) with flash saves against 0.11 ms without, and host time per step at
    1.3 ms against 0.1 ms. At SCHED_IDLE the copy runs while the rank waits in its
    collective (0.14 ms, with no slower step), on the rank's own core
    (`FlashWriter._follow_to`). A copy that has not started
    when the optimizer needs the tensors is taken over by the training thread
    (`_Once`), so a starved thread never stalls training; so is a manifest someone waits
    for. Unprivileged threads may
    enter SCHED_IDLE but not leave it; nothing here needs to.
    """
    if os.environ.get(IDLE_THREADS_ENV, "1") == "0":
        return
    lower_this_thread(19, idle=True)


class _Once(Generic[_T]):
    """A save's copy (or its manifest), run once by whichever thread gets to
    it first: the writer's thread, or a thread that waits for it before that thread
    started (the optimizer guard in `SaveHandle.wait_copied`, `SaveHandle.wait`)."""

    def __init__(self, fn: Callable[[], _T]) -> None:
        self._fn: Callable[[], _T] | None = fn
        self._lock = threading.Lock()
        self.done: Future[_T] = Future()

    def run(self) -> bool:
        """Run it here unless another thread has; True when it ran here."""
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is None:
            return False
        try:
            result = fn()
        except BaseException as e:
            self.done.set_exception(e)
        else:
            self.done.set_result(result)
        return True


class SaveHandle:
    """A save in flight, in two phases: *copied* (every tensor of the state has been read,
    the caller may modify them again) and *valid* (its manifest written: unsealed, see
    `flashcopy.seal`).

    `blocked_s` is how long the save held the caller up: the time inside `save` or
    `save_async`, plus any time spent waiting in `wait_copied` (directly, through `wait`
    or through the writer's optimizer guard). A later save that has to wait for this one
    counts that wait as its own.
    """

    def __init__(
        self,
        copied: Future[None],
        valid: Future[Manifest],
        blocked_s: float,
        job: _Once[None] | None = None,
        finish: _Once[Manifest] | None = None,
    ) -> None:
        self._copied = copied
        self._valid = valid
        self.blocked_s = blocked_s
        self._copied_ok = False
        # a copy (a manifest) not yet started is run by the thread waiting for it
        self._job = job
        self._finish = finish
        self.generation = -1  # the copy's manifest generation (set by the writer)
        # CUDA events recorded after the device-to-host copies (GPU state): "copied" for
        # the caller means its stream waits for them, on the device; the host never does.
        self._device_events: list[tuple[torch.device, Any]] = []
        # the copies are enqueued on a device (by the writer's thread, or at the save):
        # the caller's stream waits for `_device_events` once they are enqueued
        self._on_device = False

    def wait_copied(self, timeout_s: float = 600.0) -> None:
        """Block until the state's tensors are copied out; they may be modified after.

        Raises:
            TimeoutError: the copy is not done within `timeout_s`.
        """
        if self._copied_ok:  # the common case, once per optimizer step: no lock taken
            return
        if self._on_device:  # pragma: no cover - needs a GPU (tests/gpu)
            # The caller's stream (the optimizer step's) waits for the copies on the
            # device: the host goes on enqueueing, the GPU orders the writes after the reads.
            # The host waits only until they are enqueued (the writer's thread, a forward
            # and backward ago; or here, if that thread has not started).
            if not self._copied.done():
                t0 = time.perf_counter()
                try:
                    self._run_unstarted(manifest=False)
                    self._copied.result(timeout=timeout_s)
                finally:
                    self.blocked_s += time.perf_counter() - t0
            self._copied.result()  # re-raises a failed enqueue's error
            for device, event in self._device_events:
                torch.cuda.current_stream(device).wait_event(event)
            self._copied_ok = True
            return
        if self._copied.done():
            self._copied.result()  # re-raises a failed copy's error
            self._copied_ok = True
            return
        t0 = time.perf_counter()
        try:
            self._run_unstarted(manifest=False)
            self._copied.result(timeout=timeout_s)
            self._copied_ok = True
        finally:
            self.blocked_s += time.perf_counter() - t0

    def wait(self, timeout_s: float = 600.0) -> Manifest:
        """Block until the copy is valid (copied, manifest written)."""
        self.wait_copied(timeout_s)
        self._run_unstarted(manifest=True)
        return self._valid.result(timeout=timeout_s)

    def _result(self, timeout_s: float) -> Manifest:
        """`wait` without counting the time as this save's blocking."""
        self._run_unstarted(manifest=True)
        self._copied.result(timeout=timeout_s)
        return self._valid.result(timeout=timeout_s)

    def _run_unstarted(self, *, manifest: bool) -> None:
        """Run here what the writer's (idle-priority) threads have not started: the copy,
        and with `manifest` the manifest after it."""
        if self._job is not None and not self._copied.done():
            self._job.run()
        if manifest and self._finish is not None and not self._valid.done():
            self._finish.run()

    def copied(self) -> bool:
        """Whether the tensors are copied out (the state may be modified)."""
        return self._copied.done()

    def done(self) -> bool:
        """Whether the manifest is written (or the save failed)."""
        return self._valid.done()


class FlashWriter:
    """A worker's side: saves its rank's state into the owner's ring of slots, loads it back.

    A save picks the slot to fill (`WriterRing.free_slot`). An overlapped save's copy and
    manifest run on one writer thread, so a save never waits for the previous save's
    manifest while the ring has a free slot; when it has none, `skip_if_busy` skips the
    save (counted in `skipped_busy`) instead.

    Args:
        rank: the global rank whose state this is.
        provider: sizes the slots (the agent over its hook socket, or a FlashOwner).
        progress_hook: called with the index of each tensor after it is copied; a fault
            injection point for drills and tests (e.g. SIGKILL mid-copy).
    """

    def __init__(
        self,
        rank: int,
        provider: SlotProvider,
        *,
        progress_hook: Callable[[int], None] | None = None,
    ) -> None:
        self.rank = rank
        self._provider = provider
        self._progress_hook = progress_hook
        self._cuda = CudaCopier(rank)
        self.ring = WriterRing(rank, provider, self._cuda)
        self._plans = PlanCache(rank)
        # Thread names start with f"flash-{rank}_": the SDK's pacer measures their CPU.
        # Both at idle priority (`_yield_to_training`): the training thread's core is not theirs.
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"flash-{rank}", initializer=_yield_to_training
        )
        self._sums = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"flash-{rank}_sum", initializer=_yield_to_training
        )
        self._pending: SaveHandle | None = None
        self._inflight: dict[int, SaveHandle] = {}  # slot -> save not yet valid
        self.saves = 0  # saves started
        self.skipped_busy = 0  # saves skipped: no free slot in the ring
        # the copy thread follows the training thread's core (`_follow_to`); the CPU it is
        # pinned to (read and written by that thread only)
        self._follow = os.environ.get(FOLLOW_CORE_ENV, "1") != "0"
        self._writer_cpu: int | None = None

    @property
    def copies(self) -> int:
        """Slots in this rank's ring (0 before the first save or `prepare`)."""
        return self.ring.nslots

    @property
    def snapshot_hits(self) -> int:
        """Saves that reused the cached plan (`Snapshot`)."""
        return self._plans.hits

    @property
    def ring_ready_s(self) -> float | None:
        """How long mapping the whole ring took (None while the mapper still runs)."""
        return self.ring.ready_s

    def wait_ring(self, timeout_s: float = 600.0) -> None:
        """Block until every slot of the ring is mapped (tests, benchmarks)."""
        self.ring.wait(timeout_s)

    def prepare(self, state_dict: Mapping[str, Any] | Snapshot) -> int:
        """Size and map the ring for `state_dict` ahead of the first save.

        Call it once at start-up (outside the training step): allocating and faulting in
        the shared memory costs far more than a copy into it (see bench/checkpoint.py).
        The first `EAGER_SLOTS` slots are mapped (and, with CUDA tensors in the state,
        registered as pinned memory) before this returns; the rest of the ring is mapped
        by a background thread (a fresh 16-copy ring of 1 GiB took 9.8 s to map on an H100
        host: tmpfs zeroes each page at its first fault), which also registers each slot
        (0.06 s per GiB); a save that takes a slot first maps and registers it itself.

        A `Snapshot` is planned as its first save would plan it, and the plan is kept for
        that save (which read the full state again: 15-30 ms, tiny model, 2 cores).

        Returns:
            The bytes per slot.
        """
        if isinstance(state_dict, Snapshot):
            plan = self._plans.take(state_dict)[0]
        else:
            flat, _ = flatten_state_dict(resolve_stateful(state_dict))
            plan = make_plan(flat)
        self.ring.mapper_plan = plan
        self.ring.ensure(plan.nbytes)
        for slot in range(self.ring.nslots):  # ~10 µs per tensor and slot: not in a save
            buf = self.ring.maps.get(slot)
            if buf is None:
                continue  # the mapper's, views included
            self.ring.slot_views(slot, buf, plan)
            if plan.cuda:  # pragma: no cover - needs a GPU
                self._cuda.register(slot, buf)
        return plan.nbytes

    def save(
        self,
        state_dict: Mapping[str, Any],
        step: int,
        *,
        meta: Mapping[str, Any] | None = None,
        skip_if_busy: bool = False,
    ) -> SaveHandle | None:
        """Copy `state_dict` (nested dicts/lists of tensors, DTensors and small values).

        Blocks for the copy (on CPU) or to enqueue it (on GPU); the manifest follows in
        the background. When every slot the save may take is busy (a ring of 2 whose
        other slot is still being written), it waits for the oldest
        save in flight, or with `skip_if_busy` skips.

        Args:
            state_dict: what to save; tensors may be DTensors (their local shard is saved).
            step: the training step the state belongs to (after that step's update).
            meta: small JSON-able facts stored in the manifest (e.g. the mesh layout);
                `{"persist": False}` marks a copy for memory only.
            skip_if_busy: when no slot is free, skip this save (return None) instead of
                waiting; for saving at every short step.

        Returns:
            A handle (`handle.wait()` returns the manifest once the copy is valid), or
            None when skipped.
        """
        return self._save(state_dict, step, meta, skip_if_busy, overlap=False)

    def save_async(
        self,
        state_dict: Mapping[str, Any] | Snapshot,
        step: int,
        *,
        meta: Mapping[str, Any] | None = None,
        skip_if_busy: bool = False,
    ) -> SaveHandle | None:
        """Start an overlapped save: the copy runs on the writer's thread while training goes on.

        Only the snapshot blocks: the non-tensor values (step, data position, param groups,
        RNG state) are serialised and the slot is chosen before this returns. The caller
        must not modify a tensor of `state_dict` in place until the copy is done
        (`handle.wait_copied()` or the writer's `wait_copied()`): the next step's forward
        and backward do not (they write activations and `.grad`), its optimizer step does,
        so wait before `optimizer.step()`, or `guard(optimizers)` once and every step waits
        by itself. A model whose forward updates state in place (BatchNorm running
        statistics) must wait before its forward. On GPUs the copy is asynchronous already
        (a side stream); there this is `save`.

        A `Snapshot` instead of a state dict takes the cheap path: the plan and the tensor
        references are built once per `Snapshot.key`, each save takes only the fresh
        small values.

        Args and returns are those of `save`; `handle.blocked_s` grows by the time the
        caller later spends waiting for the copy.
        """
        return self._save(state_dict, step, meta, skip_if_busy, overlap=True)

    def wait_copied(self, timeout_s: float = 600.0) -> None:
        """Block until the save in flight, if any, has copied every tensor out."""
        if self._pending is not None:
            self._pending.wait_copied(timeout_s)

    def guard(
        self, optimizers: Iterable[torch.optim.Optimizer] | None = None
    ) -> list[RemovableHandle]:
        """Make `optimizer.step()` wait first for the copy in flight (`save_async`).

        Install once, in loops that call `step()` inside code you do not control (the
        embedded trainer's `train_step`, a plugin trainer). A step given a closure by one
        of torch's optimizers waits after the closure instead (recovery/stepguard.py).

        Args:
            optimizers: the optimizers to guard; None guards every optimizer in the process
                (torch's global step pre-hook), for trainers that do not expose theirs.

        Returns:
            The hook handles (`.remove()` uninstalls them).
        """
        wait_before_step = stepguard.pre_hook(lambda: self._pending)
        if optimizers is None:
            return [register_optimizer_step_pre_hook(wait_before_step)]
        return [opt.register_step_pre_hook(wait_before_step) for opt in optimizers]

    # ------------------------------------------------------------ the save, in phases

    def _reap(self) -> None:
        """Forget finished saves; a failed one raises here, once."""
        for slot, h in list(self._inflight.items()):
            if h.done():
                del self._inflight[slot]
                h._result(0.0)

    def _free_slot(self, rank_dir: Path) -> int | None:
        self._reap()
        return self.ring.free_slot(rank_dir, set(self._inflight))

    def _settle_previous(self, skip_if_busy: bool) -> bool:
        """Wait until the previous save's copy is out; False: skip this save instead."""
        pending, self._pending = self._pending, None
        if pending is None:
            return True
        # In a training loop the guard made sure the previous copy is out; its manifest is
        # never waited for, but written here when the writer's thread has not started it
        # a step later: on a node without a spare core that idle-priority thread may not
        # run at all, and the manifests then waited for a full ring (16 saves, the newest
        # valid copy 16 steps old) to be written here one by one anyway.
        if skip_if_busy and not pending.copied():
            self._pending = pending
            self.skipped_busy += 1
            return False
        try:
            pending.wait_copied(600.0)
        except BaseException:  # a failed copy is reported once, here
            self._inflight = {s: h for s, h in self._inflight.items() if h is not pending}
            raise
        pending._run_unstarted(manifest=True)
        return True

    def _claim_slot(self, rank_dir: Path, early: int | None, skip_if_busy: bool) -> int | None:
        """The slot this save fills, its old manifest unlinked; None: skipped (busy)."""
        # the slot found free before the snapshot still is (only this thread takes slots)
        # unless the ring was reserved again for a larger state
        slot = early if early is not None else self._free_slot(rank_dir)
        while slot is None:
            if skip_if_busy:
                self.skipped_busy += 1
                return None
            if self._inflight:
                oldest = min(self._inflight.values(), key=lambda h: h.generation)
                oldest._result(600.0)
            else:  # only a pin blocks (a ring of 2 never pins): release it
                self.ring.release_pin()
            slot = self._free_slot(rank_dir)
        self.ring.invalidate(slot)
        return slot

    def _copier(
        self,
        slot: int,
        plan: Plan,
        sources: list[torch.Tensor],
        events: list[tuple[torch.device, Any]],
        ready: dict[torch.device, Any],
    ) -> Callable[[], None]:
        """The copy of `sources` into `slot` (GPU state: its copies enqueued, their events
        appended to `events`)."""
        buf = self.ring.map(slot)
        hook = self._progress_hook
        # The slot's views are built here, on the training thread, not in `copy`: the first
        # save into a slot the mapper thread has not reached builds them (~0.5 ms of Python
        # holding the GIL), and on a starved host the idle-priority copy thread that did it
        # was preempted there for over a second while the optimizer step waited for the
        # copy (bench-recovery, 2026-12-01: a false hang at step 3, a diagnosis, a healthy
        # node evicted as slow).
        used, dsts = self.ring.slot_views(slot, buf, plan)

        def copy() -> None:
            if hook is None and not plan.cuda:
                # the common case, with as little Python as possible before the copy
                # releases the GIL: this thread starts while the training thread still
                # runs the step's report, which waited for every bytecode held here
                if used:
                    torch._foreach_copy_(dsts, [sources[i] for i in used])
            elif hook is None:
                # One call for every tensor (per-tensor Python cost dominated a small
                # state's copy: 1.4 ms for 157 tensors, 0.15 ms as one foreach copy); one
                # thread: two measured no faster (one core reaches the VM's bandwidth).
                host: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
                device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
                for i, view in zip(used, dsts, strict=True):
                    src = sources[i]
                    pair = device.setdefault(src.device, ([], [])) if src.is_cuda else host
                    pair[0].append(view)
                    pair[1].append(src)
                if host[0]:
                    torch._foreach_copy_(host[0], host[1])
                for dev, (ds, ss) in device.items():  # pragma: no cover - needs a GPU
                    events.append((dev, self._cuda.copy(slot, buf, dev, ds, ss, ready.get(dev))))
            else:
                views = dict(zip(used, dsts, strict=True))
                for i, src in enumerate(sources):
                    dst = views.get(i)
                    if dst is not None and src.is_cuda:  # pragma: no cover - needs a GPU
                        events.append(
                            (src.device, self._cuda.copy(slot, buf, src.device, [dst], [src]))
                        )
                    elif dst is not None:
                        dst.copy_(src)
                    hook(i)
            sources.clear()  # the state's tensors are free to change (and to be freed)

        return copy

    def _finisher(
        self,
        copied: Callable[[], Future[None]],
        slot: int,
        rank_dir: Path,
        manifest: Callable[..., Manifest],
        events: list[tuple[torch.device, Any]],
    ) -> Callable[[], Manifest]:
        """The manifest that makes the copy valid (`manifest(created_unix=...)`), written
        once the copy is out."""

        def finish() -> Manifest:
            copied().result()  # a failed copy never gets a manifest
            for _, event in events:  # pragma: no cover - needs a GPU
                self._cuda.wait(event)
            made = manifest(created_unix=time.time())
            ident = write_manifest(rank_dir, slot, made)
            self.ring.written(slot, made.generation, ident, SDC_META in made.meta)
            return made  # (no per-save log line: a debug call costs ~30 us unlogged)

        return finish

    def _save(
        self,
        state: Mapping[str, Any] | Snapshot,
        step: int,
        meta: Mapping[str, Any] | None,
        skip_if_busy: bool,
        overlap: bool,
    ) -> SaveHandle | None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        t0 = time.perf_counter()
        if not self._settle_previous(skip_if_busy):
            return None
        early_dir = self.ring.dir if skip_if_busy else None
        early = self._free_slot(early_dir) if early_dir is not None else None
        if early_dir is not None and early is None:
            self.skipped_busy += 1
            log.debug("flash.skipped_busy", rank=self.rank, step=step, copies=self.copies)
            return None
        plan, sources, objects = self._plans.take(state)
        rank_dir = self.ring.ensure(plan.nbytes)
        slot = self._claim_slot(rank_dir, early if rank_dir == early_dir else None, skip_if_busy)
        if slot is None:
            return None
        self.ring.generation += 1
        generation = self.ring.generation
        manifest = functools.partial(
            Manifest,
            rank=self.rank,
            step=step,
            generation=generation,
            data_nbytes=plan.nbytes,
            checksum=UNSEALED,  # hashed when it leaves this memory (`seal`)
            entries=plan.entries,  # the same tuple every save: its JSON is cached
            objects=objects,
            meta=dict(meta or {}),
        )
        # GPU state saved overlapped: the writer's thread enqueues the copies, after the
        # work the caller's streams hold now (an event each), not after what comes next
        on_writer = (
            overlap and plan.cuda and cudacopy.CUDA_COPY_ON_WRITER and self._progress_hook is None
        )
        ready = CudaCopier.ready_events(sources) if on_writer else {}
        events: list[tuple[torch.device, Any]] = []
        copy = self._copier(slot, plan, sources, events, ready)
        handle = self._launch(copy, slot, rank_dir, manifest, events, overlap, plan.cuda, on_writer)
        handle.generation = generation
        handle.blocked_s = time.perf_counter() - t0
        self._inflight[slot] = handle
        self._pending = handle
        self.saves += 1
        if (meta or {}).get(PERSIST_META, True) is not False:
            self.ring.pin(slot, generation)
        return handle

    def _launch(
        self,
        copy: Callable[[], None],
        slot: int,
        rank_dir: Path,
        manifest: Callable[..., Manifest],
        events: list[tuple[torch.device, Any]],
        overlap: bool,
        cuda: bool,
        on_writer: bool,
    ) -> SaveHandle:
        """Run the copy here or hand it to the writer's thread, and the manifest after it."""
        job: _Once[None] | None = None
        copied: Future[None]
        # a fresh tensor has its planned one's device (`PlanCache` checks)
        if overlap and (not cuda or on_writer):
            # One writer thread copies (GPU state: enqueues the copies) and then writes the
            # manifest (no checksum: `seal`).
            # (Leaving the manifest to the training thread's next optimizer step, 0.2 s at
            # most, cost nothing measurable once the manifest was its 4 KB head: trainer
            # alone, eight runs of on/off blocks each, 0.955 against 0.957 of the steps per
            # second without saves; but a SIGKILLed worker then lost one step more.)
            job = _Once(copy)
            copied = job.done
            fin = _Once(self._finisher(lambda: copied, slot, rank_dir, manifest, events))
            cpu = current_cpu() if self._follow and not cuda else None

            def background() -> None:
                if cpu is not None:
                    self._follow_to(cpu)
                job.run()
                fin.run()

            self._pool.submit(background)
        else:
            copy()
            copied = Future()
            copied.set_result(None)
            fin = _Once(self._finisher(lambda: copied, slot, rank_dir, manifest, events))
            self._sums.submit(fin.run)
        if events and not overlap:  # pragma: no cover - needs a GPU
            # `save`: the caller may change the state once it returns, so its stream
            # waits for the copies now; `save_async` leaves that to `wait_copied`
            # (the optimizer guard), and the copy overlaps the next forward and backward.
            for dev, event in events:
                torch.cuda.current_stream(dev).wait_event(event)
        handle = SaveHandle(copied, fin.done, 0.0, job, fin)
        if overlap and cuda:  # pragma: no cover - needs a GPU
            handle._on_device = True
            # filled by `copy` (maybe still running on the writer's thread): read only once
            # `copied` is done
            handle._device_events = events
        return handle

    def _follow_to(self, cpu: int) -> None:
        """(The copy thread, before a host-memory copy) run on `cpu`, the core the training
        thread saved from, and nowhere else until the next save says otherwise.

        At SCHED_IDLE that thread then copies while its own rank waits in a collective,
        and its reads of the state stay in that core's cache. On another core the same
        copy cost the training thread more than the copy itself: the optimizer's next
        writes to every line the copy read had to take them back from the other core
        (one process, tiny preset, 3 MB a copy: 1.7 ms more training-thread CPU per
        step for a 0.3 ms copy; torch's own thread pool, without the GIL, the same). The
        trainer alone (dp2 on two cores, alternating 6-step blocks, `make
        bench-flash_core`) kept 0.962-0.969 of its step rate with saves on any core and
        0.988 following.
        Where pinning is refused (a cpuset without that CPU), the thread stays where it
        is and stops trying.
        """
        if cpu == self._writer_cpu:
            return
        if pin_this_thread(cpu):
            self._writer_cpu = cpu
        else:
            self._follow = False

    def _drain(self, timeout_s: float = 600.0) -> None:
        """Wait until every save in flight is valid (a failed one raises)."""
        if self._pending is not None:
            self._pending.wait(timeout_s)
        for h in list(self._inflight.values()):
            h._result(timeout_s)
        self._reap()

    def entry_names(self, tensors: list[torch.Tensor]) -> list[str | None]:
        """The entry name each of `tensors` (local tensors of the state) has in the cached
        plan's copies: matched by storage address, shape and dtype (None: not in it)."""
        return self._plans.names_of(tensors)

    def invalidate_snapshot(self) -> None:
        """Forget the cached plan: the next `Snapshot` save reads the full state."""
        self._plans.invalidate()

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> Manifest:
        """Restore this rank's own copy into `state_dict` in place (same layout).

        Tensors (and DTensor local shards) are copied into; non-tensor values are replaced;
        top-level `Stateful` values (e.g. a Trainer) get `load_state_dict`. A sealed copy
        is verified against its checksum first (`open_copy`). For a changed layout use
        `unbroken.recovery.reshard`.

        Raises:
            NoCopyError: no copy (of `step`).
            CorruptCopyError: the copy fails its checksum, is truncated, or was reused.
        """
        self._drain()  # the copies in flight read the tensors loaded into
        self._plans.invalidate()  # loading may replace the state's tensors
        rank_dir = Path(self._provider.reserve(self.rank, 0))
        ref = find_copy(rank_dir, step)
        data = read_copy(ref)
        plain = resolve_stateful(state_dict)
        try:
            load_into(plain, ref.manifest, data)
        finally:
            data.close()
        for key, value in state_dict.items():
            if isinstance(value, Stateful):
                value.load_state_dict(plain[key])
            else:
                state_dict[key] = plain[key]
        self.ring.generation = max(self.ring.generation, ref.manifest.generation)
        return ref.manifest

    def close(self, timeout_s: float = 600.0) -> None:
        """Finish the saves; unmap the slots (files stay); idle-priority threads not joined."""
        self._drain(timeout_s)
        self._pool.shutdown(wait=False)
        self._sums.shutdown(wait=False)
        self.ring.close()


def load_into(
    state_dict: dict[str, Any], manifest: Manifest, data: memoryview | bytearray | mmap.mmap
) -> None:
    """Copy a verified copy into `state_dict` whose tensors have the saved local shapes."""
    flat, mapping = flatten_state_dict(state_dict)
    by_key = {e.fqn: e for e in manifest.entries}
    missing = [k for k, v in flat.items() if isinstance(v, torch.Tensor) and k not in by_key]
    if missing:
        raise ValueError(
            f"the copy of step {manifest.step} lacks {missing[:5]}; the model changed since "
            "the save, restore through unbroken.recovery.reshard instead"
        )
    # equal bytes are decoded once where the value is immutable: an optimizer's param-group
    # values are one key per parameter (the gpt3d tiny preset: 433 keys, 12 distinct
    # values; 31 ms of a restore decoded one by one, 1 ms once each)
    decoded: dict[bytes, Any] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            e = by_key[key]
            dst = local_tensor(value)
            if tuple(dst.shape) != e.shape:
                raise ValueError(
                    f"{key}: saved local shape {e.shape} != target {tuple(dst.shape)}; the "
                    "parallel layout changed, restore through unbroken.recovery.reshard"
                )
            with torch.no_grad():
                dst.copy_(tensor_view(data, e))
        elif key in manifest.objects:
            set_element(state_dict, mapping[key], _decoded(manifest.objects[key], decoded))


_UNSEEN = object()


def _decoded(raw: bytes, memo: dict[bytes, Any]) -> Any:
    """`load_object(raw)`, decoded once per distinct immutable value (`memo`); a mutable
    value is decoded for each key, so no two keys share it."""
    value = memo.get(raw, _UNSEEN)
    if value is _UNSEEN:
        value = load_object(raw)
        if immutable(value):
            memo[raw] = value
    return value
