"""What every adapter shares: restore at start, report and save after each step, skip.

`Resilient` wraps a state dict the way the hooks SDK takes it (name -> a model, an
optimizer, a scheduler: anything with `state_dict`/`load_state_dict`, or tensors and small
values) and adds two entries of its own: `unbroken` (the step and the batches skipped by
loss-spike rollbacks, so the data position after a restore is `step + skipped`) and `rng`
(this rank's torch CPU generator, so dropout after a restore draws what the uninterrupted
run drew). Then:

- `restore()` (collective, once, after the model and optimizer exist) loads the newest step
  every rank holds from the agent's memory, the buddy's replica or storage. After a
  loss-spike rollback the agent names the restore point (`UNBROKEN_RESTORE_STEP`): the
  newest step at or before it is restored, newer copies are discarded (a dead timeline),
  and the batches the driver asks to skip (`UNBROKEN_SKIP_BATCHES`) are added to the data
  position. With nothing saved yet, a torch.distributed.checkpoint directory (`init_from`,
  e.g. one torchtitan or `dcp.save` wrote, or a step unbroken persisted) is the start.
- `step_begin(step, model)` (before the step's forward) applies a fault injected for that
  step (`unbroken inject loss-spike|nan`, through `hooks.injected_fault`): for that one
  step the model's output layer is scaled by `SPIKE_FACTOR` (the loss really spikes and
  the bad update is applied, as a poisoned batch's would be) or made NaN.
- `step_end(step, loss)` reports the step and its loss (the agent's hang, straggler and
  spike detectors), flash-saves (every `save_every`-th step, paced by the SDK to a share
  of the step time), waits at a step whose loss spiked for the driver's rollback
  (`hooks.spike_wait`), and says whether the driver asked the job to stop.

Without an agent every call is a cheap no-op (after one warning), so the script stays
portable.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from unbroken.common.workerenv import WorkerEnv
from unbroken.trainer import hooks

log = structlog.get_logger(__name__)

PROGRESS_KEY = "unbroken"
RNG_KEY = "rng"
# An injected loss spike multiplies the output layer's activations by this for one step:
# a tiny GPT-2's loss of about 4 became hundreds (the agent calls 2.5x its median a spike).
SPIKE_FACTOR = 1000.0


class Progress:
    """The step and the batches skipped so far (a DCP `Stateful`)."""

    def __init__(self) -> None:
        self.step = 0
        self.skipped = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "skipped": self.skipped}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.skipped = int(state_dict["skipped"])


class Rng:
    """This rank's torch CPU generator state (a DCP `Stateful`)."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])


@dataclass(frozen=True, slots=True)
class RestorePoint:
    """A rollback's restore point and skip, as the agent passes them (else nothing)."""

    step: int | None = None
    skip_from_step: int = 0
    skip_batches: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RestorePoint:
        w = WorkerEnv.from_env(os.environ if env is None else env)
        skip_from, skip = w.skip_batches or (0, 0)
        return cls(step=w.restore_step, skip_from_step=skip_from, skip_batches=skip)


