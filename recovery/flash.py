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
`unbroken.recovery.flashcopy`; this module re-exports it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import mmap
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from unbroken.common.loopthread import current_cpu, lower_this_thread, pin_this_thread
from unbroken.recovery.flashcopy import (
    ALIGN,
    CHECKSUM_ALGO,
    CHECKSUM_CHUNK,
    LOCAL_STORE,
    MANIFEST_VERSION,
    MIN_SLOTS,
    PERSIST_META,
    UNSEALED,
    CopyRef,
    CorruptCopyError,
    FlashError,
    Manifest,
    ManifestWatch,
    NoCopyError,
    ShmTooSmallError,
    TensorEntry,
    checksum,
    data_path,
    dtype_from_name,
    find_copy,
    list_copies,
    load_object,
    manifest_path,
    manifest_sig,
    new_hasher,
    open_copy,
    read_copy,
    read_manifest,
    read_persisted_mark,
    replica_store,
    seal,
    slot_manifest_ident,
    slots,
    tensor_view,
    tensor_views,
    write_manifest,
    write_raw_copy,
)
from unbroken.recovery.flashowner import FlashConfig, FlashOwner, SlotProvider

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

PIN_TIMEOUT_S = 120.0  # a copy marked for persistence keeps its slot at most this long
EAGER_SLOTS = MIN_SLOTS  # slots a (re)start maps before its first step; the rest meanwhile
# Overlapped saves of GPU state: the training thread enqueues the device-to-host copies
# inside `save_async` (False), or the writer's thread does (True). bench/checkpoint.py
# measures both in one run; on an H200 (gpt3d 125m, 1 GB of state, 82 ms steps) the
# throughput with a save every step was 0.916 of none enqueued by the training thread and
# 0.875 by the writer's (bench/results/checkpoint-cuda-3.json), 0.875 and 0.863 before the
# trainer prefetched its batches (checkpoint-cuda-2.json).
CUDA_COPY_ON_WRITER = False
# The manifest waits for those copies by polling their event (True) or in
# cudaEventSynchronize (False); bench/flash_gpu_probe.py measures both.
CUDA_WAIT_POLL = True

# The copy format is re-exported: callers import everything flash from here.
__all__ = [
    "ALIGN",
    "CHECKSUM_ALGO",
    "CHECKSUM_CHUNK",
    "LOCAL_STORE",
    "MANIFEST_VERSION",
    "CopyRef",
    "CorruptCopyError",
    "FlashConfig",
    "FlashError",
    "FlashOwner",
    "FlashWriter",
    "Manifest",
    "NoCopyError",
    "SaveHandle",
    "Shared",
    "ShmTooSmallError",
    "SlotProvider",
    "Snapshot",
    "TensorEntry",
    "checksum",
    "data_path",
    "dtype_from_name",
    "find_copy",
    "list_copies",
    "load_into",
    "load_object",
    "manifest_path",
    "manifest_sig",
    "new_hasher",
    "open_copy",
    "read_copy",
    "read_manifest",
    "replica_store",
    "seal",
    "tensor_view",
    "write_manifest",
    "write_raw_copy",
]


# An optimizer's param groups flatten into hundreds of small values per save (lr, betas,
# eps... per parameter), nearly all repeats; torch.save costs ~40 µs each, which made the
# snapshot of a tiny model's state take longer than its copy. Immutable values are encoded
# once. The key holds the repr, so that -0.0 and 0.0 (equal, same hash) stay apart.
_SCALARS = (bool, int, float, str, type(None))
_DUMPED: dict[tuple[type, str], bytes] = {}
_DUMPED_MAX = 4096


_PLAIN_REPR_MAX = 1 << 16  # longer plain values are encoded each time, not kept


def _immutable(value: Any) -> bool:
    return type(value) in _SCALARS or (
        type(value) is tuple and all(type(v) in _SCALARS for v in value)
    )


def _plain(value: Any, depth: int = 0) -> bool:
    """Built of scalars, lists, tuples and str-or-scalar-keyed dicts only: its repr then
    names its bytes (an optimizer's `params` list, a data position dict), so an equal value
    is encoded once."""
    t = type(value)
    if t in _SCALARS:
        return True
    if depth > 4:
        return False
    if t is list or t is tuple:
        return all(type(v) in _SCALARS for v in value) or all(_plain(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) in _SCALARS and _plain(v, depth + 1) for k, v in value.items())
    return False


def _torch_save(value: Any, *, legacy: bool) -> bytes:
    out = io.BytesIO()
    torch.save(value, out, _use_new_zipfile_serialization=not legacy)
    return out.getvalue()


