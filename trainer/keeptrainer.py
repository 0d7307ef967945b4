"""A survivor of an in-job recovery keeps its trainer for the next world.

A rank whose peer failed leaves its world (trainer/rejoin.py) and, until now, closed its
trainer and built a new one in the next world: the model, its FSDP wrapping, the optimizer,
the data loader, then `state_dict()` once to size the restore, about 0.06-0.12 s of CPU
on a loaded 2-core host, run while the replacement does the same. A trainer that can
(`Rejoinable`: the embedded engine without context or expert parallelism or compilation;
with pipelining it makes new stages on the kept parts) is kept instead:

- leaving (`keep`, as `train` ends by `Held`): the trainer resets what the failed step
  left half done (FSDP2's own `reset_iter_state`: pending all-gathers and reductions,
  unsharded parameters, per-iteration trackers; gradients dropped) and records which
  ranks each of its process groups held;
- in the next world (`take`): the trainer builds its meshes again, as a fresh one would,
  so every rank creates the same groups in the same order (torch names them by a counter
  that a world's end resets: the same names again), checks that every group it keeps
  refers to by name has the same ranks as before, and points the objects that hold a group
  rather than its name (FSDP2's mesh infos, the meshes' registries) at the new ones. Its
  tensors are untouched: the restore that follows loads the agreed step into them in place.

Anything else (another world size or rank, another configuration, a check that fails)
closes the kept trainer and the worker builds a new one, as before. A check that fails
after the new groups were made cannot fall back that way (its peers made them once): the
worker then exits and the driver restarts every process (the fallback of the issue). A
restore that finds no step (every rank starts afresh) rebuilds the kept trainer's model,
optimizer and loader on its meshes (`restored`): its weights are then a new trainer's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import structlog

from unbroken.trainer.rtrace import mark

log = structlog.get_logger(__name__)


@runtime_checkable
class Rejoinable(Protocol):
    """Optional: a trainer that can be kept across an in-job recovery's new world."""

    def leave_world(self) -> str | None:
        """The world is being left after `Held`: make the trainer fit to be kept.
        None when it can be; else why not (it is closed as before)."""
        ...

    def start_afresh(self) -> None:
        """Its first restore in the new world found no step (no rank holds one): become
        what a new trainer is before its first step, without making any group."""
        ...

    def rejoin_world(self, config: Any) -> str | None:
        """In the new world, before any restore: make its process groups again and point
        the trainer at them. None when done; else why not (called before any group is
        made: the caller builds a new trainer).

        Raises:
            RuntimeError: the groups were made and do not match the kept ones.
        """
        ...


_kept: list[Any] = []  # at most one: the trainer of the world this rank left
_taken: list[Any] = []  # the trainer `take` gave, until its first restore


def keep(trainer: Any, leaving: bool) -> bool:
    """As `train` ends: whether `trainer` is kept for the next world (then not closed).
    `leaving`: it ends by `Held` (the world is left; the process stays)."""
    _kept.clear()
    if not leaving or not isinstance(trainer, Rejoinable):
        return False
    try:
        why = trainer.leave_world()
    except Exception as e:  # a trainer that cannot say is rebuilt
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        log.info("trainer rebuilt in the next world", why=why)
        return False
    _kept.append(trainer)
    return True


def holding() -> bool:
    """Whether a trainer is kept for the next world (`keep` said so, nobody took it yet)."""
    return bool(_kept)


def drop() -> None:
    """Close a kept trainer nobody will take (a worker without a flash store)."""
    while _kept:
        with contextlib.suppress(Exception):
            _kept.pop().close()


def take(config: Any) -> Any | None:
    """The kept trainer, pointed at the current world; None when there is none or it
    cannot be (then it is closed and the caller builds a new one)."""
    if not _kept:
        return None
    trainer = _kept.pop()
    why = trainer.rejoin_world(config)  # a RuntimeError ends the worker: see the module
    if why is None:
        mark("rebound")
        log.info("trainer kept across worlds")
        _taken[:] = [trainer]
        return trainer
    log.info("trainer rebuilt in the new world", why=why)
    with contextlib.suppress(Exception):
        trainer.close()
    return None


def drop_step_grads(modules: list[Any]) -> None:
    """Drop what a failed step's backward left in FSDP2's unsharded parameters: their
    `.grad` (autograd accumulates into it before the reduction takes it) and the
    accumulated gradient. `reset_iter_state` reshards but leaves both, and the next
    backward added to them (a test's first step after a rollback had the same loss and
    another gradient norm)."""
    for g in _fsdp_groups(modules):
        for p in g.fsdp_params:
            p.unsharded_accumulated_grad = None
            unsharded = getattr(p, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


def _fsdp_groups(modules: list[Any]) -> Iterator[Any]:
    """Every FSDP2 parameter group under `modules`."""
    from torch.distributed.fsdp import FSDPModule

    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                yield from m._get_fsdp_state()._fsdp_param_groups


def restored(trainer: Any, found: bool) -> None:
    """After the first restore in a world: a taken trainer for which no step was found
    (every rank starts afresh) becomes a new one (`start_afresh`), so its weights are the
    initial weights every new trainer computes, not what it held."""
    if _taken and _taken[0] is trainer:
        _taken.clear()
        if not found:
            trainer.start_afresh()
            log.info("kept trainer started afresh: no rank holds a step")


def group_ranks(meshes: list[Any]) -> dict[str, tuple[int, ...]]:
    """Name -> global ranks of every process group the meshes refer to by name (their
    dimensions' and their flattened meshes'), read from the current world."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    names: set[Any] = set()  # torch types them GroupName
    for mesh in meshes:
        root = mesh._get_root_mesh()
        for m in (mesh, root, *root._flatten_mapping.values()):
            names.update(m._dim_group_names)
    return {n: tuple(dist.get_process_group_ranks(_resolve_process_group(n))) for n in names}


def repoint(meshes: list[Any], modules: list[Any], before: dict[str, tuple[int, ...]]) -> None:
    """Point the kept meshes' registries and FSDP2's mesh infos under `modules` at the
    current world's groups of the same names.

    Raises:
        RuntimeError: a group is missing or holds other ranks than `before` says.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    now = group_ranks(meshes)
    if now != before:
        moved = sorted(n for n in before if now.get(n) != before[n])
        raise RuntimeError(f"the new world's groups differ from the kept trainer's: {moved[:4]}")
    for mesh in meshes:
        reg = mesh._get_root_mesh()._pg_registry
        for name in list(reg):
            reg[name] = _resolve_process_group(name)
    seen: set[int] = set()
    for g in _fsdp_groups(modules):
        infos = [g.mesh_info, g.post_forward_mesh_info]
        infos += [i for p in g.fsdp_params for i in (p.mesh_info, p.post_forward_mesh_info)]
        for info in infos:
            if info is not None and id(info) not in seen:
                seen.add(id(info))
                _repoint_info(info)


def _repoint_info(info: Any) -> None:
    if getattr(info, "reduce_scatter_process_group", None) is not None:
        raise RuntimeError("FSDP's separate reduce-scatter group cannot be re-pointed")
    if hasattr(info, "shard_process_group"):
        info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
    if hasattr(info, "replicate_process_group"):
        info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
