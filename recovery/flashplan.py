"""What a flash save copies: the plan of a state dict's tensors in a slot, and its small values.

A save flattens the state dict as DCP does (`flatten_state_dict`), lays every tensor (a
DTensor's local shard) out in the slot at an aligned offset (`TensorEntry`), and serialises
the non-tensor values (step, data position, param groups, RNG) for the manifest. Training
updates tensors in place, so a `Snapshot` lets the writer build that plan once and take
only the values that change at each save (`PlanCache`). The slot format itself lives in
`unbroken.recovery.flashcopy`; the ring of slots in `unbroken.recovery.flashring`.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from unbroken.recovery.flashcopy import ALIGN, TensorEntry

log = structlog.get_logger(__name__)

# An optimizer's param groups flatten into hundreds of small values per save (lr, betas,
# eps... per parameter), nearly all repeats; torch.save costs ~40 µs each, which made the
# snapshot of a tiny model's state take longer than its copy. Immutable values are encoded
# once. The key holds the repr, so that -0.0 and 0.0 (equal, same hash) stay apart.
_SCALARS = (bool, int, float, str, type(None))
_DUMPED: dict[tuple[type, str], bytes] = {}
_DUMPED_MAX = 4096


_PLAIN_REPR_MAX = 1 << 16  # longer plain values are encoded each time, not kept
_STR_KEPT = 256  # longer strings too (without taking their repr first)


def immutable(value: Any) -> bool:
    return (
        type(value) in _SCALARS
        or type(value) is bytes
        or (type(value) is tuple and all(type(v) in _SCALARS for v in value))
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


def dump_object(value: Any) -> bytes:
    t = type(value)
    if t is int or t is bytes or (t is str and len(value) > _STR_KEPT):
        # a counter (step, data position), new every save; a blob an adapter pickled (a
        # generator's state: framed here, not zipped, 45 us a save); a long text (a
        # library's state as JSON): not kept, and not looked up by its repr
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


def flatten(state: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP's `flatten_state_dict(state)[0]` gives, without its generic traversal (a
    closure call and an abstract-class check per node: ~2 us each, a third of a save of a
    small model's state): mappings are entered (keys named `str(key)`), a list is entered
    (items named by index) when it holds a tensor, a mapping or such a list, anything else
    is a leaf. Where DCP still flattens the torch-2.3 way, DCP does it."""
    from torch.distributed.checkpoint import _version

    if _version._derived_version == "2_3":
        return dict(flatten_state_dict(dict(state))[0])
    out: dict[str, Any] = {}
    for key, value in state.items():
        _flatten_value(out, str(key), value)
    return out


def _flatten_value(out: dict[str, Any], name: str, value: Any) -> None:
    t = type(value)
    if t is dict or (t not in _LEAF_TYPES and isinstance(value, Mapping)):
        for k, v in value.items():
            _flatten_value(out, name + "." + str(k), v)
    elif (t is list or (t not in _LEAF_TYPES and isinstance(value, list))) and _entered(value):
        for i, v in enumerate(value):
            _flatten_value(out, name + "." + str(i), v)
    elif name in out:
        raise ValueError(f"duplicated flatten key {name}")
    else:
        out[name] = value


# types that are never a mapping or a list (a fast path past the abstract-class checks)
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, *_SCALARS, tuple, bytes})


