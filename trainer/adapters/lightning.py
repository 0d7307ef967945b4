"""PyTorch Lightning: a `Callback` that makes `Trainer.fit` fault tolerant.

    ub = Unbroken()
    trainer = L.Trainer(..., callbacks=[ub])
    trainer.fit(model, ResumableDataLoader(dataset, batch_size=8, shuffle=True, unbroken=ub))

Before every training batch it applies a fault injected for that step (`unbroken inject
loss-spike|nan`). After every training batch the callback flash-saves what a Lightning
checkpoint holds (`dump_checkpoint`: the module's weights, the optimizers and schedulers, the loops'
progress, the callbacks' state) into the agent's memory, and reports the step and its loss
(the module's `training_step` output, or its logged `loss`). At `setup`, when the
process group exists and before Lightning would load a `ckpt_path`, it restores the newest
step every rank holds and hands it to Lightning as the checkpoint to resume from, so
Lightning itself restores the optimizers, schedulers and loops. The optimizers of the
restore's template come from the module's own `configure_optimizers`.

`ResumableDataLoader` (a `DataLoader`; Lightning still injects its distributed sampler and
sets its epoch) skips the batches of the restored epoch already trained on, so a restore
mid-epoch sees the batches the uninterrupted run saw. The weights are saved under the
module's own names (`model` in the persisted DCP checkpoint).
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from unbroken.trainer.adapters.core import Resilient

LIGHTNING_KEY = "lightning"


class _Checkpoint:
    """A Lightning checkpoint dict as a DCP `Stateful`: tensors stay tensors (the module's
    weights, optimizer and scheduler state), the rest (loops, callbacks) is one pickle."""

    def __init__(self, ckpt: dict[str, Any]) -> None:
        self.ckpt = ckpt

    def state_dict(self) -> dict[str, Any]:
        c = dict(self.ckpt)
        out: dict[str, Any] = {
            "model": c.pop("state_dict"),
            "optimizers": {str(i): s for i, s in enumerate(c.pop("optimizer_states", []))},
            "schedulers": {str(i): s for i, s in enumerate(c.pop("lr_schedulers", []))},
        }
        # loops, callbacks, epoch, hyper-parameters: small values, pickled (3 us where
        # torch.save took 140 us a save)
        out["meta"] = pickle.dumps(c, protocol=pickle.HIGHEST_PROTOCOL)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict["meta"]
        c = _load_meta(meta) if meta else {}
        c["state_dict"] = state_dict["model"]
        opts = state_dict["optimizers"]
        scheds = state_dict["schedulers"]
        c["optimizer_states"] = [opts[str(i)] for i in range(len(opts))]
        c["lr_schedulers"] = [scheds[str(i)] for i in range(len(scheds))]
        self.ckpt = c


def _load_meta(meta: bytes) -> dict[str, Any]:
    """The checkpoint's small values: a pickle, or torch.save's zip (copies saved before)."""
    if meta[:2] == b"PK":
        return dict(torch.load(io.BytesIO(meta), weights_only=False))
    return dict(pickle.loads(meta))


class _Live:
    """What the callback saves each step: the trainer's checkpoint dict, dumped at save."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        ckpt = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        return _Checkpoint(ckpt).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("restored through Unbroken.setup, not into the live trainer")


