"""A writer's ring of slots: mapping the owner's files, and choosing the slot a save fills.

The owner (`FlashOwner`, the agent) sizes a rank's slots; the writer maps them here. The
first `EAGER_SLOTS` are mapped (and faulted in) before the first save, the rest by a
background thread beside the training. A save fills an empty slot, else the oldest copy;
never the newest complete copy, a slot whose copy is still being written, or the newest
copy marked for persistence until the agent has persisted it (at most `PIN_TIMEOUT_S`).
Which slots hold which generation is cached and re-read only when a manifest changed
(`ManifestWatch`): a save does not list the ring.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from unbroken.common.sdckeys import SDC_META
from unbroken.recovery.cudacopy import CudaCopier
from unbroken.recovery.flashcopy import (
    MIN_SLOTS,
    data_path,
    list_copies,
    manifest_path,
    manifest_sig,
    read_keep_mark,
    read_persisted_mark,
    slot_manifest_ident,
    slots,
    spared_slots,
    tensor_views,
)
from unbroken.recovery.flashowner import SlotProvider
from unbroken.recovery.flashplan import Plan
from unbroken.recovery.manifestwatch import ManifestWatch

log = structlog.get_logger(__name__)

PIN_TIMEOUT_S = 120.0  # a copy marked for persistence keeps its slot at most this long
EAGER_SLOTS = MIN_SLOTS  # slots a (re)start maps before its first step; the rest meanwhile


def _sig_with(sig: tuple[Any, ...] | None, slot: int, ident: Any) -> tuple[Any, ...] | None:
    """`sig` (a `manifest_sig`, by slot order) with `slot`'s entry replaced; None (re-list at
    the next save) when the ring's slots are not 0..n-1."""
    if sig is None or not 0 <= slot < len(sig):
        return None
    return (*sig[:slot], ident, *sig[slot + 1 :])