def _entered(values: list[Any]) -> bool:
    """DCP's "not terminal" for a list: it holds a tensor, a mapping, or an entered list."""
    for v in values:
        t = type(v)
        if t in _SCALARS:
            continue
        if isinstance(v, Mapping) or isinstance(v, torch.Tensor):
            return True
        if isinstance(v, list) and _entered(v):
            return True
    return False


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@functools.lru_cache(maxsize=4096)
def _shard_layout(
    shape: torch.Size, mesh: Any, placements: tuple[Any, ...], coordinate: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Cached: computing it for every DTensor took longer than copying a tiny model's state.
    # Keyed by this rank's `coordinate` in `mesh` too: a DeviceMesh hashes and compares by
    # its shape and names only, so a survivor that rejoined an equal mesh at another place
    # got the old place's offsets, and its copies named the other rank's shard (bench
    # recovery, replica mode: rank 1 of dp2, then 0 of dp1, then 0 of dp2 again saved its
    # shard as the second half; the next dp1 reshard loaded that half twice, loss 6 against 2)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    del coordinate  # a key only: `mesh` computes it again
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def _global_layout(
    key: str, t: torch.Tensor, local: torch.Tensor
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        coordinate = tuple(mesh.get_coordinate() or ())
        shape, offset = _shard_layout(t.shape, mesh, tuple(t.placements), coordinate)
        if shape != tuple(local.shape):
            raise ValueError(
                f"{key}: DTensor local shard {tuple(local.shape)} is not the logical "
                f"shard {shape} (padded shards cannot be flash-saved)"
            )
        return tuple(t.shape), offset
    return tuple(t.shape), (0,) * t.dim()


@dataclass(slots=True)
class Plan:
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
def make_plan(flat: Mapping[str, Any]) -> Plan:
    keys, entries, objects, tensors, off = [], [], {}, [], 0
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            objects[key] = value
            continue
        local = local_tensor(value).detach()
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
    return Plan(keys, layout[0], objects, off, tensors, index, cuda=cuda, layout=hash(layout))


def _ident(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors views of the same bytes (not a copy of them)."""
    return (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def resolve_stateful(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level `Stateful` values replaced by their state dicts, as DCP does."""
    return {k: v.state_dict() if has_state(v) else v for k, v in state_dict.items()}


def has_state(value: Any) -> bool:
    """`isinstance(value, Stateful)` (DCP's protocol, or any with the same two methods),
    as Python's runtime check decides it, without recomputing the protocol's members
    (~20 us an object, called a few times a save)."""
    return (
        getattr(value, "state_dict", None) is not None
        and getattr(value, "load_state_dict", None) is not None
    )


def _redump(plan: Plan, dumped: dict[str, bytes], key: str, value: Any) -> None:
    """Serialise `value` for `key` again, unless it is the very immutable the plan last
    serialised (the same object: the same bytes); the plan keeps what it now holds."""
    values = plan.values
    if values.get(key, dumped) is value:
        return
    dumped[key] = plan.dumped[key] = dump_object(value)
    if immutable(value):
        values[key] = value
    else:
        values.pop(key, None)


class PlanCache:
    """A writer's plan for its `Snapshot` key: a save whose key matches takes only the fresh
    values (`Snapshot.fresh`); any other save plans the full state.

    Args:
        rank: the rank whose state this is (for the one warning of a miss).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._cache: tuple[Any, Plan] | None = None  # (Snapshot.key, plan)
        self._cache_miss_logged = False
        self.hits = 0  # saves that reused the cached plan
        self._plain: Plan | None = None  # the last plan of a state dict (not a Snapshot)
        self.reused = 0  # state-dict saves whose layout matched `_plain`

    def invalidate(self) -> None:
        """Forget the cached plan: the next `Snapshot` save reads the full state."""
        self._cache = None
        self._plain = None

    def take(
        self, state: Mapping[str, Any] | Snapshot
    ) -> tuple[Plan, list[torch.Tensor], dict[str, bytes]]:
        """The plan, this save's tensors and its serialised small values."""
        if not isinstance(state, Snapshot):
            flat = flatten(resolve_stateful(state))
            same = self._same_layout(flat)
            if same is not None:
                self.reused += 1
                return same
            plan = make_plan(flat)
            plan.dumped = {k: dump_object(v) for k, v in plan.objects.items()}
            plan.values = {k: v for k, v in plan.objects.items() if immutable(v)}
            self._plain = plan
            return plan, list(plan.tensors), dict(plan.dumped)
        if self._cache is not None and self._cache[0] == state.key:
            plan = self._cache[1]
            got = self._fresh(plan, state)
            if got is not None:
                self.hits += 1
                return plan, got[0], got[1]
        flat, _ = flatten_state_dict(resolve_stateful(state.full()))
        plan = make_plan(flat)
        plan.dumped = {k: dump_object(v) for k, v in plan.objects.items()}
        plan.values = {k: v for k, v in plan.objects.items() if immutable(v)}
        self._cache = (state.key, plan)
        return plan, list(plan.tensors), dict(plan.dumped)

    def _same_layout(
        self, flat: Mapping[str, Any]
    ) -> tuple[Plan, list[torch.Tensor], dict[str, bytes]] | None:
        """The last state dict's plan for `flat` when every tensor of `flat` fits it (the
        same keys, local shapes, dtypes, devices and global layouts: where each goes in a
        slot is unchanged), with `flat`'s own tensors as this save's sources and its small
        values serialised (again only where they are not the very objects of the last
        save's immutables); else None (plan again).

        What is copied is what the state dict holds now, as on the full path: only the
        plan's layout is reused (a state dict's tensors are new objects every call, and
        a parameter may be replaced; both are copied from where they are now)."""
        plan, self._plain = self._plain, None  # back only when it fits
        if plan is None or len(flat) != len(plan.keys) + len(plan.dumped):
            return None
        sources = list(plan.tensors)
        dumped = dict(plan.dumped)
        index, tensors = plan.index, plan.tensors
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor):
                if key not in dumped:
                    return None
                # (the plan takes the new value at once: a mismatch further on drops it)
                _redump(plan, dumped, key, value)
                continue
            i = index.get(key)
            if i is None:
                return None
            old = tensors[i]
            if type(value) is DTensor:
                value = self._shard_fits(key, value, plan.entries[i])
                if value is None:
                    return None
            elif value.requires_grad:
                value = value.detach()
            if value.shape != old.shape or value.dtype != old.dtype or value.device != old.device:
                return None
            sources[i] = value
        plan.tensors[:] = sources  # (the replaced ones are not kept alive)
        self._plain = plan
        return plan, sources, dumped

    @staticmethod
    def _shard_fits(key: str, value: DTensor, entry: TensorEntry) -> torch.Tensor | None:
        """A DTensor's local shard when its global layout is the entry's, else None."""
        with torch.no_grad():  # to_local() then records no autograd node
            local = value.to_local().detach()
        if _global_layout(key, value, local) != (entry.global_shape, entry.global_offset):
            return None
        return local

    def names_of(self, tensors: list[torch.Tensor]) -> list[str | None]:
        """The cached plan's key of each of `tensors` (the same storage, shape and dtype as
        a planned tensor; None: not planned, or no plan cached)."""
        plan = self._cache[1] if self._cache is not None else self._plain
        if plan is None:
            return [None] * len(tensors)
        where = {_ident(t): k for k, t in zip(plan.keys, plan.tensors, strict=True)}
        return [where.get(_ident(t)) for t in tensors]

    def _fresh(
        self, plan: Plan, snap: Snapshot
    ) -> tuple[list[torch.Tensor], dict[str, bytes]] | None:
        # (no `torch.no_grad()`: it cost ~10 % of a save; `detach()` keeps the copy's
        # sources out of any graph)
        if snap.flat:
            flat = snap.fresh()
        else:
            flat, _ = flatten_state_dict(resolve_stateful(snap.fresh()))
        sources = list(plan.tensors)
        dumped = dict(plan.dumped)
        values = plan.values
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                i = plan.index.get(key)
                local = local_tensor(value).detach()
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
                blob = dump_object(value.value)
                for k in value.keys:
                    dumped[k] = plan.dumped[k] = blob
                    values.pop(k, None)
                if immutable(value.value):
                    plan.shared[key] = value.value
                else:
                    plan.shared.pop(key, None)
            elif key in dumped:
                _redump(plan, dumped, key, value)
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
