"""Persistence: the owner writes completed flash copies to durable storage via fsspec.

A flash copy is only as safe as its node. The agent therefore streams every completed
copy to storage in the background (any fsspec URL; a local directory by default),
recomputes the checksum over the bytes it wrote, re-reads the file and verifies it, and
reports each verified "rank shard persisted". `CommitTracker` (pure) turns a full set of
reports, one per rank of the world, into a commit record that the driver appends as a
`CheckpointCommitted` event; nothing is committed while any rank's shard is missing or
unverified. Retention keeps the newest K committed steps.

Reading the flash slot while the worker may overwrite it is optimistic: the manifest is
read, the bytes streamed and checksummed, and the manifest re-read; if the slot changed
the attempt is dropped (a newer copy will be persisted instead).

File format, one file per rank and step (`{url}/step-{step:012d}/rank-{rank:05d}.ubf`):
8-byte magic, 8-byte manifest length, the manifest (JSON with its own crc), the data.
Beside them the same step as a torch.distributed.checkpoint (`recovery/dcpformat.py`), so
`dcp.load(state, checkpoint_id=step_dir)` reads it with torch alone.
"""

from __future__ import annotations

import io
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import structlog

from unbroken.common import workerenv
from unbroken.common.loopthread import lower_this_thread
from unbroken.recovery import dcpformat
from unbroken.recovery.flashcopy import (
    PERSIST_META,
    CopyRef,
    CorruptCopyError,
    Manifest,
    checksum,
    list_copies,
    new_hasher,
    read_manifest,
    seal,
    write_persisted_mark,
)

log = structlog.get_logger(__name__)

TIMELINE_META = "timeline"  # manifest meta key: the job's rollbacks before the copy was saved


def current_timeline() -> int:
    """This worker's timeline (0 outside an agent, or before any rollback)."""
    try:
        # as the agent tells its workers (StartWorkers.timeline; common/workerenv.py)
        return max(0, int(os.environ.get(workerenv.TIMELINE, "0")))
    except ValueError:
        return 0


def persistable(refs: list[CopyRef]) -> list[CopyRef]:
    """The copies (newest first) that may be persisted: all but those marked memory-only."""
    return [r for r in refs if r.manifest.meta.get(PERSIST_META, True) is not False]


MAGIC = b"UBFLASH1"
_HEADER = struct.Struct("<8sQ")
STREAM_CHUNK = 16 << 20