class Resilient:
    """One rank's fault tolerance for a training loop the user (or a library) runs.

    Args:
        state: name -> what to save and restore (see the module docstring); the keys
            `unbroken` and `rng` are added. The same objects are saved every step.
        save_every: flash-save every this many steps (1: every step; the SDK may pace
            further so saves stay under its share of the step time).
        init_from: a DCP checkpoint directory to start from when no flash copy exists.
        rng: save and restore the CPU generator (False: the caller restores its own).
        persist_every_s: about how often a save is also persisted to storage by the agent
            (None: the SDK's default, or what `hooks.init` was given).
    """

    def __init__(
        self,
        state: dict[str, Any],
        *,
        save_every: int = 1,
        init_from: str | os.PathLike[str] | None = None,
        rng: bool = True,
        persist_every_s: float | None = None,
    ) -> None:
        if persist_every_s is not None:
            hooks.init(persist_every_s=persist_every_s)
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        for key in (PROGRESS_KEY, RNG_KEY):
            if key in state:
                raise ValueError(f"state key {key!r} is unbroken's own; rename yours")
        self.progress = Progress()
        self.state: dict[str, Any] = {**state, PROGRESS_KEY: self.progress}
        if rng:
            self.state[RNG_KEY] = Rng()
        self.save_every = save_every
        self.init_from = None if init_from is None else os.fspath(init_from)
        self.point = RestorePoint.from_env()
        self.restored_from = ""  # memory, buddy, storage, dcp, or "" (a fresh start)
        self.saves = 0  # flash saves started (the SDK paces them)
        self.steps = 0  # steps ended in this process
        self._fault: Any = None  # the hook an injected fault put on the model, for a step

    @property
    def step(self) -> int:
        """The last finished step (0 before the first)."""
        return self.progress.step

    @property
    def position(self) -> int:
        """Global batches the data has given so far: the next step's batch is this one."""
        return self.progress.step + self.progress.skipped

    def restore(self) -> int:
        """Restore the newest step every rank holds; returns it (0: a fresh start).

        Collective under torch.distributed: every rank, after `init_process_group` and
        after the model and optimizer exist."""
        done = self._restore_flash()
        if done is not None:
            self.restored_from = done
        elif self.init_from:
            load_dcp(self.state, self.init_from)
            self.restored_from = "dcp"
        self._skip_due(self.progress.step + 1, at_restore=True)
        hooks.phase("train", step=self.progress.step, source=self.restored_from or None)
        return self.progress.step

    def _restore_flash(self) -> str | None:
        hooks.phase("restore")  # judged by the phase limit, not the step rhythm
        step = hooks.restore(self.state, not_after=self.point.step)
        if step is None:
            return None
        self.progress.step = step
        return hooks.restored_source()

    # Whether the adapter's data follows `position` when a skip falls due mid-run, after the
    # restore (Accelerate's `batches` does; a library that prefetches or derives its data
    # position from its own step counter cannot), and at the restore.
    skips_mid_run = True
    skips_at_restore = True

    def skip_due(self, next_step: int, *, at_restore: bool = False) -> None:
        """Apply a rollback's skip when `next_step` is its first step (`step_end` does)."""
        self._skip_due(next_step, at_restore=at_restore)

    def _skip_due(self, next_step: int, *, at_restore: bool = False) -> None:
        p = self.point
        if p.skip_batches and next_step == p.skip_from_step:
            if not (self.skips_at_restore if at_restore else self.skips_mid_run):
                log.warning(
                    "adapter.skip_not_applied",
                    batches=p.skip_batches,
                    before_step=next_step,
                    why=type(self).__name__ + " cannot move this library's data position",
                )
                return
            self.progress.skipped += p.skip_batches
            self.advance_data(p.skip_batches, at_restore=at_restore)
            log.info("adapter.batches_skipped", batches=p.skip_batches, before_step=next_step)

    def advance_data(self, batches: int, *, at_restore: bool) -> None:
        """Move the data past `batches` steps' batches when a rollback's skip takes effect
        (`position` already counts them). Nothing here: an adapter whose data follows
        `position` needs no more; one whose loader keeps its own position moves it."""

    def step_begin(self, step: int, model: Any) -> None:
        """Before step `step`'s forward: apply a fault injected for it to `model` (a
        `torch.nn.Module`), until `step_end`. One file check when the agent started this
        process, nothing otherwise."""
        fault = hooks.injected_fault(step)
        if fault is None:
            return
        self.fault_end()
        log.warning("fault applied", kind=fault.kind, step=step, id=fault.id)
        self._fault = poison(model, fault.kind)

    def fault_end(self) -> None:
        """Take an applied fault off the model (`step_end` does)."""
        if self._fault is not None:
            self._fault.remove()
            self._fault = None

    def step_end(self, step: int, loss: Any = None) -> bool:
        """After optimizer step `step` (1-based): report, maybe save. Returns True when the
        driver asked the job to stop (save happened; leave the loop)."""
        self.fault_end()
        self.progress.step = step
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        value = None if loss is None else float(loss)
        hooks.report(step, value)
        self.save(step)
        hooks.spike_wait(step, value)  # a spike: wait here for the driver's rollback
        self._skip_due(step + 1)
        return hooks.should_stop()

    def save(self, step: int) -> bool:
        """Flash-save the state as that of `step` when it is due (every `save_every`-th
        step, as the SDK's pacing allows); whether a save started."""
        self.steps += 1
        if step % self.save_every == 0 and hooks.save(step, self.state):
            self.saves += 1
            return True
        return False

    def close(self) -> None:
        """Finish the save in flight (call before the process group goes)."""
        hooks.flush()
        if self.steps:
            log.info("adapter.save_stats", saves=self.saves, steps=self.steps)


def output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The module that computes `model`'s output: its last leaf with parameters (a language
    model's head, an MLP's last linear layer)."""
    leaves = [
        m
        for m in model.modules()
        if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None
    ]
    if not leaves:
        raise ValueError(f"{type(model).__name__} has no layer with parameters to poison")
    return leaves[-1]


def poison(model: torch.nn.Module, kind: str) -> Any:
    """Make `model`'s output spike ("loss-spike") or turn NaN ("nan") until the returned
    handle's `remove()`."""
    factor = math.nan if kind == "nan" else SPIKE_FACTOR

    def hook(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            return output * factor
        return None

    return output_layer(model).register_forward_hook(hook)


def load_dcp(state: dict[str, Any], path: str) -> None:
    """Load a torch.distributed.checkpoint directory into `state` (the top-level keys
    the checkpoint holds; the others keep their values)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(path).read_metadata()
    have = {fqn.split(".", 1)[0] for fqn in meta.state_dict_metadata}
    wanted = {k: v for k, v in state.items() if k in have}
    if not wanted:
        raise ValueError(
            f"the DCP checkpoint {path} holds none of this state's keys {sorted(state)} "
            f"(it has {sorted(have)}); save it from a dict with the same top-level names"
        )
    bundle = hooks.stateful(wanted, loading=True)
    sd = bundle.state_dict()
    dcp.load(sd, checkpoint_id=path, no_dist=not torch.distributed.is_initialized())
    bundle.load_state_dict(sd)
    for k in wanted:
        if not hasattr(wanted[k], "load_state_dict") and not isinstance(wanted[k], dict):
            state[k] = sd[k]
    log.info("adapter.started_from_dcp", path=path, keys=sorted(wanted))