class WriterRing:
    """One rank's slots as its writer sees them.

    Args:
        rank: the global rank whose ring this is.
        provider: sizes the slots (the agent over its hook socket, or a FlashOwner).
        cuda: registers slots as pinned memory when the state has GPU tensors.
    """

    def __init__(self, rank: int, provider: SlotProvider, cuda: CudaCopier) -> None:
        self.rank = rank
        self._provider = provider
        self._cuda = cuda
        self.dir: Path | None = None
        self._capacity = 0
        self.nslots = 0
        self.maps: dict[int, mmap.mmap] = {}
        # Slots past the first EAGER_SLOTS are mapped by a background thread (a restart
        # then waits for two slots' page tables, not the whole ring's); `map` maps a slot
        # at once if a save needs it first.
        self._map_lock = threading.Lock()
        self._mapper: threading.Thread | None = None
        self._map_stop = threading.Event()
        self.mapper_plan: Plan | None = None  # views the mapper builds for its slots
        self.ready_s: float | None = None  # how long mapping the whole ring took
        # slot -> (plan layout, its non-empty entries' positions, tensors over their bytes)
        self._views: dict[int, tuple[int, list[int], list[torch.Tensor]]] = {}
        self.generation = -1  # the newest generation written or found in the ring
        self._lock = threading.Lock()
        self.known: dict[int, int] = {}  # slot -> generation of its complete copy
        self.sig: tuple[Any, ...] | None = None  # manifest_sig that `known` reflects
        # the ring directory's change events: which manifests to stat before a save
        self.watch: ManifestWatch | None = None
        self._manifests: list[str] = []  # slot -> its manifest's path
        self._pin: tuple[int, int, float] | None = None  # (slot, generation, since)
        # the agent's keep mark (generations of verified steps) and the watch's count of
        # its events when it was read (-1: read it at the next save)
        self._kept: frozenset[int] = frozenset()
        self._kept_seen = -1
        self.checked: set[int] = set()  # generations of fingerprinted copies (`SDC_META`)

    # ------------------------------------------------------------ mapping

    def ensure(self, nbytes: int) -> Path:
        """The rank's directory, its slots reserved for `nbytes` and the first ones mapped."""
        if self.dir is None or nbytes > self._capacity:
            self.unmap()
            self.dir = Path(self._provider.reserve(self.rank, nbytes))
            self._capacity = nbytes
            self.nslots = len(slots(self.dir))
            self._manifests = [os.fspath(manifest_path(self.dir, s)) for s in range(self.nslots)]
            # watched before the next `manifest_sig`, so no change falls between the two
            if self.watch is not None:
                self.watch.close()
            self.watch = ManifestWatch.open(self.dir)
            self.sig = None
            self._kept_seen = -1
            t0 = time.perf_counter()
            eager = min(self.nslots, EAGER_SLOTS)
            for slot in range(eager):  # map (and fault in) what the next saves need now
                self.map(slot)
            self.ready_s = None
            if eager < self.nslots:  # ...and the rest beside the training
                self._mapper = threading.Thread(
                    target=self._map_rest,
                    args=(eager, self.nslots, t0),
                    name=f"flash-{self.rank}_map",
                    daemon=True,
                )
                self._mapper.start()
            else:
                self.ready_s = time.perf_counter() - t0
        if self.generation < 0:
            refs = list_copies(self.dir)
            self.generation = refs[0].manifest.generation if refs else 0
        return self.dir

    def slot_views(
        self, slot: int, buf: mmap.mmap, plan: Plan
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The plan's non-empty entries (their positions) and a tensor over each one's bytes
        in `slot`, built once per slot and layout (`prepare` builds them for every slot;
        they keep the slot's mapping exported: `unmap` drops them first)."""
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
            buf = self.map(slot)
            plan = self.mapper_plan
            if plan is not None and slot not in self._views:
                # a writable mapping: no warnings filter (it is process-wide, not the
                # thread's; the training thread may be inside one)
                used = [i for i, e in enumerate(plan.entries) if e.nbytes]
                views = tensor_views(buf, [plan.entries[i] for i in used], quiet=False)
                self._views.setdefault(slot, (plan.layout, used, views))
            if plan is not None and plan.cuda:  # pragma: no cover - needs a GPU
                # pinned here (0.06 s per GiB), not inside the save that first takes it
                self._cuda.register(slot, buf)
        self.ready_s = time.perf_counter() - t0

    def wait(self, timeout_s: float = 600.0) -> None:
        """Block until every slot of the ring is mapped (tests, benchmarks)."""
        if self._mapper is not None:
            self._mapper.join(timeout_s)

    def unmap(self) -> None:
        """Drop every slot's mapping (and the tensor views over them)."""
        if self._mapper is not None:  # it finishes the slot it is mapping, then stops
            self._map_stop.set()
            self._mapper.join()
            self._mapper = None
            self._map_stop.clear()
        self._views.clear()
        if self._cuda.registered:  # pragma: no cover - needs a GPU
            self._cuda.unregister(self.maps)
        for m in self.maps.values():
            m.close()
        self.maps.clear()

    def map(self, slot: int) -> mmap.mmap:
        """The slot's mapping, made now if no one made it yet."""
        m = self.maps.get(slot)
        if m is not None:
            return m
        with self._map_lock:  # the mapper thread maps the ring's later slots
            m = self.maps.get(slot)
            if m is None:
                assert self.dir is not None
                fd = os.open(data_path(self.dir, slot), os.O_RDWR)
                try:
                    size = os.fstat(fd).st_size
                    # MAP_POPULATE builds the page tables now: without it the first copy
                    # into a slot runs at page-fault speed (~0.3 GB/s here instead of
                    # ~6.7 GB/s). mmap releases the GIL meanwhile.
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    m = mmap.mmap(fd, size, flags=flags)
                finally:
                    os.close(fd)
                self.maps[slot] = m
        return m

    def close(self) -> None:
        """Unmap the slots and stop watching the directory (the files stay: the owner's)."""
        self.unmap()
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    # ------------------------------------------------------------ choosing a slot

    def _pin_holds(self, rank_dir: Path) -> int | None:
        """The pinned slot while its copy awaits persistence, else None (pin released)."""
        if self._pin is None:
            return None
        slot, gen, since = self._pin
        if self.known.get(slot, gen) != gen:  # invalidated by the owner (a discard)
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
        base = self.sig
        dirty = self.watch.changed() if self.watch is not None else None
        if dirty is None or base is None or len(base) != self.nslots:
            return manifest_sig(rank_dir, self.nslots)
        if not dirty:
            return base
        sig = list(base)
        for slot in dirty:
            if slot < self.nslots:
                sig[slot] = slot_manifest_ident(rank_dir, slot)
        return tuple(sig)

    def free_slot(self, rank_dir: Path, writing: set[int]) -> int | None:
        """The slot the next save fills, or None when every slot is taken.

        Args:
            rank_dir: the ring's directory.
            writing: the slots whose copies are still being written.
        """
        sig = self._manifest_sig(rank_dir)
        with self._lock:
            if sig != self.sig:  # another process changed a manifest (a discard, a restore)
                refs = list_copies(rank_dir)
                self.known = {r.slot: r.manifest.generation for r in refs}
                self.checked = {r.manifest.generation for r in refs if SDC_META in r.manifest.meta}
                self.sig = sig
            known = dict(self.known)
            checked = set(self.checked)
        busy = set(writing)
        if known:
            busy.add(max(known, key=lambda s: known[s]))
        busy |= spared_slots(known, self._keep_mark(rank_dir), checked, self.nslots)
        free = [s for s in range(self.nslots) if s not in busy]
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

    def _keep_mark(self, rank_dir: Path) -> frozenset[int]:
        """The generations the agent's keep mark spares, read again only when the watch saw
        the mark change (every save when there is no watch)."""
        seen = self.watch.keep_changes() if self.watch is not None else -1
        if seen < 0 or seen != self._kept_seen:
            self._kept = read_keep_mark(rank_dir)
            self._kept_seen = seen
        return self._kept

    def release_pin(self) -> None:
        """Let the next save reuse the pinned slot (only the pin kept every slot taken)."""
        self._pin = None

    def pin(self, slot: int, generation: int) -> None:
        """Keep `slot` (its copy marked for persistence) until the agent has persisted it."""
        if self.nslots > MIN_SLOTS:  # a ring of 2 never pins
            self._pin = (slot, generation, time.monotonic())

    def invalidate(self, slot: int) -> None:
        """Unlink `slot`'s manifest before a save overwrites its data."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._manifests[slot])  # (a string: pathlib cost ~40 us per save)
        with self._lock:
            self.checked.discard(self.known.pop(slot, -1))
            self.sig = _sig_with(self.sig, slot, None)  # our own change: no re-listing

    def written(self, slot: int, generation: int, ident: Any, checked: bool = False) -> None:
        """Record our own manifest of `generation` in `slot` (its identity taken before the
        rename: a change by another process since then still differs at the next save);
        `checked`: a fingerprinted copy (spared until its verdict, `spared_slots`)."""
        with self._lock:
            self.checked.discard(self.known.get(slot, -1))
            if checked:
                self.checked.add(generation)
            self.known[slot] = generation
            self.sig = _sig_with(self.sig, slot, ident)