def _optimizers(module: pl.LightningModule) -> tuple[list[Any], list[Any]]:
    """Fresh optimizers and schedulers from the module's `configure_optimizers` (the
    restore's template: the same structure the trainer's own have)."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    opts, configs = _init_optimizers_and_lr_schedulers(module)
    return list(opts), [c.scheduler for c in configs]


class Unbroken(pl.Callback):
    """The Lightning callback (see the module docstring).

    Args:
        save_every: flash-save every this many training batches.
        init_from: a DCP checkpoint to start from when nothing is saved yet (its `model`).
        persist_every_s: about how often the agent persists a save to storage.
    """

    def __init__(
        self,
        *,
        save_every: int = 1,
        init_from: str | os.PathLike[str] | None = None,
        persist_every_s: float | None = None,
    ) -> None:
        self._save_every = save_every
        self._init_from = init_from
        self._persist_every_s = persist_every_s
        self.core: Resilient | None = None
        self._rng_later: torch.Tensor | None = None
        self.skip_pending = 0  # batches of the restored epoch the loader skips
        self.feed_step = 1  # the step the loader's next batch is for
        self.restored_step = 0
        self.skip_done = False  # a rollback's skip is applied once, in one epoch

    def state_dict(self) -> dict[str, Any]:
        return {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        live = _Live(trainer)
        core = Resilient(
            {LIGHTNING_KEY: live},
            save_every=self._save_every,
            rng=False,
            persist_every_s=self._persist_every_s,
        )
        self.core = core
        opts, scheds = _optimizers(pl_module)
        template = _Checkpoint(
            {
                "state_dict": pl_module.state_dict(),
                "optimizer_states": [o.state_dict() for o in opts],
                "lr_schedulers": [s.state_dict() for s in scheds],
            }
        )
        restoring = _Restoring(template, opts)
        core.state[LIGHTNING_KEY] = restoring
        core.state["rng"] = _RngHolder()
        if self._init_from is not None:
            core.init_from = os.fspath(self._init_from)
        step = core.restore()
        self.feed_step, self.restored_step = step + 1, step
        core.state[LIGHTNING_KEY] = live
        rng = core.state["rng"].cpu
        core.state["rng"] = _RngNow()
        ckpt = restoring.template.ckpt
        if core.restored_from == "dcp":  # weights only: Lightning starts its loops afresh
            pl_module.load_state_dict(ckpt["state_dict"])
            return
        if not step:
            return
        trainer._checkpoint_connector._loaded_checkpoint = ckpt
        self.skip_pending = core.position
        self._rng_later = rng  # set by the loader (`take_skip`) or at the first batch

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if self._rng_later is not None:
            torch.set_rng_state(self._rng_later)
            self._rng_later = None
        if self.core is not None:  # a fault injected for this step (`unbroken inject`)
            self.core.step_begin(trainer.global_step + 1, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        if self.core is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            loss = trainer.callback_metrics.get("loss")
        if self.core.step_end(trainer.global_step, loss):
            trainer.should_stop = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.core is not None:
            self.core.close()

    def feed(self, it: Any) -> Any:
        """The loader's batches, counted by the step each is for; a rollback's skip that
        falls due after the restore is done here, when the batch for the skip's first step
        is fetched (the fit loop fetches a batch ahead, before the step before it ends).
        At most the rest of the epoch is skipped, once: the next epoch's first batch is for
        the same step (which a skip that ended the epoch never reached)."""
        p = self.core.point if self.core is not None else None
        for batch in it:
            due = p is not None and p.skip_batches and self.feed_step == p.skip_from_step
            # not done at the restore, nor already (else every later epoch ended at once)
            if due and self.feed_step > self.restored_step + 1 and not self.skip_done:
                self.skip_done = True
                batch = _nth(it, p.skip_batches - 1, batch)  # type: ignore[union-attr]
                if batch is _NONE:
                    return
            self.feed_step += 1
            yield batch

    def take_skip(self, batches_per_epoch: int) -> int:
        """Batches the loader skips at its next epoch start (once, after a restore).

        The loader asks before it starts its iterator, which draws a seed from the global
        generator: at an epoch's end the generator is restored now (the next epoch's loader
        then draws what the uninterrupted run's drew), mid-epoch at the first batch (after
        the draw the uninterrupted run did not make)."""
        n, self.skip_pending = self.skip_pending, 0
        skip = n % batches_per_epoch if batches_per_epoch else 0
        if skip == 0 and self._rng_later is not None:
            torch.set_rng_state(self._rng_later)
            self._rng_later = None
        return skip


class _Restoring:
    """The restore's target: the template checkpoint (optimizers primed first)."""

    def __init__(self, template: _Checkpoint, opts: list[Any]) -> None:
        self.template = template
        self.opts = opts

    def state_dict(self) -> dict[str, Any]:
        from unbroken.trainer import hooks

        for o in self.opts:
            hooks.prime(o)
        self.template.ckpt["optimizer_states"] = [o.state_dict() for o in self.opts]
        return self.template.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.template.load_state_dict(state_dict)


class _RngHolder:
    """The saved generator state, kept aside at restore (set when it is due)."""

    def __init__(self) -> None:
        self.cpu: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cpu = state_dict["cpu"]


class _RngNow:
    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])


class ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """A `DataLoader` that, after a restore, starts the restored epoch past the batches
    already trained on. Takes `DataLoader`'s arguments plus `unbroken` (the callback)."""

    def __init__(self, *args: Any, unbroken: Unbroken | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unbroken = unbroken

    def __iter__(self) -> Any:
        if self.unbroken is None:
            return super().__iter__()
        skip = self.unbroken.take_skip(len(self))
        it = super().__iter__()
        return self.unbroken.feed(_skipping(it, skip) if skip else it)


_NONE = object()


def _nth(it: Any, n: int, current: Any) -> Any:
    """The batch after skipping `current` and `n` more (`_NONE` when the epoch ends)."""
    for _ in range(n + 1):
        current = next(it, _NONE)
        if current is _NONE:
            break
    return current


def _skipping(it: Any, n: int) -> Any:
    """`it` past its first `n` items, skipped at the first `next` (the sampler's epoch is
    set between the loader's `iter` and its first batch)."""
    for _ in range(n):
        next(it)
    yield from it
