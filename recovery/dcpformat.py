"""Persisted steps as torch.distributed.checkpoint (DCP) checkpoints, written without torch.

Beside each rank's own-format file (`rank-{r}.ubf`, which unbroken's restore reads) the
persister writes the same state in DCP's file-system layout, so `dcp.load(state_dict,
checkpoint_id=step_dir)` reads a persisted step with nothing but torch installed:

- `__{rank}_0.distcp`: one torch.save archive per tensor (or tensor shard) and the small
  values' torch.save bytes, back to back (what `FileSystemWriter` writes);
- `__{rank}_0.distcp.json`: this rank's part of the metadata (keys, dtypes, global shapes,
  chunk offsets, byte ranges), written after its data file;
- `.metadata`: DCP's pickled `Metadata` over every rank's part, written (atomically, by
  whichever agent completes the set) once all ranks of the saved world have theirs;
- `unbroken.json`: what unbroken needs beside it (step, world, timeline, rank files).

Keys are the user's: the flash copy's top-level `trainer.` prefix is dropped, so a step
saved from `{"model": ..., "optim": ...}` loads with `dcp.load({"model": ...})` exactly as
a checkpoint written by `dcp.save` of that dict. Replicated tensors (data-parallel ranks
holding the same chunk) are stored once in the metadata (the lowest rank's). The agent
imports no torch, so both the archives and the metadata are pickled here opcode by opcode
(protocol 2, the globals torch's own writer names); the tests load them with torch.
"""

from __future__ import annotations

import io
import json
import pickle
import time
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import structlog

from unbroken.recovery.flashcopy import CorruptCopyError, Manifest

log = structlog.get_logger(__name__)

PREFIX = "trainer."  # the flash copy's top-level key (trainer.flashckpt.KEY) and its dot
METADATA = ".metadata"
SIDECAR = "unbroken.json"
PART_SUFFIX = ".distcp.json"
FORMAT = "unbroken-dcp/1"
DCP_VERSION = "1.0.0"

# dtype name -> the legacy storage class torch.save names for it
_STORAGES = {
    "float32": "FloatStorage",
    "float64": "DoubleStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


# -- a minimal pickler for the few torch objects DCP files hold -------------------------


@dataclass(frozen=True, slots=True, eq=False)
class _Global:
    module: str
    name: str


@dataclass(frozen=True, slots=True, eq=False)
class _Call:
    """`func(*args)` when unpickled (REDUCE)."""

    func: _Global
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True, eq=False)
class _New:
    """`cls.__new__(cls)` then `__setstate__(state)` or `__dict__.update(state)` (BUILD)."""

    cls: _Global
    state: Any


@dataclass(frozen=True, slots=True, eq=False)
class _PersId:
    pid: tuple[Any, ...]


# the pure-Python pickler: its `save` is what nested values go through (the C one's is not)
_PurePickler: Any = pickle._Pickler  # type: ignore[attr-defined]


class _Pickler(_PurePickler):
    """Protocol 2 with the stand-ins above written as torch's own pickles name them."""

    def __init__(self, out: io.BytesIO) -> None:
        super().__init__(out, protocol=2)

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _PersId) else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif isinstance(obj, _Call):
            self.save(obj.func)
            self.save(obj.args)
            self.write(pickle.REDUCE)
        elif isinstance(obj, _New):
            self.save(obj.cls)
            self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.save(obj.state)
            self.write(pickle.BUILD)
        else:
            super().save(obj, save_persistent_id)


def _dumps(obj: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out).dump(obj)
    return out.getvalue()


def _size(shape: Iterable[int]) -> _Call:
    return _Call(_Global("torch", "Size"), (tuple(int(x) for x in shape),))


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(1, n)
    return tuple(reversed(out))


def tensor_archive(dtype: str, shape: tuple[int, ...], raw: bytes | memoryview) -> bytes:
    """The bytes `torch.save` writes for a contiguous CPU tensor of `dtype` and `shape`
    holding `raw` (what `torch.load(..., weights_only=True)` reads back)."""
    storage = _STORAGES.get(dtype)
    if storage is None:
        raise ValueError(f"no DCP export for dtype {dtype!r} (supported: {sorted(_STORAGES)})")
    numel = 1
    for n in shape:
        numel *= n
    pid = _PersId(("storage", _Global("torch", storage), "0", "cpu", numel))
    rebuild = _Call(
        _Global("torch._utils", "_rebuild_tensor_v2"),
        (
            pid,
            0,
            tuple(shape),
            _strides(shape),
            False,
            _Call(_Global("collections", "OrderedDict"), ()),
        ),
    )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", _dumps(rebuild))
        z.writestr("archive/.format_version", b"1")
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/data/0", bytes(raw))
        z.writestr("archive/version", b"3\n")
    return buf.getvalue()


# -- one rank's part ---------------------------------------------------------------------


def _user_key(fqn: str) -> str:
    return fqn[len(PREFIX) :] if fqn.startswith(PREFIX) else fqn


