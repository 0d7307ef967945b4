"""Hugging Face Accelerate: the loop users write with an `Accelerator`, made fault tolerant.

    ub = Unbroken(accelerator, model=model, optimizer=optimizer, scheduler=scheduler)
    ub.restore()
    for step, batch in ub.batches(train_dataloader, max_steps):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        if ub.step_end(step, loss):
            break

`batches` applies a fault injected for the step it yields (`unbroken inject loss-spike|nan`)
and resumes the prepared data loader at the restored position (its epoch through
`set_epoch`, the batches already seen skipped with `accelerator.skip_first_batches`), so
the batches after a restore are the ones the uninterrupted run saw, given a shuffle that
depends on the epoch alone: `Accelerator(dataloader_config=DataLoaderConfiguration(
use_seedable_sampler=True))` (the default sampler draws each epoch's order from the global
generator at the epoch's start, which a restore mid-epoch cannot replay). The state saved is the
unwrapped model (so the persisted DCP checkpoint has the model's own names), the optimizer
and scheduler under the wrappers Accelerate puts around them, and whatever `extra` holds.

In-job recovery (a peer's death does not end this process): put everything from the
`Accelerator` on in a function and run it with `recovery_loop(train)`. When the agent sends
the new world, Accelerate's process-wide state (its `PartialState` singletons, which hold the
old world's ranks) is reset and `train` runs again in the same process, restoring the agreed
step from the agent's memory.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from unbroken.trainer import hooks
from unbroken.trainer.adapters.core import Resilient

T = TypeVar("T")


def recovery_loop(body: Callable[[], T], *, hold_s: float = hooks.HOLD_WAIT_S) -> T:
    """`hooks.recovery_loop` for an Accelerate loop: `body` builds the `Accelerator` (which
    joins the world the environment names), the model, optimizer and `Unbroken`, restores
    and trains. Before each run after the first (a new world), Accelerate's shared state is
    forgotten, so the next `Accelerator()` joins the new world instead of reusing the old
    world's ranks and process group."""
    runs = 0

    def run() -> T:
        nonlocal runs
        if runs:
            reset_state()
        runs += 1
        return body()

    return hooks.recovery_loop(run, hold_s=hold_s)


def reset_state() -> None:
    """Forget Accelerate's process-wide state (the accelerator's, the process's and the
    gradient accumulation's singletons): the next `Accelerator()` starts afresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _inner(obj: Any, attr: str) -> Any:
    """The object an Accelerate wrapper holds (AcceleratedOptimizer.optimizer, ...)."""
    return getattr(obj, attr, obj)


class Unbroken(Resilient):
    """Fault tolerance for an Accelerate training loop.

    Args:
        accelerator: the job's `accelerate.Accelerator`.
        model: the prepared model (unwrapped here for saving).
        optimizer: the prepared optimizer.
        scheduler: the prepared learning-rate scheduler, if any.
        extra: more name -> state to save (see `Resilient`).
        save_every: flash-save every this many steps.
        init_from: a DCP checkpoint to start from when nothing is saved yet.
        persist_every_s: about how often the agent persists a save to storage.
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        model: Any,
        optimizer: Any,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        save_every: int = 1,
        init_from: str | os.PathLike[str] | None = None,
        persist_every_s: float | None = None,
    ) -> None:
        self.accelerator = accelerator
        state: dict[str, Any] = {
            "model": accelerator.unwrap_model(model),
            "optimizer": _inner(optimizer, "optimizer"),
        }
        if scheduler is not None:
            state["scheduler"] = _inner(scheduler, "scheduler")
        state.update(extra or {})
        super().__init__(
            state, save_every=save_every, init_from=init_from, persist_every_s=persist_every_s
        )

    def batches(self, dataloader: Any, max_steps: int) -> Iterator[tuple[int, Any]]:
        """(step, batch) for the steps after the restored one up to `max_steps`, over as
        many epochs as it takes, starting at the restored data position."""
        n = len(dataloader)
        if n == 0:
            raise ValueError("the data loader is empty: nothing to train on")
        while self.step < max_steps:
            epoch, offset = divmod(self.position, n)
            if hasattr(dataloader, "set_epoch"):
                dataloader.set_epoch(epoch)
            loader = (
                self.accelerator.skip_first_batches(dataloader, offset) if offset else dataloader
            )
            rng = torch.get_rng_state() if offset else None
            it = iter(loader)  # draws a worker seed from the global generator
            if rng is not None:  # mid-epoch: the uninterrupted run drew it at the epoch's start
                first = next(it, _END)
                torch.set_rng_state(rng)
                it = itertools.chain(() if first is _END else (first,), it)
            at = self.position
            for batch in it:
                if self.position != at:  # a skip took effect mid-epoch: seek again
                    break
                self.step_begin(self.step + 1, self.state["model"])
                yield self.step + 1, batch
                if self.step >= max_steps:
                    return
                at += 1


_END = object()