@functools.cache
def _legacy_frame() -> tuple[bytes, bytes] | None:
    """torch's legacy format around a tensor-free value: (head, tail), where the bytes are
    head + pickle(value, protocol 2) + tail; None if this torch frames it otherwise.

    Found from torch.save itself and checked on probes, so no private constant of
    torch.serialization is assumed: 0.3 us per value instead of 14 us (a step's few
    changed values were a third of a save's time on the training thread)."""
    empty = pickle.dumps(None, protocol=2)
    whole = _torch_save(None, legacy=True)
    at = whole.rfind(empty)
    if at < 0:
        return None
    head, tail = whole[:at], whole[at + len(empty) :]
    for probe in (12345, (0.9, 0.95), "s", -0.0):
        if head + pickle.dumps(probe, protocol=2) + tail != _torch_save(probe, legacy=True):
            return None
    return head, tail


def _dump_object(value: Any) -> bytes:
    if type(value) is int:  # a counter (step, data position): new every save, not kept
        return _dump_plain(value)
    plain = _plain(value)
    key = None
    if plain:
        text = repr(value)
        key = (type(value), text) if len(text) <= _PLAIN_REPR_MAX else None
    if key is not None and key in _DUMPED:
        return _DUMPED[key]
    raw = _dump_plain(value) if plain else _torch_save(value, legacy=False)
    if key is not None:
        if len(_DUMPED) >= _DUMPED_MAX:
            _DUMPED.clear()
        _DUMPED[key] = raw
    return raw


def _dump_plain(value: Any) -> bytes:
    """A tensor-free value in torch's legacy (pickle) format, framed by hand where this torch
    frames as probed. The legacy format is 155 bytes for a float, the zip format 1261: it
    keeps a manifest with hundreds of small values small. torch.load reads both."""
    frame = _legacy_frame()
    if frame is None:
        return _torch_save(value, legacy=True)
    return frame[0] + pickle.dumps(value, protocol=2) + frame[1]


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


def _sig_with(sig: tuple[Any, ...] | None, slot: int, ident: Any) -> tuple[Any, ...] | None:
    """`sig` (a `manifest_sig`, by slot order) with `slot`'s entry replaced; None (re-list at
    the next save) when the ring's slots are not 0..n-1."""
    if sig is None or not 0 <= slot < len(sig):
        return None
    return (*sig[:slot], ident, *sig[slot + 1 :])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@functools.lru_cache(maxsize=4096)
