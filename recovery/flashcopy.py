"""The format of one flash copy in shared memory: slots, manifests, checksums.

A rank's directory holds a ring of k >= 2 slots (the owner decides k from the tmpfs and the
state's size), `slot-{i}.data` (the tensors' bytes, each at a 64-byte aligned offset) and
`slot-{i}.manifest` (step, generation, small values, checksum of the data; JSON with a CRC
of its own; its tensor entries and small values' keys, the same every save of a plan, in
`plan-{id}.lines`, named by their hash and written once). A slot is a valid copy exactly
when its manifest exists and parses (the writer renames it into place only after the last
byte is copied, and unlinks it before it reuses the slot) and its data is as long as the
manifest says. A copy's checksum is taken when its bytes leave the process's memory, not
at every save (`seal`): a writer's copy is *unsealed* (`UNSEALED`), and the agent hashes
it when it sends it to a buddy or persists it, proving with a second look at the manifest
that the slot was not reused meanwhile; replicas and copies restored from storage carry
their checksum and `read_copy` verifies it. The agent's persister writes the
generation it last persisted into `persisted` (`PERSISTED_MARK`), which releases the
writer's pin on that slot. Everything
here is shared by the writer (`unbroken.recovery.flash`), the agent's owner side,
persistence, buddy replicas and resharding; `unbroken.recovery.flash` re-exports it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import mmap
import os
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import xxhash

from unbroken.common.sdckeys import SDC_META

if TYPE_CHECKING:
    import torch

log = structlog.get_logger(__name__)

# 2: each distinct small value's bytes stored once ("blobs"), keys name their blob (a
# trainer's hundreds of per-parameter optimizer values share a handful of values: the
# manifest shrank from 135 KB to 50 KB); the tensor entries, the same every save of a
# plan, on a line of their own, so writer and readers serialise and parse them once per
# plan, not once per save. Version 1 manifests are still read.
MANIFEST_VERSION = 3
# 4: a slot's manifest *file* in shared memory (`write_manifest`): the head line alone,
# naming its plan (the entries and keys lines, ~46 KB for the tiny model's 157 tensors and
# 433 small values) by content hash, stored once per plan in `plan-{id}.lines` beside it.
# Serialising and writing the whole 50 KB on the training thread took 0.6 ms a save (of a
# 52 ms step) on this VM; the head is 4 KB. The wire and storage form (`to_bytes`, read by
# `from_bytes` without a directory) stays self-contained version 3.
SLOT_VERSION = 4
_READ_VERSIONS = (1, 2, 3, SLOT_VERSION)
PLAN_PREFIX = "plan-"
PLAN_SUFFIX = ".lines"
_PLAN_ID_LEN = 16  # hex digits of the plan lines' xxh3-64
LOCAL_STORE = "local"
ALIGN = 64  # byte alignment of every tensor in a slot
MIN_SLOTS = 2  # a ring never has fewer: one copy being written, one complete
PERSIST_META = "persist"  # manifest meta key; False: a copy for memory only, not persisted
PERSISTED_MARK = "persisted"  # file in a rank's directory: the generation last persisted
KEEP_MARK = "keep"  # file in a rank's directory: generations its ring keeps (verified steps)
KEEP_MIN_SLOTS = 4  # a smaller ring spares nothing: its slots are the newest copies' own
CHECKSUM_CHUNK = 64 << 20  # hash in pieces so a background thread yields the GIL often
CHECKSUM_ALGO = "xxh3_64"
# The checksum of a writer's copy nobody has hashed yet (xxh3-64 is unsigned: never -1).
# Hashing every save's bytes on the writer thread cost the fault-free run ~2-3 % of its
# steps on this VM (1.5 MB a rank a step; bench/results/recovery-ab-variants-4.json), and
# on a GPU node it is ~1.5 s of a core per 10 GB shard per save; the bytes need a checksum
# only when they leave this memory (a buddy, storage, a broadcast), about once a second.
UNSEALED = -1


class FlashError(Exception):
    """Base class for flash-store errors."""


class ShmTooSmallError(FlashError):
    """The shared-memory file system cannot hold the requested slots."""


class CorruptCopyError(FlashError):
    """A copy's bytes do not match its manifest (truncated, bit-flipped or overwritten)."""


