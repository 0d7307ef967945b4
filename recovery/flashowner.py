"""The owner side of flash checkpoints (the agent): shared-memory slots per rank, no torch.

Split out of `unbroken.recovery.flash` so that the node agent and the driver, which
only reserve, list, discard and persist copies, never import torch (1-5 s and hundreds
of MB per process on a loaded machine). `unbroken.recovery.flash` re-exports all of it.

The flash root holds a model's weights and decides what a node restores, so it is closed
to other local users (once `nobody` read the weights from 0644 files, and a
pre-created `/dev/shm/unbroken/<node>` symlink made the agent's cleanup delete an unrelated
directory): directories are created 0700 and files 0600; an existing root that is a
symlink, not a directory, or not owned by this user is refused with `UnsafeFlashRootError`;
so is one under a directory another user could rename it in (`secure_dir`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from unbroken.recovery.flashcopy import (
    LOCAL_STORE,
    MIN_SLOTS,
    CopyRef,
    FlashError,
    ShmTooSmallError,
    data_path,
    list_copies,
    manifest_path,
    slots,
)

log = structlog.get_logger(__name__)

FLASH_COPIES = 0  # the ring's size per rank; 0: from the tmpfs budget and the state's size
# An automatic ring never grows past this. 16, not 8: the buddy replica is sent every
# k - REPLICA_MARGIN saves, so a deeper ring for a small state means fewer sends (a
# tiny state's agent spent ~6 % of a core sending and receiving replicas at k = 8).
MAX_AUTO_COPIES = 16
RING_SHARE = 0.25  # of the tmpfs, what the rings of one node's ranks may take together
# In a store while its agent fetches copies into it (a spare taking a lost node's ranks from
# their buddy, `FlashOwner.fetching`): the workers started meanwhile read the store after.
FETCHING = ".fetching"


# ---------------------------------------------------------------- owner side (agent)


class UnsafeFlashRootError(FlashError):
    """The flash directory is a symlink, not ours, or open to other users' renames."""


def _check_parent(path: Path) -> None:
    """Refuse `path` when a directory above it lets another user replace it."""
    me = os.geteuid()
    for parent in path.parents:
        try:
            lst, st = os.lstat(parent), os.stat(parent)
        except FileNotFoundError:
            continue
        for s in (lst, st):
            if s.st_uid not in (me, 0):
                raise UnsafeFlashRootError(
                    f"{parent} (above the flash directory {path}) belongs to uid {s.st_uid}, "
                    "who could replace it; choose a flash directory (--flash-dir) under a "
                    "directory you or root own"
                )
        if st.st_uid != me and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeFlashRootError(
                f"{parent} is writable by others without the sticky bit; choose another --flash-dir"
            )


def secure_dir(path: Path) -> None:
    """Make `path` (and its missing parents) a directory only this user can enter.

    Missing components are created 0700. An existing `path` that is a symlink, not a
    directory, or owned by another user is refused; one of ours with a looser mode is
    tightened to 0700. The directories above must be ours or root's (sticky when others
    may write them, as /dev/shm and /tmp are).

    Raises:
        UnsafeFlashRootError: naming the component and what is wrong with it.
    """
    me = os.geteuid()
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    _check_parent(missing[-1] if missing else path)
    if not missing:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise UnsafeFlashRootError(
                f"flash directory {path} is a symlink or not a directory; refused (remove "
                "it, or choose another --flash-dir)"
            )
        if st.st_uid != me:
            raise UnsafeFlashRootError(
                f"flash directory {path} exists and belongs to uid {st.st_uid}, not to this "
                f"agent (uid {me}); refused (remove it, or choose another --flash-dir)"
            )
        if st.st_mode & 0o077:
            os.chmod(path, 0o700)
        return
    for q in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another agent of ours, at this moment
            os.mkdir(q, 0o700)
        st = os.lstat(q)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
            raise UnsafeFlashRootError(f"{q} was replaced while it was created; refused")
        os.chmod(q, 0o700)


def open_private(path: Path, flags: int) -> int:
    """os.open for a slot file: created 0600, never through a symlink."""
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o600)


