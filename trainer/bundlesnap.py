"""A user's state dict saved every step without calling its `state_dict()` each time.

A flash save of the SDK (`hooks.save`) takes `{KEY: bundle}` of the user's state: models,
optimizers, schedulers, tensors. Through `state_dict()` and DCP's flattening that is most
of a small model's save (a two-layer GPT-2 with AdamW: ~0.45 ms of a 1.1 ms save between
training steps, against a 10 ms step). But a model's parameters and an optimizer's state
are updated in place: from step to step `state_dict()` returns views of the same tensors,
and only small values change (the learning rate, a scheduler's counters, the step).

`snapshot(bundle)` gives a `Snapshot` when every entry allows it: its key is the identity
of every tensor the entry's `state_dict()` holds (object, storage, shape), so a
replaced or re-allocated tensor, a new optimizer state, a loaded state or another set of
entries changes it and the writer takes the full path; its fresh values are what
`state_dict()` holds besides those tensors, under the same flattened names. Entries:

- an `nn.Module` whose whole tree saves as torch's `Module.state_dict` does (no state-dict
  hooks, no `get_extra_state`, no override) and holds plain tensors only (no DTensor or
  other subclass): its parameters and persistent buffers, no fresh values;
- a `torch.optim.Optimizer` of torch's own `state_dict` (no hooks, no override): its
  per-parameter state tensors in the key, the rest (param-group values, non-tensor state)
  fresh;
- a plain tensor: in the key;
- anything else (a scheduler, the adapters' step and RNG, a nested dict): its whole
  `state_dict()` (or itself) is fresh each save, as on the full path.

An object that stands for another (an adapter's `_Attr`, resolved at each save) names it
with `snapshot_target()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unbroken.recovery.flashplan import Snapshot, flatten, has_state

_Module = torch.nn.Module
_Optimizer = torch.optim.Optimizer


def snapshot(key: str, state: Mapping[str, Any], full: Any) -> Snapshot | None:
    """`full` (the bundle of `state`, saved as `{key: full}`) as a `Snapshot`, or None when
    an entry of `state` cannot be snapshotted (take the full path)."""
    live: list[tuple[str, Any]] = []
    tensors: list[torch.Tensor] = []
    params: list[torch.Tensor] = []  # an optimizer's parameters: only their identity counts
    entries: list[Any] = []  # per entry: its name, kind and tensor count
    for name, value in state.items():
        target = getattr(value, "snapshot_target", None)
        obj = target() if target is not None else value
        before = len(tensors)
        if isinstance(obj, _Module):
            if not _module_tensors(obj, tensors):
                return None
        elif isinstance(obj, _Optimizer):
            if not _optimizer_tensors(obj, tensors, params):
                return None
            entries.append(len(obj.state))
        elif isinstance(obj, torch.Tensor):
            if type(obj) not in _PLAIN:
                return None
            tensors.append(obj)
        entries.append((name, type(obj), len(tensors) - before))
        live.append((name, obj))
    try:
        ptrs = tuple([t.data_ptr() for t in tensors])
    except RuntimeError:  # a tensor without storage (sparse): plan every save
        return None
    prefix = key + "."
    return Snapshot(
        # the tensor objects themselves (kept alive: an id is never reused while the key
        # lives), where their data is, and their shapes
        key=(
            tuple(entries),
            _Same(params),
            _Same(tensors),
            ptrs,
            tuple([t.shape for t in tensors]),
        ),
        full=lambda: {key: full},
        fresh=lambda: _fresh(prefix, live),
        flat=True,
    )


class _Same:
    """Tensors compared by identity (`==`: the same objects in the same order)."""

    __slots__ = ("objs",)

    def __init__(self, objs: list[Any]) -> None:
        self.objs = objs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same) or len(other.objs) != len(self.objs):
            return False
        return all(a is b for a, b in zip(self.objs, other.objs, strict=True))

    __hash__ = None  # type: ignore[assignment]


_plain_types: dict[type, bool] = {}


def _plain_type(cls: type) -> bool:
    """Whether modules of `cls` save as `Module.state_dict` does (checked once a class)."""
    plain = _plain_types.get(cls)
    if plain is None:
        plain = (
            cls.state_dict is _Module.state_dict  # type: ignore[attr-defined]
            and cls._save_to_state_dict is _Module._save_to_state_dict  # type: ignore[attr-defined]
            and cls.get_extra_state is _Module.get_extra_state  # type: ignore[attr-defined]
        )
        _plain_types[cls] = plain
    return plain


def _module_tensors(module: torch.nn.Module, out: list[torch.Tensor]) -> bool:
    """Append every tensor `module.state_dict()` holds to `out`; False when the module tree
    does not save plainly. (A walk of its own: `modules()` names every submodule on the
    way, a third of this a save.)"""
    seen: set[int] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if not _plain_type(type(m)) or m._state_dict_hooks or m._state_dict_pre_hooks:
            return False
        for p in m._parameters.values():
            if p is not None:
                if type(p) not in _PLAIN:  # a DTensor, a quantised or other subclass
                    return False
                out.append(p)
        if m._buffers:
            skip = m._non_persistent_buffers_set
            for n, b in m._buffers.items():
                if b is not None and n not in skip:
                    if type(b) not in _PLAIN:
                        return False
                    out.append(b)
        if m._modules:
            todo.extend(c for c in m._modules.values() if c is not None)
    return True


def _optimizer_tensors(
    opt: torch.optim.Optimizer, out: list[torch.Tensor], params: list[torch.Tensor]
) -> bool:
    """Append the optimizer's state tensors to `out` and its parameters (whose order gives
    the state's indices) to `params`; False when its `state_dict()` is not torch's plain
    one."""
    cls = type(opt)
    if (
        cls.state_dict is not _Optimizer.state_dict
        or opt._optimizer_state_dict_pre_hooks
        or opt._optimizer_state_dict_post_hooks
    ):
        return False
    state = opt.state
    for group in opt.param_groups:
        params.extend(group["params"])
        params.append(None)  # type: ignore[arg-type]  # (where a group ends)
        for p in group["params"]:
            for v in state.get(p, _EMPTY).values():
                if type(v) in _PLAIN:
                    out.append(v)
                elif isinstance(v, torch.Tensor):  # a DTensor or another subclass
                    return False
    return True


_EMPTY: dict[str, Any] = {}
# the tensor types whose identity, storage and shape say what `state_dict()` holds (a type
# check where isinstance on DTensor took ~0.5 us a tensor)
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def _fresh(prefix: str, live: list[tuple[str, Any]]) -> dict[str, Any]:
    """The fresh values under the names `flatten({key: full.state_dict()})` gives them."""
    out: dict[str, Any] = {}
    for name, obj in live:
        at = prefix + name
        if isinstance(obj, _Module | torch.Tensor):
            continue
        if isinstance(obj, _Optimizer):
            _optimizer_fresh(out, at, obj)
            continue
        out.update(flatten({at: obj.state_dict() if has_state(obj) else obj}))
    return out


def _optimizer_fresh(out: dict[str, Any], at: str, opt: torch.optim.Optimizer) -> None:
    """What torch's `Optimizer.state_dict` holds besides the state tensors: each group's
    values (its `params` as the indices torch gives them) and non-tensor state values."""
    index = 0
    for g, group in enumerate(opt.param_groups):
        gat = f"{at}.param_groups.{g}."
        params = group["params"]
        for k, v in group.items():
            if k != "params":
                out[gat + k] = v
        out[gat + "params"] = list(range(index, index + len(params)))
        for i, p in enumerate(params, index):
            state = opt.state.get(p)
            if state:
                for k, v in state.items():
                    if not isinstance(v, torch.Tensor):
                        out[f"{at}.state.{i}.{k}"] = v
        index += len(params)