class NoCopyError(FlashError):
    """No valid copy exists for the requested rank (and step)."""


def replica_store(node: str) -> str:
    """The store name under which a buddy keeps `node`'s replicated copies."""
    if not node or "/" in node or node.startswith("."):
        raise ValueError(f"node name {node!r} cannot name a replica store (no '/', not empty)")
    return f"replica-{node}"


def new_hasher() -> xxhash.xxh3_64:
    """An incremental hasher of copy data (`update(bytes)`, `intdigest()`)."""
    return xxhash.xxh3_64()


def checksum(buf: memoryview | bytes | bytearray | mmap.mmap) -> int:
    """The checksum of a copy's data: xxh3-64, fed in chunks."""
    mv = memoryview(buf).cast("B")
    h = new_hasher()
    for start in range(0, len(mv), CHECKSUM_CHUNK):
        h.update(mv[start : start + CHECKSUM_CHUNK])
    return h.intdigest()


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor (or one DTensor's local shard) lives inside a slot."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Manifest:
    """What makes a slot a valid copy: written only after every byte is in place."""

    rank: int
    step: int
    generation: int
    data_nbytes: int
    checksum: int
    entries: tuple[TensorEntry, ...]
    objects: Mapping[str, bytes]  # flattened key -> torch.save bytes of a non-tensor value
    meta: Mapping[str, Any] = field(default_factory=dict)  # e.g. the mesh layout
    created_unix: float = 0.0

    @property
    def sealed(self) -> bool:
        """Whether the checksum of the data is known (see `UNSEALED`)."""
        return self.checksum != UNSEALED

    def to_bytes(self) -> bytes:
        """Serialise as JSON (objects base64) so any process can read it without pickle.

        Four lines (compact JSON has no raw newline): the head, with each small value's
        blob index in key order; the tensor entries; the small values' keys; the CRC. A
        writer saves one plan over and over: the entries and keys lines are the same each
        save and serialised once (a 433-key optimizer state made a 50 KB head per save)."""
        ents, keys = self._plan_lines()
        body = b"\n".join((self._head(MANIFEST_VERSION, None), ents, keys))
        return body + b"\n" + f"{zlib.crc32(body):08x}".encode()

    def slot_bytes(self) -> tuple[bytes, str, bytes]:
        """The slot form (version 4): (the manifest file's bytes, the plan's id, the plan
        lines to store under that id). The head is the same as `to_bytes`' plus the id."""
        ents, keys = self._plan_lines()
        plan_id, lines = _plan_of(ents, keys)
        body = self._head(SLOT_VERSION, plan_id)
        return body + b"\n" + f"{zlib.crc32(body):08x}".encode(), plan_id, lines

    def _plan_lines(self) -> tuple[bytes, bytes]:
        return _ENTRIES.out(self.entries), _KEYS.out(tuple(self.objects))

    def _head(self, version: int, plan_id: str | None) -> bytes:
        index: dict[bytes, int] = {}
        order = [index.setdefault(v, len(index)) for v in self.objects.values()]
        doc = {
            "version": MANIFEST_VERSION,
            "rank": self.rank,
            "step": self.step,
            "generation": self.generation,
            "data_nbytes": self.data_nbytes,
            "checksum": self.checksum,
            "checksum_algo": CHECKSUM_ALGO,
            # two hex digits per key while there are at most 256 distinct values (one C
            # call; a JSON list of 433 ints took a third of a save's manifest time)
            "object_index": bytes(order).hex() if len(index) <= 256 else order,
            "blobs": [base64.b64encode(v).decode() for v in index],
            "meta": dict(self.meta),
            "created_unix": self.created_unix,
        }
        if version != MANIFEST_VERSION:
            doc["version"] = version
        if plan_id is not None:
            doc["plan"] = plan_id
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, plan_lines: Callable[[str], bytes] | None = None) -> Manifest:
        """Parse and verify a manifest; raises CorruptCopyError when it is damaged.

        `plan_lines` resolves a slot manifest's plan id to its lines (`read_manifest`
        passes the slot's directory's); without it (the wire, storage) the slot form is
        refused."""
        body, sep, crc = raw.rpartition(b"\n")
        if not sep or crc != f"{zlib.crc32(body):08x}".encode():
            raise CorruptCopyError("manifest checksum mismatch (truncated or corrupted manifest)")
        head, sep, ents = body.partition(b"\n")
        doc = json.loads(head)
        version = doc.get("version")
        if version not in _READ_VERSIONS:
            raise CorruptCopyError(f"manifest version {version} is not supported")
        if version == SLOT_VERSION:
            plan_id = doc.get("plan")
            if sep or plan_lines is None or not _is_plan_id(plan_id):
                raise CorruptCopyError("a slot manifest is read from its slot (read_manifest)")
            ents, sep = plan_lines(plan_id), b"\n"
        if doc.get("checksum_algo") != CHECKSUM_ALGO:
            raise CorruptCopyError(f"checksum {doc.get('checksum_algo')!r} is not {CHECKSUM_ALGO}")
        keys: tuple[str, ...] = ()
        if version >= 3:  # the slot form's plan lines are version 3's
            ents, sep3, raw_keys = ents.partition(b"\n")
            if not sep3:
                raise CorruptCopyError("manifest has no line of small-value keys")
            keys = _KEYS.parse(raw_keys)
        return cls(
            rank=doc["rank"],
            step=doc["step"],
            generation=doc["generation"],
            data_nbytes=doc["data_nbytes"],
            checksum=doc["checksum"],
            entries=_ENTRIES.parse(ents) if sep else _entries(doc["entries"]),
            objects=_objects(doc, version, keys),
            meta=doc["meta"],
            created_unix=doc["created_unix"],
        )


