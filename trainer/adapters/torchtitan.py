"""torchtitan: its own `Trainer` and train loop, made fault tolerant through its checkpoint
manager.

torchtitan builds every component of a run from its config, the checkpoint manager among
them (`Trainer.Config.checkpoint`, any `BaseCheckpointManager.Config`). `Unbroken` is a
`CheckpointManager` (torchtitan's own DCP manager, whose folder, interval and initial load
keep working) that also:

- at `load` (the first thing `Trainer.train` does): restores the newest step every rank
  holds from the agent's memory, the buddy's replica or storage into exactly what
  torchtitan checkpoints (the model parts, the optimizers, the learning-rate schedulers,
  each rank's data loader and the trainer's step), and falls back to torchtitan's own
  checkpoint folder or `initial_load_path` when there is none;
- at `save` (after every step): reports the step and its loss to the agent (hang,
  straggler and spike detection) and flash-saves the same state every `save_every`-th
  step (paced by the SDK); torchtitan's own DCP checkpoints are still written at its
  `interval`;
- before each step's forward, applies a fault injected for it (`unbroken inject
  loss-spike`) to the last model part's output layer;
- after a loss-spike rollback, restores the restore point the driver chose and moves each
  rank's data loader past the batches the driver skips (a torchdata
  `StatefulDataLoader`, as every torchtitan data loader is).

The loss comes from torchtitan's metrics: the manager adds a metrics logger (a
`BaseLogger`) that sees `loss_metrics/global_avg_loss`, so a step's loss is reported when
torchtitan logs it (`metrics.log_freq=1`: every step). Use it with one line:

    config.checkpoint = Unbroken.Config(interval=500, folder="checkpoint")
    trainer = config.build()
    trainer.train()

When the driver asks the job to stop, the manager saves and ends the loop after that
step (it lowers `config.training.steps` to it).

torchtitan 0.3.0 has no CPU path: with no accelerator it picks CUDA
(`torchtitan.tools.utils.device_type`). `use_cpu()` points torchtitan's device globals at
the CPU so a job (a test, a demo) runs on CPU with gloo, and `gloo_parallelize` wraps
a model's parallelize function so its FSDP2 reductions are ones gloo has.
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torchtitan.components.checkpoint import MODEL, TRAIN_STATE, CheckpointManager
from torchtitan.components.metrics import BaseLogger, LoggerContainer

from unbroken.trainer.adapters.core import PROGRESS_KEY, RNG_KEY, Resilient

log = structlog.get_logger(__name__)

LOSS_METRIC = "loss_metrics/global_avg_loss"


class _Saved:
    """A component seen only through `state_dict`/`load_state_dict`.

    torchtitan's `OptimizersContainer` is a `torch.optim.Optimizer` that creates its inner
    optimizers' state itself (a zero-lr step in its `state_dict`); seen as an optimizer the
    SDK would prime the container, whose own parameter groups carry no learning rate."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = self.obj.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


class _Losses(BaseLogger):
    """A torchtitan metrics logger that keeps each logged step's global average loss."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        loss = metrics.get(LOSS_METRIC)
        if loss is not None:
            self.by_step[step] = float(loss)


class _Titan(Resilient):
    """`Resilient` whose data position is the data loader's own state: a skip advances it."""

    def __init__(self, manager: Unbroken, state: dict[str, Any], **kw: Any) -> None:
        super().__init__(state, **kw)
        self.manager = manager

    def advance_data(self, batches: int, *, at_restore: bool) -> None:
        self.manager.skip_batches(batches, at_restore=at_restore)