@dataclass(kw_only=True, slots=True)
class PersistConfig:
    """Where and how completed copies are persisted."""

    url: str  # fsspec URL or local directory
    keep: int = 3  # committed steps kept in storage
    queue_size: int = 64  # pending persist requests; older requests are dropped when full
    verify_readback: bool = True  # re-read each written file and check its checksum
    # the writing thread's nice value (0: the starting thread's): bulk writes that wait for
    # idle CPU time rather than delay a training step (the agent: 19)
    nice: int = 0

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("PersistConfig.url must name a directory or fsspec URL")
        if self.keep < 1:
            raise ValueError(f"PersistConfig.keep must be >= 1, got {self.keep}")
        if self.queue_size < 1:
            raise ValueError(f"PersistConfig.queue_size must be >= 1, got {self.queue_size}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"PersistConfig.nice must be in [0, 19], got {self.nice}")


@dataclass(frozen=True, slots=True)
class Persisted:
    """One rank's shard of one step, written and verified."""

    rank: int
    step: int
    uri: str
    nbytes: int
    checksum: int
    timeline: int | None = None  # the copy's TIMELINE_META (rollbacks before it), if any
    seconds: float = 0.0  # how long writing and verifying it took
    node: str = ""  # the node whose agent persisted it (set by the driver's bookkeeping)


@dataclass(frozen=True, slots=True)
class Commit:
    """Every rank's shard of `step` is persisted and verified: commit it."""

    step: int
    uri: str
    nbytes: int
    ranks: int
    checksum: str  # crc32 over the ranks' data checksums in rank order, hex
    # the slowest node's write-and-verify time of its shards (one persister thread per
    # node writes them in turn): how long persisting the step took
    seconds: float = 0.0


def step_dir(url: str, step: int) -> str:
    """The directory holding every rank's file for `step`."""
    return f"{url.rstrip('/')}/step-{step:012d}"


def shard_uri(url: str, step: int, rank: int) -> str:
    """The file of `rank` at `step`."""
    return f"{step_dir(url, step)}/rank-{rank:05d}.ubf"


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    from unbroken.common.storage import url_to_fs  # names the extra when s3fs/gcsfs is missing

    return url_to_fs(url)


def write_shard(
    ref: CopyRef, url: str, *, verify_readback: bool = True, dcp_export: bool = True
) -> Persisted:
    """Stream one flash copy to storage and verify it; then (`dcp_export`) write the same
    state beside it as torch.distributed.checkpoint files (`unbroken.recovery.dcpformat`).

    Raises:
        CorruptCopyError: the slot's bytes do not match its checksum (taken here when
            the copy is unsealed, and compared with the bytes streamed), or the slot was
            overwritten during the write (the partial file is removed), or the file read
            back differs.
    """
    t0 = time.monotonic()
    m = seal(ref)  # a writer's copy is hashed here, once, not at every save
    uri = shard_uri(url, m.step, m.rank)
    fs, path = _fs(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    head = m.to_bytes()
    tmp = path + ".partial"
    hasher = new_hasher()
    try:
        with open(ref.data_path, "rb") as src, fs.open(tmp, "wb") as dst:
            dst.write(_HEADER.pack(MAGIC, len(head)))
            dst.write(head)
            left = m.data_nbytes
            while left:
                chunk = src.read(min(STREAM_CHUNK, left))
                if not chunk:
                    raise CorruptCopyError(f"{ref.data_path} is shorter than its manifest")
                hasher.update(chunk)
                dst.write(chunk)
                left -= len(chunk)
            _sync_file(dst)  # on the medium before it is renamed into place
        crc = hasher.intdigest()
        if crc != m.checksum:
            raise CorruptCopyError(f"{ref.data_path} step {m.step} fails its checksum")
        if read_manifest(ref.rank_dir, ref.slot) != ref.manifest:
            raise CorruptCopyError(f"{ref.data_path} was overwritten while being persisted")
        fs.mv(tmp, path)
        _sync_dir(fs, path.rsplit("/", 1)[0])  # the rename, and the step directory itself
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise
    if verify_readback:
        m2, data = read_shard(uri, verify=True)
    else:
        m2, data = read_shard(uri, verify=False)
    if dcp_export:
        try:  # the standard-format twin: a failed export never costs the copy itself
            dcpformat.write_rank(step_dir(url, m.step), m2, data)
        except Exception as e:
            log.warning("persist.dcp_export_failed", uri=uri, error=str(e))
    return Persisted(
        rank=m.rank,
        step=m.step,
        uri=uri,
        nbytes=m.data_nbytes,
        checksum=crc,
        timeline=int(m.meta[TIMELINE_META]) if TIMELINE_META in m.meta else None,
        seconds=time.monotonic() - t0,
    )


def _sync_file(f: Any) -> None:
    """fsync a file being written through fsspec, where it is a local file.

    Object stores (s3, gcs) have no fsync: a closed object is durable, or the close fails.
    """
    try:
        fd = f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return
    f.flush()
    os.fsync(fd)


def _sync_dir(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """fsync a local directory (and its parent) so renames and new entries survive a crash."""
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return
    for d in (path, os.path.dirname(path.rstrip("/"))):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_shard(uri: str, *, verify: bool = True) -> tuple[Manifest, memoryview]:
    """Read and verify a persisted shard.

    Raises:
        CorruptCopyError: bad magic, truncated, or the checksum does not match.
    """
    fs, path = _fs(uri)
    size = fs.size(path)
    raw = bytearray(size)  # writable, so tensors can view it without a copy
    with fs.open(path, "rb") as f:
        got = f.readinto(raw)
    if got != size:
        raise CorruptCopyError(f"{uri} changed size while read ({got} of {size} bytes)")
    if len(raw) < _HEADER.size:
        raise CorruptCopyError(f"{uri} truncated: {len(raw)} bytes, no header")
    magic, mlen = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptCopyError(f"{uri} is not an unbroken shard (magic {magic!r})")
    end = _HEADER.size + mlen
    if len(raw) < end:
        raise CorruptCopyError(f"{uri} truncated inside its manifest")
    manifest = Manifest.from_bytes(bytes(raw[_HEADER.size : end]))
    data = memoryview(raw)[end:]
    if len(data) != manifest.data_nbytes:
        raise CorruptCopyError(f"{uri} truncated: {len(data)} of {manifest.data_nbytes} data bytes")
    if verify:
        if checksum(data) != manifest.checksum:
            raise CorruptCopyError(f"{uri} checksum mismatch (bit flip or partial write)")
    return manifest, data


def list_persisted(url: str) -> dict[int, dict[int, str]]:
    """step -> rank -> uri of every complete (renamed) shard file under `url`."""
    fs, root = _fs(url)
    if not fs.exists(root):
        return {}
    out: dict[int, dict[int, str]] = {}
    proto = url.split("://")[0] + "://" if "://" in url else ""
    for d in fs.ls(root, detail=False):
        name = os.path.basename(str(d).rstrip("/"))
        if not name.startswith("step-"):
            continue
        try:
            step = int(name.removeprefix("step-"))
            files = fs.ls(d, detail=False)
        except ValueError:
            continue  # not one of ours: step-<digits> only
        except FileNotFoundError:
            continue  # deleted by retention while listed
        for f in files:
            fname = os.path.basename(str(f))
            if fname.startswith("rank-") and fname.endswith(".ubf"):
                rank = int(fname.removeprefix("rank-").removesuffix(".ubf"))
                out.setdefault(step, {})[rank] = proto + str(f) if proto else str(f)
    return out


def apply_retention(url: str, committed: Iterable[int], keep: int) -> list[int]:
    """Delete step directories older than the newest `keep` committed steps.

    Uncommitted steps newer than the newest kept commit are in flight and stay.

    Returns:
        The steps deleted.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    kept = sorted(set(committed))[-keep:]
    if not kept:
        return []
    fs, _ = _fs(url)
    deleted = []
    for step in sorted(list_persisted(url)):
        if step not in kept and step < kept[-1]:
            _, path = _fs(step_dir(url, step))
            try:
                fs.rm(path, recursive=True)
            except FileNotFoundError:
                continue  # another retention pass got there first
            deleted.append(step)
    return deleted


def delete_steps(url: str, steps: Iterable[int]) -> list[int]:
    """Delete the persisted step directories `steps` (those that exist)."""
    fs, _ = _fs(url)
    have = list_persisted(url)
    gone = []
    for step in sorted(set(steps)):
        if step in have:
            try:
                fs.rm(_fs(step_dir(url, step))[1], recursive=True)
            except FileNotFoundError:  # another agent of a shared storage deleted it first
                pass
            gone.append(step)
    return gone


def discard_after(url: str, step: int) -> list[int]:
    """Delete persisted steps after `step` (after a rollback: a dead timeline).

    Must run before the new timeline persists those step numbers again, so one step's
    directory never mixes ranks from two timelines.
    """
    fs, _ = _fs(url)
    gone = []
    for s in sorted(list_persisted(url)):
        if s > step:
            fs.rm(_fs(step_dir(url, s))[1], recursive=True)
            gone.append(s)
    return gone


@dataclass(slots=True)
class CommitTracker:
    """Pure bookkeeping: commit a step once every rank's shard is persisted and verified."""

    world_size: int
    url: str
    max_pending: int = 16  # incomplete steps remembered; the oldest is forgotten first
    _reports: dict[int, dict[int, Persisted]] = field(default_factory=dict)
    committed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"CommitTracker.world_size must be >= 1, got {self.world_size}")
        if self.max_pending < 1:
            raise ValueError(f"CommitTracker.max_pending must be >= 1, got {self.max_pending}")

    def rollback(self, to_step: int) -> None:
        """Forget commits and reports after `to_step`: those step numbers will recur."""
        self.committed = [s for s in self.committed if s <= to_step]
        for s in [s for s in self._reports if s > to_step]:
            del self._reports[s]

    def record(self, p: Persisted) -> Commit | None:
        """Record one report; returns the commit when it completes its step."""
        if not 0 <= p.rank < self.world_size:
            raise ValueError(f"rank {p.rank} outside world of {self.world_size}")
        if self.committed and p.step <= self.committed[-1]:
            return None  # already committed, or older than the newest commit
        by_rank = self._reports.setdefault(p.step, {})
        by_rank[p.rank] = p
        if len(by_rank) < self.world_size:
            while len(self._reports) > self.max_pending:
                del self._reports[min(self._reports)]
            return None
        del self._reports[p.step]
        self.committed.append(p.step)
        del self.committed[: -self.max_pending]
        # Older incomplete steps can no longer become the newest commit: forget them.
        for s in [s for s in self._reports if s < p.step]:
            del self._reports[s]
        crc = 0
        for r in range(self.world_size):
            crc = zlib.crc32(by_rank[r].checksum.to_bytes(8, "little"), crc)
        # Shared storage: the one directory every shard is in; node-local storage: ours.
        dirs = {x.uri.rsplit("/", 1)[0] for x in by_rank.values()}
        per_node: dict[str, float] = {}
        for x in by_rank.values():
            per_node[x.node] = per_node.get(x.node, 0.0) + x.seconds
        return Commit(
            step=p.step,
            uri=dirs.pop() if len(dirs) == 1 else step_dir(self.url, p.step),
            nbytes=sum(x.nbytes for x in by_rank.values()),
            ranks=self.world_size,
            checksum=f"{crc:08x}",
            # The lower median over nodes, not the slowest: each node's write time is its
            # own word, and one node must not set the job's persistence interval.
            seconds=sorted(per_node.values())[(len(per_node) - 1) // 2],
        )


RETRY_PERSIST_S = 1.0  # a copy handed to the persister but not persisted is retried after this
PERSIST_TRIES = 5  # ...at most this often (a corrupt copy never persists)


class Persister:
    """The agent's background persister: a bounded queue and one thread.

    `offer(rank_dir, generation)` at each scan of a rank's ring: the newest copy of that
    rank is queued when it is new, due for a retry, or a skipped copy awaits its backfill
    (`submit` queues unconditionally). `on_persisted` is called from the thread.

    A persist can fail (the worker overwrote the slot while it was read, or storage was
    briefly unavailable); once the worker stops writing, the newest copy is stable and a
    retry succeeds (at most `PERSIST_TRIES`, `RETRY_PERSIST_S` apart), so the last copy
    before a crash is never left unpersisted.

    A persister that falls behind skips to the newest copy. Once that newest copy is
    persisted and still the newest at a later `submit` (the worker stopped, or saves
    slowed), the newest copy it skipped is persisted too, once (`backfill_due`): after a
    crash the ranks' newest copies can differ by one step (the dead rank's last copy was
    never completed), and the step every rank holds then needs every rank's shard to
    commit.
    """

    def __init__(
        self,
        config: PersistConfig,
        on_persisted: Callable[[Persisted], None],
        on_error: Callable[[Path, Exception], None] | None = None,
    ) -> None:
        self.config = config
        self._on_persisted = on_persisted
        self._on_error = on_error
        self._queue: queue.Queue[Path | None] = queue.Queue(maxsize=config.queue_size)
        self._done: dict[str, int] = {}  # rank_dir -> generation persisted last
        # rank_dir -> the newest generation skipped before the one persisted last
        self._skipped: dict[str, int] = {}
        # what `offer` decides from (the agent's loop only): rank_dir -> the generation
        # offered last, when it was last queued, and retries of that generation so far
        self._offered: dict[str, int] = {}
        self._submitted_at: dict[str, float] = {}
        self._tries: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="flash-persist", daemon=True)
        self._thread.start()

    def offer(self, rank_dir: Path, generation: int) -> bool:
        """Queue `rank_dir` when its newest persistable copy, of `generation`, needs it:
        the generation is new here, or it was queued and not persisted and is due for a
        retry, or it is persisted and the copy skipped before it awaits its backfill.

        Returns:
            Whether it was queued.
        """
        key = str(Path(rank_dir))
        if self._offered.get(key) != generation:
            self._offered[key] = generation
            self._tries[key] = 0
        elif not self._retry_due(key, generation) and not self._backfill_due(key, generation):
            return False
        self._submitted_at[key] = time.monotonic()
        return self.submit(rank_dir)

    def _retry_due(self, key: str, generation: int) -> bool:
        if self._done.get(key) == generation:
            return False
        tries = self._tries.get(key, 0)
        if tries >= PERSIST_TRIES:
            return False
        if time.monotonic() - self._submitted_at.get(key, 0.0) < RETRY_PERSIST_S:
            return False
        self._tries[key] = tries + 1
        return True

    def _backfill_due(self, key: str, generation: int) -> bool:
        return self._done.get(key) == generation and key in self._skipped

    def submit(self, rank_dir: Path) -> bool:
        """Queue `rank_dir`'s newest copy; False (and dropped) when the queue is full."""
        try:
            self._queue.put_nowait(Path(rank_dir))
            return True
        except queue.Full:
            log.warning("persist.queue_full", rank_dir=str(rank_dir))
            return False

    def done_generation(self, rank_dir: Path) -> int | None:
        """The manifest generation of `rank_dir` last persisted successfully, if any."""
        return self._done.get(str(Path(rank_dir)))

    def backfill_due(self, rank_dir: Path) -> bool:
        """Whether a copy skipped before the newest persisted one awaits its `submit`."""
        return str(Path(rank_dir)) in self._skipped

    def _write(self, ref: CopyRef) -> Persisted:
        return write_shard(ref, self.config.url, verify_readback=self.config.verify_readback)

    def persist_now(self, rank_dir: Path) -> Persisted | None:
        """Persist the newest persistable copy of `rank_dir` in the caller's thread (or,
        when it is persisted already, the newest one skipped before it)."""
        refs = persistable(list_copies(Path(rank_dir)))
        if not refs:
            return None
        ref, key = refs[0], str(Path(rank_dir))
        last = self._done.get(key)
        if last == ref.manifest.generation:
            want = self._skipped.pop(key, None)
            old = [r for r in refs[1:] if r.manifest.generation == want]
            if not old:
                return None  # nothing skipped, or its slot is reused by now
            try:
                p = self._write(old[0])
            except CorruptCopyError as e:  # the worker reused its slot meanwhile: no loss
                log.info("persist.backfill_skipped", rank_dir=key, error=str(e))
                return None
            log.info("persist.backfilled", rank=p.rank, step=p.step, bytes=p.nbytes, uri=p.uri)
            return p
        p = self._write(ref)
        self._done[key] = ref.manifest.generation
        skipped = [r.manifest.generation for r in refs[1:] if r.manifest.generation > (last or 0)]
        if last is not None and skipped:
            self._skipped[key] = skipped[0]
        else:
            self._skipped.pop(key, None)
        try:  # releases the writer's pin on the slot
            write_persisted_mark(ref.rank_dir, ref.manifest.generation)
        except OSError as e:
            log.warning("persist.mark_failed", rank_dir=str(ref.rank_dir), error=str(e))
        log.info("persist.done", rank=p.rank, step=p.step, bytes=p.nbytes, uri=p.uri)
        return p

    def _run(self) -> None:
        if self.config.nice:
            lower_this_thread(self.config.nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                p = self.persist_now(item)
                if p is not None:
                    self._on_persisted(p)
            except Exception as e:  # background loop: log, report, continue
                log.warning("persist.failed", rank_dir=str(item), error=str(e))
                if self._on_error is not None:
                    self._on_error(item, e)

    def close(self, timeout_s: float = 600.0) -> None:
        """Finish queued work and stop the thread."""
        self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"persister did not finish within {timeout_s} s")