# What the parsed lines may hold, in bytes: a buddy's manifest may be up to 16 MB, and
# distinct lines from a hostile one must not pile up (a real plan's are KBs).
ENTRIES_CACHE_BYTES = 8 << 20


class _Lines:
    """One manifest line kind (the tensor entries, the small values' keys): the last value
    serialised, and the values parsed per distinct line. A writer saves one plan over and
    over, a reader (the agent, every new copy) reads the same few plans."""

    def __init__(self, dump: Callable[[Any], Any], load: Callable[[Any], Any]) -> None:
        self._dump, self._load = dump, load
        self.last: tuple[Any, bytes] = ((), b"[]")
        self.parsed: dict[bytes, Any] = {}

    def out(self, value: Any) -> bytes:
        last = self.last  # one read: another thread may replace it meanwhile
        if last[0] is value or last[0] == value:
            return last[1]
        raw = json.dumps(self._dump(value), separators=(",", ":")).encode()
        self.last = (value, raw)
        return raw

    def parse(self, raw: bytes) -> Any:
        hit = self.parsed.get(raw)
        if hit is None:
            try:
                hit = self._load(json.loads(raw))
            except (ValueError, TypeError) as e:
                raise CorruptCopyError(f"manifest line does not parse: {e}") from e
            if len(raw) > ENTRIES_CACHE_BYTES // 4:
                return hit  # too large to keep
            held = sum(map(len, self.parsed))
            if len(self.parsed) >= 64 or held + len(raw) > ENTRIES_CACHE_BYTES:
                self.parsed.clear()  # plans of long-gone jobs, or a flood of made-up ones
            self.parsed[raw] = hit
        return hit


# (entries line, keys line, plan id, plan lines) of the last plan written: the lines are
# the same objects every save of a plan (`_Lines.out`), so the id is hashed once
_PLAN_LAST: tuple[bytes, bytes, str, bytes] = (b"", b"", "", b"")