class Unbroken(CheckpointManager):
    """torchtitan's DCP checkpoint manager plus unbroken's flash saves, restore, reports,
    injected faults and rollback skips (see the module docstring).

    Config (beside `CheckpointManager.Config`'s fields; `enable` is True here):
        save_every: flash-save every this many steps (1: every step, as paced by the SDK).
        persist_every_s: about how often the agent persists a save to storage (None: the
            SDK's default).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        enable: bool = True
        """Must stay True: a disabled torchtitan manager is never called."""

        save_every: int = 1
        """Flash-save every this many steps (1: every step, as the SDK's pacing allows)."""

        persist_every_s: float | None = None
        """About how often the agent persists a flash save to storage (None: SDK default)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        if not config.enable:
            raise ValueError(
                "unbroken's torchtitan checkpoint manager needs checkpoint.enable=True "
                "(a disabled manager is never called); to keep torchtitan's own DCP saves "
                "rare, raise checkpoint.interval instead"
            )
        super().__init__(config, **kwargs)
        torch_compat()
        self.trainer: Any = self.states.get(TRAIN_STATE)
        self.model_parts: list[torch.nn.Module] = kwargs["model_parts"]
        self.data: Any = kwargs.get("dataloader")
        # one step's batches from each rank's loader: gradient accumulation x microbatches
        self.batches_per_step = int(
            getattr(self.trainer, "gradient_accumulation_steps", 1)
            * getattr(self.trainer, "num_pipeline_parallel_microbatches", 1)
        )
        # torchtitan's own checkpoint layout: the model's tensors at the top level under
        # their names, the other components under theirs (so a step the agent persists
        # as DCP is a checkpoint torchtitan itself loads)
        self.model: Any = self.states[MODEL]
        state = {
            k: _Saved(v) if isinstance(v, torch.optim.Optimizer) else v
            for k, v in self.states.items()
            if k != MODEL
        }
        model_state = self.model.state_dict()
        clash = sorted(set(model_state) & (set(state) | {PROGRESS_KEY, RNG_KEY}))
        if clash:
            raise ValueError(f"model parameter names {clash} clash with checkpoint keys")
        self._model_keys = list(model_state)
        state.update(model_state)
        self.resilient = _Titan(
            self,
            state,
            save_every=config.save_every,
            persist_every_s=config.persist_every_s,
        )
        self.losses = _Losses()
        self._add_metrics_logger()
        self._checked_step = -1
        self._closed = False
        self.model_parts[-1].register_forward_pre_hook(self._before_forward)

    @property
    def last_loss(self) -> float | None:
        """The newest logged step's global average loss (None before the first)."""
        by_step = self.losses.by_step
        return by_step[max(by_step)] if by_step else None

    @property
    def restored_from(self) -> str:
        """Where the start came from: memory, buddy, storage, torchtitan (its own
        checkpoint folder or initial load) or "" (a fresh start)."""
        return self.resilient.restored_from

    def _add_metrics_logger(self) -> None:
        metrics = getattr(self.trainer, "metrics_processor", None)
        if metrics is None:
            log.warning("adapter.no_loss", why="the trainer has no metrics processor")
            return
        if not isinstance(metrics.logger, LoggerContainer):
            container = LoggerContainer()
            container.add_logger(metrics.logger)
            metrics.logger = container
        metrics.logger.add_logger(self.losses)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A step's first forward (the trainer's step counter is already the new step)."""
        step = int(getattr(self.trainer, "step", 0))
        if step != self._checked_step:
            self._checked_step = step
            self.resilient.step_begin(step, module)

    def _load(self, step: int = -1) -> bool:
        self.resilient.restore()
        if self.resilient.restored_from:
            # the tensors were filled in place; the model's own `load_state_dict` also
            # covers names its state-dict hooks make (its cached view is rebuilt)
            restored = self.resilient.state
            self.model.load_state_dict({k: restored[k] for k in self._model_keys})
            restored.update(self.model.state_dict())
            return True
        loaded = super()._load(step)
        if loaded:
            self.resilient.restored_from = "torchtitan"
            self.resilient.progress.step = int(getattr(self.trainer, "step", 0))
        return loaded

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        by_step = self.losses.by_step  # this step's loss stays: `last_loss`
        loss = by_step.get(curr_step)
        for old in [s for s in by_step if s < curr_step]:
            del by_step[old]
        # the model's tensors as torchtitan's wrapper sees them now (it refreshes the ones
        # its state-dict hooks make, in place)
        self.resilient.state.update(self.model.state_dict())
        stop = self.resilient.step_end(curr_step, loss)
        saved = super()._save(curr_step, last_step)
        if stop and self.trainer is not None:
            log.info("adapter.stop_requested", step=curr_step)
            self._closed = True
            self.resilient.close()
            self.trainer.config.training.steps = curr_step  # the loop ends after this step
        return saved

    def _close(self) -> None:
        if not self._closed:  # the trainer closes it, and its `__del__` again
            self._closed = True
            self.resilient.close()
        super()._close()

    def skip_batches(self, batches: int, *, at_restore: bool) -> None:
        """Move this rank's data loader past `batches` steps' worth of batches."""
        if not advance_loader(self.data, batches * self.batches_per_step, started=not at_restore):
            log.warning(
                "adapter.skip_not_applied",
                batches=batches,
                why=f"the data loader {type(self.data).__name__} is not a StatefulDataLoader",
            )


def advance_loader(data: Any, n: int, *, started: bool) -> bool:
    """Move a torchdata `StatefulDataLoader` past its next `n` batches; False (nothing done)
    for another loader.

    `started`: the loader's iterator is live (the trainer's loop holds it, and the loader
    keeps it as its own): draw from that one. Otherwise (before the loop's `iter`) draw from
    a fresh one and leave its state as the loader's start, so the loop's `iter` resumes
    past the batches."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if not isinstance(data, StatefulDataLoader):
        return False
    it = data._iterator if started and data._iterator is not None else iter(data)
    for _ in range(n):
        next(it)
    if not started:
        data.load_state_dict(data.state_dict())
    return True


def torch_compat() -> None:
    """What torchtitan 0.3.0 (written against torch nightlies) calls and torch 2.13 names
    differently: `torch.distributed.set_timeout` (torchtitan sets the process groups'
    timeouts after the first step) is `distributed_c10d._set_pg_timeout` there. The
    checkpoint manager calls this; it adds only what is missing."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout") and hasattr(distributed_c10d, "_set_pg_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]


class _CpuDevice(types.ModuleType):
    """What torchtitan asks of its device module, for the CPU (torch.cpu lacks some)."""

    def __init__(self) -> None:
        super().__init__("unbroken_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def set_device(self, device: Any) -> None:
        pass

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_properties(self, device: Any = None) -> Any:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return types.SimpleNamespace(total_memory=pages, name="cpu")

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        return {}

    def synchronize(self, device: Any = None) -> None:
        pass


# The torchtitan modules that bind `device_type` / `device_module` when imported.
_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
)


def gloo_parallelize(parallelize_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A model spec's `parallelize_fn` whose FSDP2 reductions gloo can run.

    torchtitan scales gradients itself (by the global token count) and sets FSDP's divide
    factor to 1, which FSDP2 turns into a `PREMUL_SUM` reduce-scatter; gloo has no
    PREMUL_SUM. With the sum forced, FSDP2 sums and divides by the same factor of 1."""

    def parallelize(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def use_cpu() -> None:
    """Run torchtitan on the CPU (gloo): point its device globals at the CPU.

    torchtitan 0.3.0 picks CUDA when no accelerator is present. Call this before building
    the trainer; torchtitan's parts that have no CPU implementation stay unavailable
    (FlexAttention's backward: use `ScaledDotProductAttention`; the "spmd_types" backend's
    FSDP: use `parallelism.spmd_backend="partial_dtensor"`)."""
    cpu = _CpuDevice()
    for name in _DEVICE_MODULES:
        module = importlib.import_module(name)
        for attr, value in (("device_type", "cpu"), ("device_module", cpu)):
            if hasattr(module, attr):
                setattr(module, attr, value)
