"""The `Trainer` plugin interface and its discovery through the `unbroken.trainers` group.

A worker process (started by torchrun or by the node agent) loads a trainer by name, calls
`setup` once the process group exists, then `train_step` in a loop; flash checkpoints and the
recovery loop use `state_dict` / `load_state_dict`, which must be sharded and
torch.distributed.checkpoint (DCP) compatible so a checkpoint saved under one mesh loads under
another. Any package can add a trainer by declaring an entry point, e.g. in pyproject.toml
`[project.entry-points."unbroken.trainers"] mine = "pkg.module:MyTrainer"`; the core never
needs to change. This module imports no torch, so listing plugins is cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from unbroken.trainer.config import TrainConfig

ENTRY_POINT_GROUP = "unbroken.trainers"

# Keys every trainer's per-step metrics dict carries (values may be None when not measurable).
METRIC_KEYS: tuple[str, ...] = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "flops_per_s",
    "mfu",
    "pipeline_idle_fraction",
)


@runtime_checkable
class Stateful(Protocol):
    """What a flash checkpoint saves and restores: a DCP `Stateful`.

    Every `Trainer` is one (`dcp.save({"trainer": t}, ...)` and `dcp.load(...)` work on it
    directly); so is the hooks SDK's view of a script's state dict.
    """

    def state_dict(self) -> dict[str, Any]:
        """Sharded, DCP-compatible state: model, optimizer, step, data position, RNG."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a state dict shaped like `state_dict()` (possibly another layout)."""
        ...


@runtime_checkable
class Trainer(Stateful, Protocol):
    """What the runner, the agent and the flash checkpoint need from a training engine.

    The optional protocols below name what else the runner (`unbroken.trainer.run`) and
    the flash checkpoint (`unbroken.trainer.flashckpt`) use when a trainer offers it; they
    check for each with `isinstance`, and a trainer without it loses only that feature.
    """

    def setup(self, config: TrainConfig) -> None:
        """Build model, optimizer and data for this rank; the process group already exists."""
        ...

    def train_step(self) -> dict[str, Any]:
        """Run one optimizer step; return the metrics named in `METRIC_KEYS`."""
        ...

    def close(self) -> None:
        """Release what `setup` acquired; the process group is the caller's."""
        ...


@runtime_checkable
class Snapshots(Protocol):
    """Optional: a trainer whose per-step flash save can skip `state_dict()`.

    Parameters and optimizer state are updated in place, so the tensors of `state_dict()`
    are the same objects from step to step; only a few small values change. A trainer that
    says so saves each step by serialising `snapshot_fresh()` alone (the embedded engine:
    ~0.1 ms instead of the 6-7 ms of DCP's state-dict calls over FSDP2).
    """

    def snapshot_key(self) -> Any:
        """A value that changes whenever a tensor of `state_dict()` may have been replaced
        (a load, new optimizer state); None: take the full `state_dict()` this time."""
        ...

    def snapshot_fresh(self) -> dict[str, Any]:
        """The values of `state_dict()` that change between steps, nested the same way."""
        ...


#: (a param group, one of its keys, the names under `state_dict()["optimizer"]` that hold
#: `group[key]`: DCP's flattened `param_groups.<parameter fqn>.<key>`, one per parameter)
GroupValue = tuple[Mapping[str, Any], str, tuple[str, ...]]


class SharedSnapshots(Snapshots, Protocol):
    """Optional, beside `Snapshots`: the optimizer's param-group values by group.

    DCP's flattened optimizer state holds each param-group value once per parameter (a
    model of 43 parameters: 430 learning rates, betas, eps...), which a per-step save
    otherwise walks one by one. The embedded engine implements it; the flash save then
    serialises each group's value once, and skips the values that did not change.
    """

    def snapshot_fresh_shared(self) -> tuple[dict[str, Any], Sequence[GroupValue]]:
        """`snapshot_fresh()` without its "optimizer" entry, and the param-group values.

        The sequence is the same object until the state is replaced (`snapshot_key`
        changes), so a caller may cache what it derives from it."""
        ...


@runtime_checkable
class Optimizers(Protocol):
    """Optional: a trainer that names its optimizers (after `setup`).

    A flash save's copy runs during the next step; only these optimizers' `step()` then
    waits for it. Without them every optimizer of the process waits (torch's global hook).
    """

    optimizers: Sequence[Any]  # torch.optim.Optimizer


@runtime_checkable
class Meshed(Protocol):
    """Optional: a trainer laid out on a named DeviceMesh (the embedded engine).

    Its flash copies record the mesh shape and stages per rank as their layout, so a restore
    under another layout reshards instead of loading a shard that no longer fits; ranks that
    differ only along the mesh's `dp_replicate` dimension hold the same state, so one of
    them reads a copy from storage and broadcasts it. Without it a copy records only the
    world size and every rank reads its own.
    """

    def device_mesh(self) -> DeviceMesh:
        """This rank's mesh (after `setup`)."""
        ...

    def stages_per_rank(self) -> int:
        """Pipeline stages this rank holds (1 without pipelining)."""
        ...


@runtime_checkable
class Skips(Protocol):
    """Optional: a trainer that can skip batches (loss-spike recovery skips the batches that
    spoiled the step; without it, a rollback replays them)."""

    def skip(self, n_batches: int) -> None:
        """Skip `n_batches` global batches of data."""
        ...


@runtime_checkable
class BatchSource(Protocol):
    """A data loader whose next global batch is `next_batch()` (inputs, targets)."""

    def next_batch(self) -> tuple[Any, Any]: ...


@runtime_checkable
class Batches(Protocol):
    """Optional: a trainer that draws its batches from `loader` (after `setup`); a
    `loss-spike` drill poisons the targets of one batch (not applied without it)."""

    loader: BatchSource


@runtime_checkable
class Throttled(Protocol):
    """Optional: a trainer whose compute a drill can slow down: each step's compute takes
    `slow_factor` times as long (1.0: none). Without it the slow-node drill does nothing."""

    slow_factor: float


@runtime_checkable
class Collectives(Protocol):
    """Optional: a trainer that calls `on_collective` (when set) as a step's timed
    collective begins, so the agent judges a rank waiting there for a stalled peer as that
    peer's victim (the hooks' "collective" phase), not as hung itself."""

    on_collective: Callable[[], object] | None


def available() -> list[str]:
    """Names of the trainers registered under `unbroken.trainers`."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load_trainer(name: str) -> Trainer:
    """Instantiate the trainer plugin registered as `name`.

    Raises:
        ValueError: no such plugin, or the object lacks the `Trainer` methods.
    """
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        raise ValueError(
            f"no trainer plugin named {name!r} in entry-point group {ENTRY_POINT_GROUP!r}; "
            f"installed: {available() or 'none'}. Install the package that provides it."
        )
    factory = matches[0].load()
    trainer = factory()
    if not isinstance(trainer, Trainer):
        raise ValueError(
            f"trainer plugin {name!r} ({matches[0].value}) does not implement the Trainer "
            "protocol (setup, train_step, state_dict, load_state_dict, close)"
        )
    return trainer