def _plan_of(ents: bytes, keys: bytes) -> tuple[str, bytes]:
    """A plan's id (xxh3-64 of its lines, hex) and its lines."""
    global _PLAN_LAST
    last = _PLAN_LAST
    if last[0] is ents and last[1] is keys:
        return last[2], last[3]
    lines = ents + b"\n" + keys
    plan_id = xxhash.xxh3_64_hexdigest(lines)
    _PLAN_LAST = (ents, keys, plan_id, lines)
    return plan_id, lines


def _is_plan_id(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == _PLAN_ID_LEN
        and all(c in "0123456789abcdef" for c in value)
    )


def plan_path(rank_dir: Path, plan_id: str) -> Path:
    return rank_dir / f"{PLAN_PREFIX}{plan_id}{PLAN_SUFFIX}"


# plan id -> its verified lines (content-addressed: never stale), under ENTRIES_CACHE_BYTES
_plans: dict[str, bytes] = {}


def read_plan(rank_dir: Path, plan_id: str) -> bytes:
    """The plan lines `plan_id` names, from `rank_dir`, verified against the id."""
    hit = _plans.get(plan_id)
    if hit is not None:
        return hit
    try:
        lines = plan_path(rank_dir, plan_id).read_bytes()
    except OSError as e:
        raise CorruptCopyError(f"the manifest's plan {plan_id} is missing: {e}") from e
    if xxhash.xxh3_64_hexdigest(lines) != plan_id:
        raise CorruptCopyError(f"the plan file {plan_id} does not match its name")
    if len(lines) > ENTRIES_CACHE_BYTES // 4:
        return lines  # too large to keep (a buddy's plan may be up to 16 MB)
    if len(_plans) >= 64 or sum(map(len, _plans.values())) + len(lines) > ENTRIES_CACHE_BYTES:
        _plans.clear()  # plans of long-gone jobs, or a flood of made-up ones
    _plans[plan_id] = lines
    return lines


# A plan file no manifest names is deleted once it is this old (`prune_plans`): one
# just written may not be named yet by the manifest about to follow it.
PLAN_KEEP_S = 60.0


def _write_plan(rank_dir: Path, plan_id: str, lines: bytes) -> None:
    """Store the plan lines once per directory (atomically; a stat when already there).

    A new plan (the first save after a reshard, a restart with other state) is when older
    ones may have stopped being named: `prune_plans` runs then, not at every save."""
    path = plan_path(rank_dir, plan_id)
    if not os.path.exists(path):
        # a temporary name of this thread's own: two saves' manifests can be written at once
        # in one process (the writer's thread, and the training thread finishing the one
        # the writer had not started), and with one name the second rename found nothing
        who = f"{os.getpid()}-{threading.get_ident()}"
        _replace_with(path, rank_dir / f".{PLAN_PREFIX}{plan_id}.{who}.tmp", lines)
        prune_plans(rank_dir, keep=plan_id)


def _named_plan(raw: bytes) -> str | None:
    """The plan id a slot manifest's head names (None: another form, or unreadable)."""
    head = raw.partition(b"\n")[0]
    try:
        plan_id = json.loads(head).get("plan")
    except (ValueError, AttributeError):
        return None
    return plan_id if _is_plan_id(plan_id) else None


def prune_plans(rank_dir: Path, keep: str = "", min_age_s: float | None = None) -> list[str]:
    """Delete the plan files (and a crashed writer's temporary ones) of `rank_dir` that no
    slot manifest there names, older than `min_age_s`; returns the deleted names.

    Without this each reshard or restart with other state left its plan files behind in
    shared memory for the job's whole life. A manifest that cannot be read keeps every
    plan (it might name any).
    """
    min_age_s = PLAN_KEEP_S if min_age_s is None else min_age_s
    now = time.time()
    named = {keep}
    candidates: list[tuple[str, float]] = []
    try:
        with os.scandir(rank_dir) as it:
            for entry in it:
                name = entry.name
                if name.startswith("slot-") and name.endswith(".manifest"):
                    try:
                        with open(entry.path, "rb") as f:
                            plan_id = _named_plan(f.read(1 << 16))
                    except OSError:
                        continue  # replaced or removed meanwhile: its successor is newer
                    if plan_id is None:
                        return []
                    named.add(plan_id)
                elif (name.startswith(PLAN_PREFIX) and name.endswith(PLAN_SUFFIX)) or (
                    name.startswith(f".{PLAN_PREFIX}") and name.endswith(".tmp")
                ):
                    try:
                        candidates.append((name, entry.stat(follow_symlinks=False).st_mtime))
                    except OSError:
                        continue
    except OSError:
        return []
    deleted = []
    for name, mtime in candidates:
        plan_id = name[len(PLAN_PREFIX) : -len(PLAN_SUFFIX)] if name.endswith(PLAN_SUFFIX) else ""
        if plan_id in named or now - mtime < min_age_s:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rank_dir / name)
            deleted.append(name)
    return deleted