def _shard_layout(
    shape: torch.Size, mesh: Any, placements: tuple[Any, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Cached: computing it for every DTensor took longer than copying a tiny model's state.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def _global_layout(
    key: str, t: torch.Tensor, local: torch.Tensor
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(t, DTensor):
        shape, offset = _shard_layout(t.shape, t.device_mesh, tuple(t.placements))
        if shape != tuple(local.shape):
            raise ValueError(
                f"{key}: DTensor local shard {tuple(local.shape)} is not the logical "
                f"shard {shape} (padded shards cannot be flash-saved)"
            )
        return tuple(t.shape), offset
    return tuple(t.shape), (0,) * t.dim()


# ---------------------------------------------------------------- writer side (worker)


@dataclass(slots=True)
class _Plan:
    keys: list[str]
    entries: tuple[TensorEntry, ...]
    objects: dict[str, Any]
    nbytes: int
    tensors: list[torch.Tensor]  # the local tensors (DTensor shards), detached
    index: dict[str, int] = field(default_factory=dict)  # key -> position in `tensors`
    dumped: dict[str, bytes] = field(default_factory=dict)  # objects, serialised once
    values: dict[str, Any] = field(default_factory=dict)  # the objects `dumped` serialised
    cuda: bool = False  # a tensor lives on a GPU: the copy is enqueued, not threaded
    layout: int = 0  # hash of `entries`: plans of equal layout share a slot's tensor views
    shared: dict[str, Any] = field(default_factory=dict)  # `Shared` name -> immutable value


@dataclass(frozen=True, slots=True)
class Shared:
    """One small value that many flattened keys hold, in a flat `Snapshot.fresh()` under a
    name of its own: an optimizer's param-group value (the learning rate, the betas) is
    one value per parameter group but one key per parameter in DCP's flattened state.
    The writer serialises it once and, while the value is the same immutable object as at
    the last save, does not look at its keys at all (a 430-key optimizer state took most
    of a save's blocking time)."""

    keys: tuple[str, ...]
    value: Any


@dataclass(frozen=True, slots=True)
class Snapshot:
    """How to take a cheap snapshot of a state whose tensors stay the same objects.

    Training updates parameters and optimizer state in place, so the flattened state's
    tensors (and the plan of where each goes in a slot) are the same from step to step:
    only the small values change (step, data position, learning rate, RNG). The writer
    builds the plan from `full()` once per `key`, then takes only `fresh()` each save.

    Attributes:
        key: changes whenever a tensor of the state may have been replaced (a load, a
            reshard, an optimizer that created its state); equal keys promise the same
            tensor objects, updated in place.
        full: the whole state dict (as `save` takes it).
        fresh: the values that change between saves, nested as in `full()`; a tensor
            here (the RNG state) replaces the planned one for this save and must keep its
            shape and dtype. A key that `full()` did not have makes the save take the full
            path (logged once).
        flat: `fresh()` returns the values already flattened, under the dotted keys DCP's
            `flatten_state_dict` gives `full()` (the writer skips flattening: for a model
            with hundreds of parameters that was most of a save's blocking time); a
            `Shared` value there stands for each of its keys.
    """

    key: Any
    full: Callable[[], Mapping[str, Any]]
    fresh: Callable[[], Mapping[str, Any]]
    flat: bool = False


@torch.no_grad()  # DTensor.to_local() then records no autograd node (60 % of the cost)
def _plan(flat: Mapping[str, Any]) -> _Plan:
    keys, entries, objects, tensors, off = [], [], {}, [], 0
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            objects[key] = value
            continue
        local = _local(value).detach()
        gshape, goffset = _global_layout(key, value, local)
        nbytes = local.numel() * local.element_size()
        entries.append(
            TensorEntry(
                key,
                str(local.dtype).removeprefix("torch."),
                tuple(local.shape),
                off,
                nbytes,
                gshape,
                goffset,
            )
        )
        keys.append(key)
        tensors.append(local)
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    index = {k: i for i, k in enumerate(keys)}
    cuda = any(t.is_cuda for t in tensors)
    layout = (tuple(entries), off)
    return _Plan(keys, layout[0], objects, off, tensors, index, cuda=cuda, layout=hash(layout))


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

    A save picks the slot to fill: an empty one, else the oldest copy, never the newest
    complete copy, a slot whose copy is still being written, or the newest copy marked
    for persistence until the agent says it is persisted (`PERSISTED_MARK`; at most
    `PIN_TIMEOUT_S`). An overlapped save's copy and manifest run on one writer thread, so
    a save never waits for the previous save's manifest while the ring has a
    free slot; when it has none, `skip_if_busy` skips the save (counted in
    `skipped_busy`) instead.

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
        self._dir: Path | None = None
        self._capacity = 0
        self._nslots = 0
        self._maps: dict[int, mmap.mmap] = {}
        # Slots past the first EAGER_SLOTS are mapped by a background thread (a restart
        # then waits for two slots' page tables, not the whole ring's); `_map` maps a slot
        # at once if a save needs it first.
        self._map_lock = threading.Lock()
        self._mapper: threading.Thread | None = None
        self._map_stop = threading.Event()
        self._mapper_plan: _Plan | None = None  # views the mapper builds for its slots
        self.ring_ready_s: float | None = None  # how long mapping the whole ring took
        # slot -> (plan layout, its non-empty entries' positions, tensors over their bytes)
        self._views: dict[int, tuple[int, list[int], list[torch.Tensor]]] = {}
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
        self._generation = -1
        self._lock = threading.Lock()
        self._known: dict[int, int] = {}  # slot -> generation of its complete copy
        self._sig: tuple[Any, ...] | None = None  # manifest_sig that `_known` reflects
        # the ring directory's change events: which manifests to stat before a save
        self._watch: ManifestWatch | None = None
        self._manifests: list[str] = []  # slot -> its manifest's path
        self._pin: tuple[int, int, float] | None = None  # (slot, generation, since)
        self._cache: tuple[Any, _Plan] | None = None  # (Snapshot.key, plan)
        self._cache_miss_logged = False
        self._cuda_registered: set[int] = set()
        self._register_lock = threading.Lock()  # the mapper thread registers its slots too
        self._side_streams: dict[torch.device, Any] = {}  # device -> the copies' stream
        self.saves = 0  # saves started
        self.skipped_busy = 0  # saves skipped: no free slot in the ring
        self.snapshot_hits = 0  # saves that reused the cached plan (Snapshot)
        # the copy thread follows the training thread's core (`_follow_to`); the CPU it is
        # pinned to (read and written by that thread only)
        self._follow = os.environ.get(FOLLOW_CORE_ENV, "1") != "0"
        self._writer_cpu: int | None = None

    @property
    def copies(self) -> int:
        """Slots in this rank's ring (0 before the first save or `prepare`)."""
        return self._nslots

    def _ensure(self, nbytes: int) -> Path:
        if self._dir is None or nbytes > self._capacity:
            self._unmap()
            self._dir = Path(self._provider.reserve(self.rank, nbytes))
            self._capacity = nbytes
            self._nslots = len(slots(self._dir))
            self._manifests = [os.fspath(manifest_path(self._dir, s)) for s in range(self._nslots)]
            # watched before the next `manifest_sig`, so no change falls between the two
            if self._watch is not None:
                self._watch.close()
            self._watch = ManifestWatch.open(self._dir)
            self._sig = None
            t0 = time.perf_counter()
            eager = min(self._nslots, EAGER_SLOTS)
            for slot in range(eager):  # map (and fault in) what the next saves need now
                self._map(slot)
            self.ring_ready_s = None
            if eager < self._nslots:  # ...and the rest beside the training
                self._mapper = threading.Thread(
                    target=self._map_rest,
                    args=(eager, self._nslots, t0),
                    name=f"flash-{self.rank}_map",
                    daemon=True,
                )
                self._mapper.start()
            else:
                self.ring_ready_s = time.perf_counter() - t0
        if self._generation < 0:
            refs = list_copies(self._dir)
            self._generation = refs[0].manifest.generation if refs else 0
        return self._dir

    def _slot_views(
        self, slot: int, buf: mmap.mmap, plan: _Plan
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The plan's non-empty entries (their positions) and a tensor over each one's bytes
        in `slot`, built once per slot and layout (`prepare` builds them for every slot;
        they keep the slot's mapping exported: `_unmap` drops them first)."""
        hit = self._views.get(slot)
        if hit is not None and hit[0] == plan.layout:
            return hit[1], hit[2]
        used = [i for i, e in enumerate(plan.entries) if e.nbytes]
        dsts = tensor_views(buf, [plan.entries[i] for i in used])
        self._views[slot] = (plan.layout, used, dsts)
        return used, dsts

    def _map_rest(self, first: int, end: int, t0: float) -> None:
        """The mapper thread: map slots `first`..`end - 1` and build their tensor views."""
        for slot in range(first, end):
            if self._map_stop.is_set():
                return
            buf = self._map(slot)
            plan = self._mapper_plan
            if plan is not None and slot not in self._views:
                # a writable mapping: no warnings filter (it is process-wide, not the
                # thread's; the training thread may be inside one)
                used = [i for i, e in enumerate(plan.entries) if e.nbytes]
                views = tensor_views(buf, [plan.entries[i] for i in used], quiet=False)
                self._views.setdefault(slot, (plan.layout, used, views))
            if plan is not None and plan.cuda:  # pragma: no cover - needs a GPU
                # pinned here (0.06 s per GiB), not inside the save that first takes it
                self._register_cuda(slot)
        self.ring_ready_s = time.perf_counter() - t0

    def wait_ring(self, timeout_s: float = 600.0) -> None:
        """Block until every slot of the ring is mapped (tests, benchmarks)."""
        if self._mapper is not None:
            self._mapper.join(timeout_s)

    def _unmap(self) -> None:
        """Drop every slot's mapping (and the tensor views over them)."""
        if self._mapper is not None:  # it finishes the slot it is mapping, then stops
            self._map_stop.set()
            self._mapper.join()
            self._mapper = None
            self._map_stop.clear()
        self._views.clear()
        if self._cuda_registered:  # pragma: no cover - needs a GPU
            self._unregister_cuda()
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def _map(self, slot: int) -> mmap.mmap:
        m = self._maps.get(slot)
        if m is not None:
            return m
        with self._map_lock:  # the mapper thread maps the ring's later slots
            m = self._maps.get(slot)
            if m is None:
                assert self._dir is not None
                fd = os.open(data_path(self._dir, slot), os.O_RDWR)
                try:
                    size = os.fstat(fd).st_size
                    # MAP_POPULATE builds the page tables now: without it the first copy
                    # into a slot runs at page-fault speed (~0.3 GB/s here instead of
                    # ~6.7 GB/s). mmap releases the GIL meanwhile.
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    m = mmap.mmap(fd, size, flags=flags)
                finally:
                    os.close(fd)
                self._maps[slot] = m
        return m

    def prepare(self, state_dict: Mapping[str, Any]) -> int:
        """Size and map the ring for `state_dict` ahead of the first save.

        Call it once at start-up (outside the training step): allocating and faulting in
        the shared memory costs far more than a copy into it (see bench/checkpoint.py).
        The first `EAGER_SLOTS` slots are mapped (and, with CUDA tensors in the state,
        registered as pinned memory) before this returns; the rest of the ring is mapped
        by a background thread (a fresh 16-copy ring of 1 GiB took 9.8 s to map on an H100
        host: tmpfs zeroes each page at its first fault), which also registers each slot
        (0.06 s per GiB); a save that takes a slot first maps and registers it itself.

        Returns:
            The bytes per slot.
        """
        flat, _ = flatten_state_dict(_resolve_stateful(state_dict))
        plan = _plan(flat)
        self._mapper_plan = plan
        self._ensure(plan.nbytes)
        for slot in range(self._nslots):  # ~10 µs per tensor and slot: not in a save
            buf = self._maps.get(slot)
            if buf is None:
                continue  # the mapper's, views included
            self._slot_views(slot, buf, plan)
            if plan.cuda:  # pragma: no cover - needs a GPU
                self._register_cuda(slot)
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
        embedded trainer's `train_step`, a plugin trainer).

        Args:
            optimizers: the optimizers to guard; None guards every optimizer in the process
                (torch's global step pre-hook), for trainers that do not expose theirs.

        Returns:
            The hook handles (`.remove()` uninstalls them).
        """

        def wait_before_step(*_: Any) -> None:
            self.wait_copied()

        if optimizers is None:
            return [register_optimizer_step_pre_hook(wait_before_step)]
        return [opt.register_step_pre_hook(wait_before_step) for opt in optimizers]

    # ------------------------------------------------------------ choosing a slot

    def _reap(self) -> None:
        """Forget finished saves; a failed one raises here, once."""
        for slot, h in list(self._inflight.items()):
            if h.done():
                del self._inflight[slot]
                h._result(0.0)

    def _pin_holds(self, rank_dir: Path) -> int | None:
        """The pinned slot while its copy awaits persistence, else None (pin released)."""
        if self._pin is None:
            return None
        slot, gen, since = self._pin
        if self._known.get(slot, gen) != gen:  # invalidated by the owner (a discard)
            self._pin = None
            return None
        mark = read_persisted_mark(rank_dir)
        if mark is not None and mark >= gen:
            self._pin = None
            return None
        if time.monotonic() - since > PIN_TIMEOUT_S:
            log.warning(
                "flash.pin_expired",
                rank=self.rank,
                generation=gen,
                waited_s=PIN_TIMEOUT_S,
                why="the agent did not persist the copy; its slot is reused",
            )
            self._pin = None
            return None
        return slot

    def _manifest_sig(self, rank_dir: Path) -> tuple[Any, ...]:
        """`manifest_sig` now: only the slots the watch saw change are statted."""
        base = self._sig
        dirty = self._watch.changed() if self._watch is not None else None
        if dirty is None or base is None or len(base) != self._nslots:
            return manifest_sig(rank_dir, self._nslots)
        if not dirty:
            return base
        sig = list(base)
        for slot in dirty:
            if slot < self._nslots:
                sig[slot] = slot_manifest_ident(rank_dir, slot)
        return tuple(sig)

    def _free_slot(self, rank_dir: Path) -> int | None:
        """The slot the next save fills, or None when every slot is taken."""
        self._reap()
        sig = self._manifest_sig(rank_dir)
        with self._lock:
            if sig != self._sig:  # another process changed a manifest (a discard, a restore)
                self._known = {r.slot: r.manifest.generation for r in list_copies(rank_dir)}
                self._sig = sig
            known = dict(self._known)
        busy = set(self._inflight)
        if known:
            busy.add(max(known, key=lambda s: known[s]))
        free = [s for s in range(self._nslots) if s not in busy]
        if not free:
            return None

        def oldest() -> int:
            return min(free, key=lambda s: (s in known, known.get(s, -1), s))

        choice = oldest()
        # the agent's persisted mark is read only when the pinned slot would be reused
        # (a file read per save otherwise, ~50 us on the training thread)
        if self._pin is not None and choice == self._pin[0]:
            pinned = self._pin_holds(rank_dir)
            if pinned is not None:
                free.remove(pinned)
                if not free:
                    return None
                choice = oldest()
        return choice

    # ------------------------------------------------------------ taking the snapshot

    def _take(
        self, state: Mapping[str, Any] | Snapshot
    ) -> tuple[_Plan, list[torch.Tensor], dict[str, bytes]]:
        """The plan, this save's tensors and its serialised small values."""
        if not isinstance(state, Snapshot):
            flat, _ = flatten_state_dict(_resolve_stateful(state))
            plan = _plan(flat)
            return plan, list(plan.tensors), {k: _dump_object(v) for k, v in plan.objects.items()}
        if self._cache is not None and self._cache[0] == state.key:
            plan = self._cache[1]
            got = self._fresh(plan, state)
            if got is not None:
                self.snapshot_hits += 1
                return plan, got[0], got[1]
        flat, _ = flatten_state_dict(_resolve_stateful(state.full()))
        plan = _plan(flat)
        plan.dumped = {k: _dump_object(v) for k, v in plan.objects.items()}
        plan.values = {k: v for k, v in plan.objects.items() if _immutable(v)}
        self._cache = (state.key, plan)
        return plan, list(plan.tensors), dict(plan.dumped)

    def _fresh(
        self, plan: _Plan, snap: Snapshot
    ) -> tuple[list[torch.Tensor], dict[str, bytes]] | None:
        # (no `torch.no_grad()`: it cost ~10 % of a save; `detach()` keeps the copy's
        # sources out of any graph)
        if snap.flat:
            flat = snap.fresh()
        else:
            flat, _ = flatten_state_dict(_resolve_stateful(snap.fresh()))
        sources = list(plan.tensors)
        dumped = dict(plan.dumped)
        values = plan.values
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                i = plan.index.get(key)
                local = _local(value).detach()
                if (
                    i is None
                    or tuple(local.shape) != plan.entries[i].shape
                    or str(local.dtype).removeprefix("torch.") != plan.entries[i].dtype
                    or local.device != plan.tensors[i].device
                ):
                    self._miss(key)
                    return None
                sources[i] = local
            elif type(value) is Shared:
                if plan.shared.get(key, dumped) is value.value:
                    continue  # the same immutable as at the last save: its keys' bytes hold
                if any(k not in dumped for k in value.keys):
                    self._miss(next(k for k in value.keys if k not in dumped))
                    return None
                blob = _dump_object(value.value)
                for k in value.keys:
                    dumped[k] = plan.dumped[k] = blob
                    values.pop(k, None)
                if _immutable(value.value):
                    plan.shared[key] = value.value
                else:
                    plan.shared.pop(key, None)
            elif key in dumped:
                if values.get(key, dumped) is not value:  # the same immutable: same bytes
                    dumped[key] = plan.dumped[key] = _dump_object(value)
                    if _immutable(value):
                        values[key] = value
                    else:
                        values.pop(key, None)
            else:
                self._miss(key)
                return None
        return sources, dumped

    def _miss(self, key: str) -> None:
        if not self._cache_miss_logged:
            self._cache_miss_logged = True
            log.warning(
                "flash.snapshot_full_path",
                rank=self.rank,
                key=key,
                why="a fresh value is not in the cached plan; this save reads the full state",
            )
        self._cache = None

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
        pending, self._pending = self._pending, None
        if pending is not None:
            # In a training loop the guard made sure the previous copy is out; its
            # manifest is never waited for.
            if skip_if_busy and not pending.copied():
                self._pending = pending
                self.skipped_busy += 1
                return None
            try:
                pending.wait_copied(600.0)
            except BaseException:  # a failed copy is reported once, here
                self._inflight = {s: h for s, h in self._inflight.items() if h is not pending}
                raise
        early_dir = self._dir if skip_if_busy else None
        early = self._free_slot(early_dir) if early_dir is not None else None
        if early_dir is not None and early is None:
            self.skipped_busy += 1
            log.debug("flash.skipped_busy", rank=self.rank, step=step, copies=self._nslots)
            return None
        plan, sources, objects = self._take(state)
        rank_dir = self._ensure(plan.nbytes)
        # the slot found free above still is (only this thread takes slots) unless the
        # ring was reserved again for a larger state
        slot = early if rank_dir == early_dir else self._free_slot(rank_dir)
        while slot is None:
            if skip_if_busy:
                self.skipped_busy += 1
                return None
            if self._inflight:
                oldest = min(self._inflight.values(), key=lambda h: h.generation)
                oldest._result(600.0)
            else:  # only a pin blocks (a ring of 2 never pins): release it
                self._pin = None
            slot = self._free_slot(rank_dir)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._manifests[slot])  # (a string: pathlib cost ~40 us per save)
        with self._lock:
            self._known.pop(slot, None)
            self._sig = _sig_with(self._sig, slot, None)  # our own change: no re-listing
        buf = self._map(slot)
        self._generation += 1
        generation = self._generation
        events: list[Any] = []
        # GPU state saved overlapped: the writer's thread enqueues the copies, after the
        # work the caller's streams hold now (an event each), not after what comes next
        on_writer = overlap and plan.cuda and CUDA_COPY_ON_WRITER and self._progress_hook is None
        ready: dict[torch.device, Any] = {}
        if on_writer:  # pragma: no cover - needs a GPU
            for src in sources:
                if isinstance(src, torch.Tensor) and src.is_cuda and src.device not in ready:
                    ready[src.device] = torch.cuda.Event()
                    ready[src.device].record(torch.cuda.current_stream(src.device))

        def copy() -> None:
            used, dsts = self._slot_views(slot, buf, plan)
            if self._progress_hook is None and not plan.cuda:
                # the common case, with as little Python as possible before the copy
                # releases the GIL: this thread starts while the training thread still
                # runs the step's report, which waited for every bytecode held here
                if used:
                    torch._foreach_copy_(dsts, [sources[i] for i in used])
            elif self._progress_hook is None:
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
                    events.append((dev, self._copy_from_cuda(slot, dev, ds, ss, ready.get(dev))))
            else:
                views = dict(zip(used, dsts, strict=True))
                for i, src in enumerate(sources):
                    dst = views.get(i)
                    if dst is not None and src.is_cuda:  # pragma: no cover - needs a GPU
                        events.append(
                            (src.device, self._copy_from_cuda(slot, src.device, [dst], [src]))
                        )
                    elif dst is not None:
                        dst.copy_(src)
                    if self._progress_hook is not None:
                        self._progress_hook(i)
            sources.clear()  # the state's tensors are free to change (and to be freed)

        def finish() -> Manifest:
            copied.result()  # a failed copy never gets a manifest
            for _, event in events:  # pragma: no cover - needs a GPU
                # polled, not `event.synchronize()`: on an H200 (the ad-hoc probe that is
                # now bench/flash_gpu_probe.py; prefetched batches, one run) the 125m
                # preset with a save every step ran at 0.929 of no saves while this thread
                # sat in cudaEventSynchronize and at 0.963 polling (0.939 and 0.979 with
                # the writer's thread enqueuing)
                if not CUDA_WAIT_POLL:
                    event.synchronize()
                while not event.query():
                    time.sleep(0.0005)
            manifest = Manifest(
                rank=self.rank,
                step=step,
                generation=generation,
                data_nbytes=plan.nbytes,
                checksum=UNSEALED,  # hashed when it leaves this memory (`seal`)
                entries=plan.entries,  # the same tuple every save: its JSON is cached
                objects=objects,
                meta=dict(meta or {}),
                created_unix=time.time(),
            )
            ident = write_manifest(rank_dir, slot, manifest)
            with self._lock:
                self._known[slot] = generation
                # our own manifest's identity, taken before the rename: a change by another
                # process (a discard) since then still differs from it at the next save
                self._sig = _sig_with(self._sig, slot, ident)
            return manifest  # (no per-save log line: a debug call costs ~30 us unlogged)

        copied: Future[None]
        job: _Once[None] | None = None
        # a fresh tensor has its planned one's device (`_fresh` checks)
        if overlap and (not plan.cuda or on_writer):
            # One writer thread copies (GPU state: enqueues the copies) and then writes the
            # manifest (no checksum: `seal`).
            # (Leaving the manifest to the training thread's next optimizer step, 0.2 s at
            # most, cost nothing measurable once the manifest was its 4 KB head: trainer
            # alone, eight runs of on/off blocks each, 0.955 against 0.957 of the steps per
            # second without saves; but a SIGKILLed worker then lost one step more.)
            job = _Once(copy)
            copied = job.done
            fin = _Once(finish)
            cpu = current_cpu() if self._follow and not plan.cuda else None

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
            fin = _Once(finish)
            self._sums.submit(fin.run)
        if events and not overlap:  # pragma: no cover - needs a GPU
            # `save`: the caller may change the state once it returns, so its stream
            # waits for the copies now; `save_async` leaves that to `wait_copied`
            # (the optimizer guard), and the copy overlaps the next forward and backward.
            for dev, event in events:
                torch.cuda.current_stream(dev).wait_event(event)
        handle = SaveHandle(copied, fin.done, time.perf_counter() - t0, job, fin)
        if overlap and plan.cuda:  # pragma: no cover - needs a GPU
            handle._on_device = True
            # filled by `copy` (maybe still running on the writer's thread): read only once
            # `copied` is done
            handle._device_events = events
        handle.generation = generation
        self._inflight[slot] = handle
        self._pending = handle
        self.saves += 1
        if self._nslots > MIN_SLOTS and (meta or {}).get(PERSIST_META, True) is not False:
            self._pin = (slot, generation, time.monotonic())
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

    def _register_cuda(self, slot: int) -> None:  # pragma: no cover - needs a GPU
        """Register the slot's whole mapping as pinned memory once (async DMA into it).

        If CUDA refuses (e.g. a locked-memory limit), the copies still work, from pageable
        memory: the driver stages them, and each blocks the host for its length.
        """
        with self._register_lock:
            self._register_cuda_locked(slot)

    def _register_cuda_locked(self, slot: int) -> None:  # pragma: no cover - needs a GPU
        if slot in self._cuda_registered:
            return
        m = self._map(slot)
        ptr = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, len(m), 0)
        if int(err) != 0:
            log.warning(
                "flash.pin_failed",
                rank=self.rank,
                slot=slot,
                bytes=len(m),
                cuda_error=int(err),
                effect="device-to-host copies into this slot block the training thread",
                fix="raise the locked-memory limit (ulimit -l) of the worker",
            )
            return
        self._cuda_registered.add(slot)

    def _unregister_cuda(self) -> None:  # pragma: no cover - needs a GPU
        """Undo `_register_cuda` before the mappings go (a new mapping may reuse the range)."""
        for slot in sorted(self._cuda_registered):
            m = self._maps.get(slot)
            if m is not None:
                ptr = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._cuda_registered.clear()

    def _copy_from_cuda(
        self,
        slot: int,
        device: torch.device,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        ready: Any = None,
    ) -> Any:  # pragma: no cover - needs a GPU
        """Enqueue the device-to-host copies of `srcs` on the writer's side stream, into
        the slot's pinned views `dsts`, after `ready` (an event the caller recorded at the
        save; None: after the work already on the calling thread's stream).

        Returns the event recorded after them: the caller's stream waits for it before it
        may change `srcs` (`SaveHandle.wait_copied`, the optimizer guard); the host waits
        only in the writer's thread, before the manifest.
        """
        self._register_cuda(slot)
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device)
        if ready is not None:
            side.wait_event(ready)
        else:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
        return event

    def _drain(self, timeout_s: float = 600.0) -> None:
        """Wait until every save in flight is valid (a failed one raises)."""
        if self._pending is not None:
            self._pending.wait(timeout_s)
        for h in list(self._inflight.values()):
            h._result(timeout_s)
        self._reap()

    def invalidate_snapshot(self) -> None:
        """Forget the cached plan: the next `Snapshot` save reads the full state."""
        self._cache = None

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
        self._cache = None  # loading may replace the state's tensors
        rank_dir = Path(self._provider.reserve(self.rank, 0))
        ref = find_copy(rank_dir, step)
        data = read_copy(ref)
        plain = _resolve_stateful(state_dict)
        try:
            load_into(plain, ref.manifest, data)
        finally:
            data.close()
        for key, value in state_dict.items():
            if isinstance(value, Stateful):
                value.load_state_dict(plain[key])
            else:
                state_dict[key] = plain[key]
        self._generation = max(self._generation, ref.manifest.generation)
        return ref.manifest

    def close(self, timeout_s: float = 600.0) -> None:
        """Finish the saves in flight and unmap the slots (the files stay: the owner's)."""
        self._drain(timeout_s)
        self._pool.shutdown(wait=True)
        self._sums.shutdown(wait=True)
        self._unmap()
        if self._watch is not None:
            self._watch.close()
            self._watch = None


def _resolve_stateful(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level `Stateful` values replaced by their state dicts, as DCP does."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


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
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            e = by_key[key]
            dst = _local(value)
            if tuple(dst.shape) != e.shape:
                raise ValueError(
                    f"{key}: saved local shape {e.shape} != target {tuple(dst.shape)}; the "
                    "parallel layout changed, restore through unbroken.recovery.reshard"
                )
            with torch.no_grad():
                dst.copy_(tensor_view(data, e))
        elif key in manifest.objects:
            set_element(state_dict, mapping[key], load_object(manifest.objects[key]))