def write_rank(step_url: str, manifest: Manifest, data: memoryview | bytes) -> str:
    """Write `manifest`'s rank as DCP data plus its metadata part into `step_url`; then,
    when every rank of the saved world has its part there, the global `.metadata`.

    Returns the data file's URL."""
    fs, root = fsspec.core.url_to_fs(step_url)
    fs.makedirs(root, exist_ok=True)
    name = data_file(manifest.rank)
    tensors: list[dict[str, Any]] = []
    objects: list[dict[str, Any]] = []
    mv = memoryview(data).cast("B")
    offset = 0
    tmp = f"{root}/{name}.partial"
    with fs.open(tmp, "wb") as f:
        for e in manifest.entries:
            if e.nbytes and e.offset + e.nbytes > len(mv):
                raise CorruptCopyError(f"rank {manifest.rank}: {e.fqn} lies past the data")
            blob = tensor_archive(e.dtype, tuple(e.shape), mv[e.offset : e.offset + e.nbytes])
            f.write(blob)
            tensors.append(
                {
                    "fqn": _user_key(e.fqn),
                    "dtype": e.dtype,
                    "size": list(e.global_shape),
                    "offsets": list(e.global_offset),
                    "sizes": list(e.shape),
                    "offset": offset,
                    "length": len(blob),
                }
            )
            offset += len(blob)
        for key, raw in manifest.objects.items():
            f.write(raw)
            objects.append({"fqn": _user_key(key), "offset": offset, "length": len(raw)})
            offset += len(raw)
    fs.mv(tmp, f"{root}/{name}")
    layout = manifest.meta.get("layout") or {}
    part = {
        "format": FORMAT,
        "rank": manifest.rank,
        "step": manifest.step,
        "world": int(layout.get("world", 1)) if isinstance(layout, Mapping) else 1,
        "timeline": manifest.meta.get("timeline"),
        "file": name,
        "tensors": tensors,
        "objects": objects,
    }
    _put(fs, f"{root}/{name}{PART_SUFFIX}", json.dumps(part).encode())
    finish(step_url)
    return f"{step_url.rstrip('/')}/{name}"


def _put(fs: Any, path: str, raw: bytes) -> None:
    tmp = path + ".partial"
    with fs.open(tmp, "wb") as f:
        f.write(raw)
    fs.mv(tmp, path)


def _parts(fs: Any, root: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for p in fs.ls(root, detail=False):
        if str(p).endswith(PART_SUFFIX):
            with fs.open(p, "rb") as f:
                part = json.loads(f.read())
            out[int(part["rank"])] = part
    return out


def finish(step_url: str) -> bool:
    """Write `.metadata` and `unbroken.json` once every rank's part is in `step_url`
    (idempotent: parts from two agents give the same bytes). Returns whether it is whole."""
    fs, root = fsspec.core.url_to_fs(step_url)
    parts = _parts(fs, root)
    if not parts:
        return False
    world = max(int(p["world"]) for p in parts.values())
    if sorted(parts) != list(range(world)):
        return False
    steps = {int(p["step"]) for p in parts.values()}
    if len(steps) != 1:
        log.warning("dcp.mixed_steps", dir=step_url, steps=sorted(steps))
        return False
    _put(fs, f"{root}/{METADATA}", metadata_bytes(parts))
    sidecar = {
        "format": FORMAT,
        "step": steps.pop(),
        "world": world,
        "timeline": parts[0].get("timeline"),
        "files": [parts[r]["file"] for r in range(world)],
        "written_unix": time.time(),
    }
    _put(fs, f"{root}/{SIDECAR}", json.dumps(sidecar, indent=1).encode())
    log.info("dcp.written", dir=step_url, step=sidecar["step"], world=world)
    return True


def metadata_bytes(parts: Mapping[int, Mapping[str, Any]]) -> bytes:
    """DCP's pickled `Metadata` over the ranks' parts (rank order; a chunk that several
    ranks hold is read from the lowest)."""
    md = "torch.distributed.checkpoint.metadata"
    state_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    chunks: dict[str, dict[tuple[int, ...], _New]] = {}
    props: dict[str, tuple[str, tuple[int, ...]]] = {}
    for rank in sorted(parts):
        part = parts[rank]
        for t in part["tensors"]:
            fqn, offs = t["fqn"], tuple(t["offsets"])
            have = props.setdefault(fqn, (t["dtype"], tuple(t["size"])))
            if have != (t["dtype"], tuple(t["size"])):
                raise ValueError(f"{fqn}: ranks disagree on dtype/shape {have} vs {t}")
            if offs in chunks.setdefault(fqn, {}):
                continue
            chunks[fqn][offs] = _New(
                _Global(md, "ChunkStorageMetadata"),
                {"offsets": _size(offs), "sizes": _size(t["sizes"])},
            )
            index = _New(
                _Global(md, "MetadataIndex"), {"fqn": fqn, "offset": _size(offs), "index": None}
            )
            storage[index] = _storage_info(part["file"], t)
        for o in part["objects"]:
            fqn = o["fqn"]
            if fqn in state_md:
                continue
            state_md[fqn] = _New(_Global(md, "BytesStorageMetadata"), {})
            index = _New(_Global(md, "MetadataIndex"), {"fqn": fqn, "offset": None, "index": None})
            storage[index] = _storage_info(part["file"], o)
    for fqn, (dtype, size) in props.items():
        tp = _New(
            _Global(md, "TensorProperties"),
            (
                _Global("torch", dtype),
                _Call(_Global("torch.serialization", "_get_layout"), ("torch.strided",)),
                False,
                _Call(_Global(md, "_MEM_FORMAT_ENCODING"), (0,)),
                False,
            ),
        )
        state_md[fqn] = _New(
            _Global(md, "TensorStorageMetadata"),
            {"properties": tp, "size": _size(size), "chunks": list(chunks[fqn].values())},
        )
    meta = _New(
        _Global(md, "Metadata"),
        {
            "state_dict_metadata": state_md,
            "planner_data": {fqn: (fqn,) for fqn in state_md},
            "storage_data": storage,
            "storage_meta": None,
            "version": DCP_VERSION,
        },
    )
    return _dumps(meta)


def _storage_info(file: str, item: Mapping[str, Any]) -> _New:
    return _New(
        _Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        {"relative_path": file, "offset": int(item["offset"]), "length": int(item["length"])},
    )