def _replace_with(path: Path, tmp: Path, data: bytes) -> os.stat_result:
    """Replace `path` with `data` atomically (written to `tmp`, renamed; never through a
    symlink); returns the new file's stat, taken before the rename."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        st = os.fstat(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return st


def _entries(rows: Any) -> tuple[TensorEntry, ...]:
    return tuple(
        TensorEntry(f, d, tuple(s), o, n, tuple(gs), tuple(go)) for f, d, s, o, n, gs, go in rows
    )


def _keys(rows: Any) -> tuple[str, ...]:
    if not isinstance(rows, list) or not all(isinstance(k, str) for k in rows):
        raise ValueError("small-value keys are not a list of strings")
    return tuple(rows)


_ENTRIES = _Lines(
    lambda entries: [
        [e.fqn, e.dtype, e.shape, e.offset, e.nbytes, e.global_shape, e.global_offset]
        for e in entries
    ],
    _entries,
)
_KEYS = _Lines(list, _keys)


def _objects(doc: dict[str, Any], version: int, keys: tuple[str, ...]) -> dict[str, bytes]:
    """A manifest's small values: base64 per key (version 1), per distinct blob named by
    key (2), or per distinct blob, indexed in the order of the keys line (3)."""
    if version == 1:
        return {k: base64.b64decode(v) for k, v in doc["objects"].items()}
    blobs = [base64.b64decode(b) for b in doc["blobs"]]
    try:
        if version == 2:
            return {k: blobs[i] for k, i in doc["objects"].items()}
        order = doc["object_index"]
        if isinstance(order, str):
            order = bytes.fromhex(order)
        return {k: blobs[i] for k, i in zip(keys, order, strict=True)}
    except (IndexError, TypeError, ValueError) as e:
        raise CorruptCopyError(f"manifest names a small value it does not hold: {e}") from e


def dtype_from_name(name: str) -> torch.dtype:
    """`"float32"` -> `torch.float32`, rejecting anything that is not a dtype."""
    import torch  # lazily: the agent and the driver read manifests without torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CorruptCopyError(f"unknown dtype {name!r} in manifest")
    return dt


def tensor_view(buf: memoryview | bytearray | mmap.mmap, entry: TensorEntry) -> torch.Tensor:
    """A zero-copy tensor over `entry`'s bytes in `buf` (read-only when `buf` is)."""
    return tensor_views(buf, (entry,))[0]


def tensor_views(
    buf: memoryview | bytearray | mmap.mmap, entries: Iterable[TensorEntry], *, quiet: bool = True
) -> list[torch.Tensor]:
    """`tensor_view` of each entry, under one warnings filter (setting it per tensor cost
    ~10 µs each: 4 ms for a 125M-parameter model's 386 tensors). `quiet=False` sets none
    (the filter is process-wide: a writable `buf` from another thread)."""
    import torch

    out = []
    with warnings.catch_warnings() if quiet else contextlib.nullcontext():
        # Read-only mappings give read-only tensors; callers only copy out of them.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for entry in entries:
            dt = dtype_from_name(entry.dtype)
            if entry.nbytes == 0:
                out.append(torch.empty(entry.shape, dtype=dt))
                continue
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
            out.append(flat.view(dt).view(entry.shape))
    return out