@dataclass(kw_only=True, slots=True)
class FlashConfig:
    """Where flash copies live and how much shared memory must stay free."""

    root: str = "/dev/shm/unbroken"
    job: str = "default"
    headroom_bytes: int = 64 << 20  # left free for everything else on the tmpfs
    # Copies kept per rank (the ring): one being written, one being checksummed, the newest
    # complete one, and older ones a loss-spike rollback may return to from memory. 0 sizes
    # it from the budget: `ring_share` of the tmpfs split over the node's `local_ranks`, at
    # most MAX_AUTO_COPIES; an explicit count is reduced (never under 2) only when the tmpfs
    # cannot hold it.
    copies: int = FLASH_COPIES
    ring_share: float = RING_SHARE
    local_ranks: int = 1

    def __post_init__(self) -> None:
        if self.copies != 0 and not MIN_SLOTS <= self.copies <= 64:
            raise ValueError(
                f"FlashConfig.copies must be 0 (automatic) or in [{MIN_SLOTS}, 64], "
                f"got {self.copies}"
            )
        if self.local_ranks < 1:
            raise ValueError(f"FlashConfig.local_ranks must be >= 1, got {self.local_ranks}")
        if not 0 < self.ring_share <= 1:
            raise ValueError(f"FlashConfig.ring_share must be in (0, 1], got {self.ring_share}")
        if not self.root:
            raise ValueError("FlashConfig.root must name a directory on a tmpfs, e.g. /dev/shm")
        if not self.job or "/" in self.job:
            raise ValueError(f"FlashConfig.job must be a plain name, got {self.job!r}")
        if self.headroom_bytes < 0:
            raise ValueError(f"FlashConfig.headroom_bytes must be >= 0, got {self.headroom_bytes}")


class SlotProvider(Protocol):
    """What a writer needs from its owner: a ring of >= 2 slots of `nbytes` for `rank`."""

    def reserve(self, rank: int, nbytes: int) -> str:
        """Size the ring of `rank` to hold `nbytes` per slot; return the rank's directory."""
        ...