def load_object(raw: bytes) -> Any:
    """Decode a non-tensor value saved in a manifest (weights_only: no arbitrary code)."""
    import torch

    return torch.load(io.BytesIO(raw), weights_only=True)


@dataclass(frozen=True, slots=True)
class CopyRef:
    """One valid-looking copy on disk (its data is verified only by `read_copy`)."""

    rank_dir: Path
    slot: int
    manifest: Manifest

    @property
    def data_path(self) -> Path:
        """The slot's data file."""
        return self.rank_dir / f"slot-{self.slot}.data"


def manifest_path(rank_dir: Path, slot: int) -> Path:
    return rank_dir / f"slot-{slot}.manifest"


def data_path(rank_dir: Path, slot: int) -> Path:
    return rank_dir / f"slot-{slot}.data"


# Parsed manifests by path, with the file identity they were parsed from: the agent polls
# every slot ten times a second, and a manifest is only ever replaced whole (os.replace:
# a new inode), so an unchanged identity means an unchanged manifest.
_parsed: dict[str, tuple[tuple[int, int, int], Manifest]] = {}


def read_manifest(rank_dir: Path, slot: int) -> Manifest | None:
    """The slot's manifest, or None when the slot holds no complete copy."""
    return _read_manifest(rank_dir, _manifest_key(os.fspath(rank_dir), slot), slot)


def _manifest_key(base: str, slot: int) -> str:
    """`manifest_path` as a string, joined without pathlib (the agent looks at every slot
    of every ring ten times a second: pathlib's joins cost more than the stat)."""
    return f"{base}/slot-{slot}.manifest"


def _read_manifest(rank_dir: Path, key: str, slot: int) -> Manifest | None:
    # `key`: `_manifest_key(rank_dir, slot)`, the cache's key
    try:
        hit = _parsed.get(key)
        if hit is not None:  # one stat, not open + fstat + close, while nothing changed
            st = os.stat(key)
            if hit[0] == (st.st_ino, st.st_size, st.st_mtime_ns):
                return hit[1]
        with open(key, "rb") as f:
            st = os.fstat(f.fileno())
            ident = (st.st_ino, st.st_size, st.st_mtime_ns)
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        m = Manifest.from_bytes(raw, functools.partial(read_plan, rank_dir))
    except (CorruptCopyError, ValueError, KeyError) as e:
        log.warning("flash.manifest_unreadable", dir=str(rank_dir), slot=slot, error=str(e))
        return None
    if len(_parsed) > 4096:  # slots of long-gone jobs
        _parsed.clear()
    _parsed[key] = (ident, m)
    return m


def slots(rank_dir: Path) -> list[int]:
    """The ring's slot numbers in `rank_dir` (those with a data file), ascending."""
    try:
        names = os.listdir(rank_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        if name.startswith("slot-") and name.endswith(".data"):
            num = name[5:-5]
            if num.isdigit():
                out.append(int(num))
    return sorted(out)


def read_persisted_mark(rank_dir: Path) -> int | None:
    """The generation the agent last persisted from `rank_dir`, if it says."""
    try:
        raw = (rank_dir / PERSISTED_MARK).read_bytes()
    except OSError:
        return None
    try:
        return int(raw.strip() or b"-1")
    except ValueError:
        return None


def write_persisted_mark(rank_dir: Path, generation: int) -> None:
    """Record (atomically) that `generation` of `rank_dir` is persisted."""
    data = str(int(generation)).encode()
    _replace_with(rank_dir / PERSISTED_MARK, rank_dir / f".{PERSISTED_MARK}.tmp", data)


def read_keep_mark(rank_dir: Path) -> frozenset[int]:
    """The generations the agent asked this ring to keep (`RingKeep`; none if it did not)."""
    try:
        raw = (rank_dir / KEEP_MARK).read_bytes()
    except OSError:
        return frozenset()
    try:
        return frozenset(int(x) for x in raw.split())
    except ValueError:
        return frozenset()


def write_keep_mark(rank_dir: Path, generations: Iterable[int]) -> None:
    """Ask (atomically) the ring's writers to pass over the copies of `generations`."""
    data = " ".join(str(int(g)) for g in generations).encode()
    _replace_with(rank_dir / KEEP_MARK, rank_dir / f".{KEEP_MARK}.tmp", data)


def spared_slots(
    held: Mapping[int, int], kept: frozenset[int], checked: Collection[int], nslots: int
) -> set[int]:
    """The slots of `held` (slot -> generation) a writer passes over besides the newest
    copy, at most half the ring (the rest cycles the newest copies): first the copies the
    agent's keep mark names (the newest verified steps), then the newest fingerprinted
    copies (`checked`: generations) newer than those, whose verdict the driver has not
    given yet. A verified step's copy thus lives until the agent's mark arrives, however
    many steps come in between."""
    if nslots < KEEP_MIN_SLOTS or not (kept or checked):
        return set()  # (the common case, every save: no fingerprints, no marks)
    room = nslots // 2
    newest_first = sorted(held, key=lambda s: -held[s])[1:]  # the newest is kept anyway
    marked = [s for s in newest_first if held[s] in kept][:room]
    floor = max((held[s] for s in marked), default=-1)
    pending = [s for s in newest_first if held[s] in checked and held[s] > floor]
    return set(marked) | set(pending[: room - len(marked)])


def list_copies(rank_dir: Path) -> list[CopyRef]:
    """Copies with a manifest in `rank_dir`, newest generation first."""
    base = os.fspath(rank_dir)
    refs = []
    for slot in slots(rank_dir):
        m = _read_manifest(rank_dir, _manifest_key(base, slot), slot)
        if m is not None:
            refs.append(CopyRef(rank_dir, slot, m))
    return sorted(refs, key=lambda r: r.manifest.generation, reverse=True)


def find_copy(rank_dir: Path, step: int | None = None) -> CopyRef:
    """The newest copy (or the copy of `step`) in `rank_dir`; raises NoCopyError."""
    for ref in list_copies(rank_dir):
        if step is None or ref.manifest.step == step:
            return ref
    want = "any step" if step is None else f"step {step}"
    raise NoCopyError(f"no flash copy of {want} in {rank_dir}")


def read_copy(ref: CopyRef) -> mmap.mmap:
    """The copy's data, mapped read-only and checked (see `open_copy`)."""
    return open_copy(ref)[1]


def open_copy(ref: CopyRef) -> tuple[Manifest, mmap.mmap]:
    """The copy's sealed manifest and its data, mapped read-only (zero-copy).

    A sealed copy (a replica, a copy restored from storage) is verified against its
    checksum. An unsealed one (a writer's) is hashed now and the returned manifest carries
    the checksum, so what is broadcast or sent on can be verified where it arrives. Either
    way the slot's manifest is looked at again afterwards: a reused slot is refused.

    Raises:
        CorruptCopyError: the bytes do not match the checksum, the file is truncated or
            gone, or the slot was overwritten while it was read.
    """
    m = ref.manifest
    try:
        fd = os.open(ref.data_path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise CorruptCopyError(f"{ref.data_path} is gone") from e
    try:
        size = os.fstat(fd).st_size
        if size < m.data_nbytes:
            raise CorruptCopyError(f"{ref.data_path} truncated: {size} of {m.data_nbytes} bytes")
        if m.data_nbytes == 0:
            data = mmap.mmap(-1, 1)
        else:
            # Read-only and shared: a private writable mapping would copy every page on
            # MAP_POPULATE. Tensors over it are only ever copied from.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            data = mmap.mmap(fd, m.data_nbytes, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    crc = checksum(memoryview(data)[: m.data_nbytes])
    if m.sealed and crc != m.checksum:
        data.close()
        raise CorruptCopyError(f"{ref.data_path} checksum mismatch at step {m.step}")
    if read_manifest(ref.rank_dir, ref.slot) != m:
        data.close()
        raise CorruptCopyError(f"{ref.data_path} was overwritten while it was read")
    return (m if m.sealed else replace(m, checksum=crc)), data


def seal(ref: CopyRef) -> Manifest:
    """`ref`'s manifest with its checksum: as it is when sealed, else hashed from the slot
    now (the agent's side, before a copy is sent or persisted).

    Raises:
        CorruptCopyError: as `open_copy`.
    """
    if ref.manifest.sealed:
        return ref.manifest
    manifest, data = open_copy(ref)
    data.close()
    return manifest


def oldest_free_slot(rank_dir: Path, busy: set[int] | frozenset[int] = frozenset()) -> int | None:
    """The slot to overwrite next: empty first, else the oldest copy; never the newest
    copy, a copy the keep mark spares, nor a slot in `busy`. None when every slot is taken."""
    refs = list_copies(rank_dir)
    held = {r.slot: r.manifest.generation for r in refs}
    keep = set(busy) | ({refs[0].slot} if refs else set())
    checked = {r.manifest.generation for r in refs if SDC_META in r.manifest.meta}
    keep |= spared_slots(held, read_keep_mark(rank_dir), checked, len(slots(rank_dir)))
    free = [s for s in slots(rank_dir) if s not in keep]
    if not free:
        return None
    return min(free, key=lambda s: (s in held, held.get(s, -1), s))


def write_raw_copy(rank_dir: Path, manifest: Manifest, data: memoryview | bytes) -> CopyRef:
    """Store an already-serialised copy (a replica or a restored file) in the ring.

    The caller has verified `data` against `manifest`. The oldest slot (never the newest
    copy's) is invalidated, filled, and then its manifest is renamed into place; a fresh
    directory gets a ring of `MIN_SLOTS`.
    """
    rank_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if len(slots(rank_dir)) < MIN_SLOTS:
        for s in range(MIN_SLOTS):
            fd = os.open(data_path(rank_dir, s), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            os.close(fd)
    slot = oldest_free_slot(rank_dir)
    assert slot is not None, "a ring of >= 2 slots always has one not holding the newest"
    manifest_path(rank_dir, slot).unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    with os.fdopen(os.open(data_path(rank_dir, slot), flags, 0o600), "wb") as f:
        f.write(data)
    write_manifest(rank_dir, slot, manifest)
    return CopyRef(rank_dir, slot, manifest)


def file_ident(st: os.stat_result) -> tuple[int, int, int]:
    """A manifest file's identity in `manifest_sig` (a rename keeps it, a rewrite does not)."""
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def manifest_sig(rank_dir: Path, nslots: int | None = None) -> tuple[Any, ...]:
    """Identity of every slot's manifest file (a rename gives a new inode), by slot order.

    A writer compares it before every save (another process may have discarded or restored
    a copy): plain strings and one stat per slot, no pathlib (which cost ~1 ms per save for
    a ring of 16). `nslots`: the ring's slot count when the caller knows it (a ring keeps
    its count once reserved), so the directory is not listed.
    """
    base = os.fspath(rank_dir)
    sig: list[Any] = []
    for slot in slots(rank_dir) if nslots is None else range(nslots):
        try:
            sig.append(file_ident(os.stat(f"{base}/slot-{slot}.manifest")))
        except FileNotFoundError:
            sig.append(None)
    return tuple(sig)


def slot_manifest_ident(rank_dir: Path, slot: int) -> tuple[int, int, int] | None:
    """One slot's entry of `manifest_sig` (None: no manifest)."""
    try:
        return file_ident(os.stat(f"{os.fspath(rank_dir)}/slot-{slot}.manifest"))
    except FileNotFoundError:
        return None


def write_manifest(rank_dir: Path, slot: int, manifest: Manifest) -> tuple[int, int, int]:
    """Write the slot's manifest atomically (the slot form: its plan lines stored once
    beside it); returns its `file_ident` (its entry in `manifest_sig` until something else
    replaces or removes it)."""
    raw, plan_id, lines = manifest.slot_bytes()
    _write_plan(rank_dir, plan_id, lines)
    tmp = rank_dir / f".slot-{slot}.manifest.tmp"
    return file_ident(_replace_with(manifest_path(rank_dir, slot), tmp, raw))