class FlashOwner:
    """The agent's side: creates and sizes slots, lists copies, deletes, keeps retention."""

    def __init__(self, config: FlashConfig) -> None:
        self.config = config
        # (file, from, to): byte ranges `reserve` allocated that nobody touched yet; the
        # agent pre-faults them (`prefault`) before a worker maps them
        self.grown: list[tuple[Path, int, int]] = []
        self.job_dir = Path(config.root) / config.job
        secure_dir(Path(config.root))
        secure_dir(self.job_dir)

    def rank_dir(self, rank: int, store: str = LOCAL_STORE) -> Path:
        """The directory of `rank`'s slots in `store`."""
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        return self.job_dir / store / f"rank-{rank:05d}"

    def fetching(self, store: str) -> Path:
        """The marker saying `store` is being filled from elsewhere (`FETCHING`)."""
        return self.job_dir / store / FETCHING

    def reserve(self, rank: int, nbytes: int, store: str = LOCAL_STORE) -> str:
        """Size the ring of `rank` to `nbytes` per slot, allocating the memory now.

        The ring gets `config.copies` slots, fewer (never under 2) when the tmpfs cannot
        hold them with the headroom left free; a ring that exists keeps its slot count.

        Raises:
            ShmTooSmallError: the tmpfs cannot hold even 2 slots; the message says how
                much is needed.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        d = self.rank_dir(rank, store)
        secure_dir(d)
        have_slots = slots(d)
        sizes = {s: data_path(d, s).stat().st_size for s in have_slots}
        st = os.statvfs(d)
        wanted = self.config.copies or self._auto_copies(nbytes, st.f_blocks * st.f_frsize)
        k = max(len(have_slots), MIN_SLOTS) if have_slots else wanted

        def grow_for(n: int) -> int:
            return sum(max(0, nbytes - sizes.get(s, 0)) for s in range(n))

        if grow_for(k):
            free = st.f_bavail * st.f_frsize
            room = free - self.config.headroom_bytes
            while k > MIN_SLOTS and grow_for(k) > room:
                k -= 1
            if grow_for(k) + self.config.headroom_bytes > free:
                raise ShmTooSmallError(
                    f"flash checkpoint for rank {rank} needs {_gib(grow_for(k))} more in "
                    f"{self.config.root} ({k} slots x {_gib(nbytes)}, plus "
                    f"{_gib(self.config.headroom_bytes)} headroom) but only {_gib(free)} is "
                    "free; enlarge the tmpfs (docker: --shm-size; host: mount -o "
                    "remount,size=... /dev/shm) or point FlashConfig.root elsewhere"
                )
            for slot in range(k):
                p = data_path(d, slot)
                with os.fdopen(open_private(p, os.O_WRONLY | os.O_APPEND), "ab") as f:
                    if (had := f.tell()) < nbytes:
                        # posix_fallocate makes tmpfs allocate now: a full tmpfs fails here
                        # with a clear error instead of SIGBUS in the middle of a save.
                        os.posix_fallocate(f.fileno(), 0, nbytes)
                        self.grown.append((p, had, nbytes))
            if k < wanted and not have_slots:
                log.warning(
                    "flash.ring_reduced",
                    rank=rank,
                    copies=k,
                    wanted=wanted,
                    why="the tmpfs cannot hold more copies of this size",
                )
            log.info("flash.reserved", rank=rank, store=store, nbytes=nbytes, copies=k)
        return str(d)

    def prefault(self, threads: int = 0) -> float:
        """Touch the pages `reserve` allocated since the last call (`grown`), so the worker
        that maps them only builds page tables: tmpfs zeroes a page at its first fault, and
        on a VM the host backs it then (2.2 s per GB on this project's VM, against 0.1 s
        per GB to map a touched page). Slots are done in ring order (the first saves use
        the first slots), each in parallel chunks on `threads` threads (0: up to 8, as the
        machine's cores allow). Returns the seconds it took."""
        todo, self.grown = self.grown, []
        if not todo:
            return 0.0
        t0 = time.monotonic()
        n = threads or max(1, min(8, os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="flash-prefault") as pool:
            for path, lo, hi in todo:
                step = max(PREFAULT_CHUNK, -(-(hi - lo) // n))
                step += -step % mmap.PAGESIZE
                lo -= lo % mmap.PAGESIZE
                chunks = [(c, min(hi, c + step)) for c in range(lo, hi, step)]
                try:
                    list(pool.map(lambda c, p=path: _touch(p, *c), chunks))
                except FileNotFoundError:
                    continue  # the ring was deleted meanwhile: nothing left to warm
        return time.monotonic() - t0

    def _auto_copies(self, nbytes: int, tmpfs_bytes: int) -> int:
        """Copies per rank from the budget: `ring_share` of the tmpfs over the local ranks."""
        budget = tmpfs_bytes * self.config.ring_share / self.config.local_ranks
        fit = int(budget // nbytes) if nbytes else MAX_AUTO_COPIES
        return max(MIN_SLOTS, min(MAX_AUTO_COPIES, fit))

    def stores(self) -> list[str]:
        """Store names present (`local`, `replica-<node>`...)."""
        with os.scandir(self.job_dir) as it:
            return sorted(e.name for e in it if e.is_dir())

    def ranks(self, store: str = LOCAL_STORE) -> list[int]:
        """Ranks with a directory in `store`."""
        # (os.listdir, not pathlib: the agent's flash thread asks ten times a second)
        try:
            names = os.listdir(f"{os.fspath(self.job_dir)}/{store}")
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(n.split("-")[1]) for n in names if n.startswith("rank-"))

    def copies(self, store: str = LOCAL_STORE) -> dict[int, list[CopyRef]]:
        """Every rank's copies in `store`, newest first."""
        return {r: list_copies(self.rank_dir(r, store)) for r in self.ranks(store)}

    def newest(self, rank: int, store: str = LOCAL_STORE) -> CopyRef | None:
        """The newest copy of `rank` in `store`, if any."""
        refs = list_copies(self.rank_dir(rank, store))
        return refs[0] if refs else None

    def discard_newer_than(self, step: int, store: str = LOCAL_STORE) -> int:
        """Invalidate copies after `step` (after a rollback they belong to a dead timeline)."""
        n = 0
        for refs in self.copies(store).values():
            for ref in refs:
                if ref.manifest.step > step:
                    manifest_path(ref.rank_dir, ref.slot).unlink(missing_ok=True)
                    n += 1
        return n

    def delete_rank(self, rank: int, store: str = LOCAL_STORE) -> None:
        """Remove `rank`'s slots from `store`."""
        shutil.rmtree(self.rank_dir(rank, store), ignore_errors=True)

    def delete_store(self, store: str) -> None:
        """Remove a whole store (e.g. a replica of a node that left the ring)."""
        shutil.rmtree(self.job_dir / store, ignore_errors=True)

    def used_bytes(self) -> int:
        """Bytes allocated by this job's slots."""
        return sum(p.stat().st_blocks * 512 for p in self.job_dir.rglob("*.data"))

    def cleanup(self) -> None:
        """Remove everything this job holds in shared memory."""
        shutil.rmtree(self.job_dir, ignore_errors=True)


PREFAULT_CHUNK = 64 << 20  # a thread's share of a slot is at least this many bytes
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's madvise through ctypes: it releases the GIL, so chunks fault in parallel
    (mmap.madvise holds it)."""
    fn = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), "madvise", None)
    if fn is not None:
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        fn.restype = ctypes.c_int
    return fn


def _touch(path: Path, lo: int, hi: int) -> None:
    """Fault in bytes [lo, hi) of `path` (page-aligned `lo`) for writing, leaving them as
    they are: MADV_POPULATE_WRITE, else (an older kernel) a write of each page's first
    byte through the mapping."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size < hi:
            return  # deleted and reserved again, smaller: not the ring this was for
        m = mmap.mmap(fd, hi - lo, flags=mmap.MAP_SHARED, offset=lo)
    finally:
        os.close(fd)
    try:
        fn = _madvise()
        view = ctypes.c_char.from_buffer(m)
        try:
            done = fn is not None and fn(ctypes.addressof(view), hi - lo, MADV_POPULATE_WRITE) == 0
        finally:
            del view
        if not done:
            page = mmap.PAGESIZE
            for off in range(0, hi - lo, page):  # no data lost: each byte written as read
                m[off] = m[off]
    finally:
        m.close()


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
