"""Hugging Face Transformers: a `TrainerCallback` that makes `Trainer.train` fault tolerant.

    unbroken = UnbrokenCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[unbroken])
    trainer.train(resume_from_checkpoint=unbroken.resume(trainer))

Before every optimizer step (`on_step_begin`) it applies a fault injected for that step
(`unbroken inject loss-spike|nan`). After every optimizer step (`on_step_end`, where the
Trainer's own checkpoints are taken) the callback flash-saves the model, the optimizer, the
scheduler, the `TrainerState` and the random generators' states into the agent's memory;
the logged loss is reported to the agent (`logging_steps=1` reports every step's). `resume`
(collective: every rank, after the Trainer is built) creates the Trainer's optimizer and
scheduler, restores the newest step every rank holds into them and the model, and hands the
Trainer a small resume directory (in /dev/shm when there is one: the weights,
`trainer_state.json`, the generators', the optimizer's and the scheduler's states) so the
Trainer's own resume loads them into the optimizer and scheduler it trains with (it creates
the scheduler again in `train`), skips the batches already trained on and restores the
generators where it does. It returns None when there is nothing to restore: a fresh start.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import random
import shutil
import tempfile
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.utils import WEIGHTS_NAME

from unbroken.trainer import hooks
from unbroken.trainer.adapters.core import Resilient

HF_KEY = "hf"


# stands for the log history in the TrainerState's JSON until its cached text replaces it
_LOG_MARK = "\x00unbroken:log_history\x00"
_LOG_MARK_JSON = json.dumps(_LOG_MARK)


class _HFState:
    """The TrainerState (as its JSON) and the generators (as the Trainer saves them)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None
        self._logs: list[str] = []  # the JSON of each log entry encoded so far
        self._logs_last: Any = None  # the last of those entries
        self._logs_json = "[]"

    def state_dict(self) -> dict[str, Any]:
        gens = pickle.dumps({"python": random.getstate(), "numpy": np.random.get_state()})
        return {
            # what TrainerState.save_to_json writes
            "trainer_state": self.trainer_state_json(),
            "generators": gens,
            "cpu": torch.random.get_rng_state(),
        }

    def trainer_state_json(self) -> str:
        """`json.dumps(dataclasses.asdict(trainer.state), sort_keys=True)`, with the log
        history's entries encoded once each: it gains an entry a logged step, and
        converting it all every save cost more than the rest of the save (2.5 ms of a
        15 ms step 120 steps in, growing with the run). The Trainer only appends to it: an
        entry already encoded is not read again while the history is the same list with
        the same last encoded entry (another list, e.g. after a resume, is encoded anew)."""
        state = self.trainer.state
        doc = {
            f.name: _as_json_value(getattr(state, f.name))
            for f in dataclasses.fields(state)
            if f.name != "log_history"
        }
        doc["log_history"] = _LOG_MARK
        text = json.dumps(doc, sort_keys=True)
        return text.replace(_LOG_MARK_JSON, self._log_history_json(state.log_history), 1)

    def _log_history_json(self, logs: list[Any]) -> str:
        n = len(self._logs)
        if len(logs) < n or (n and logs[n - 1] is not self._logs_last):
            self._logs, n = [], 0  # not the history encoded so far: encode it all
            self._logs_json = "[]"
        if len(logs) > n:
            self._logs.extend(json.dumps(e, sort_keys=True) for e in logs[n:])
            self._logs_last = logs[-1]
            self._logs_json = "[" + ", ".join(self._logs) + "]"
        return self._logs_json

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = dict(state_dict)


def _as_json_value(value: Any) -> Any:
    """A TrainerState field as `dataclasses.asdict` gives it (a nested dataclass as a dict;
    the other values are only read by `json.dumps`, so they need no copy)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


class _Attr:
    """`getattr(trainer, name)` at each save: the Trainer replaces its optimizer (with
    Accelerate's wrapper) and its scheduler (created again for the run's steps) in `train`."""

    def __init__(self, trainer: Trainer, name: str) -> None:
        self.trainer = trainer
        self.name = name

    def state_dict(self) -> dict[str, Any]:
        return dict(getattr(self.trainer, self.name).state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        getattr(self.trainer, self.name).load_state_dict(state_dict)

    def snapshot_target(self) -> Any:
        """What `state_dict` reads now, for the per-step snapshot (trainer/bundlesnap.py):
        the torch optimizer inside Accelerate's wrapper (whose `state_dict` is that
        optimizer's), else the Trainer's object."""
        obj = getattr(self.trainer, self.name)
        inner = getattr(obj, "optimizer", None)
        wrapped = type(obj).__name__ == "AcceleratedOptimizer"
        if wrapped and isinstance(inner, torch.optim.Optimizer):
            return inner
        return obj


def _max_steps(trainer: Trainer) -> int:
    args = trainer.args
    if args.max_steps > 0:
        return int(args.max_steps)
    per_epoch = max(1, len(trainer.get_train_dataloader()) // args.gradient_accumulation_steps)
    return int(per_epoch * args.num_train_epochs + 0.999999)


class UnbrokenCallback(TrainerCallback):
    """The Transformers callback (see the module docstring).

    Args:
        save_every: flash-save every this many optimizer steps.
        persist_every_s: about how often the agent persists a save to storage.
    """

    def __init__(self, *, save_every: int = 1, persist_every_s: float | None = None) -> None:
        self._save_every = save_every
        self._persist_every_s = persist_every_s
        self.core: Resilient | None = None
        self.resume_dir: str | None = None
        self._hf: _HFState | None = None

    def _core(self, trainer: Trainer) -> Resilient:
        if self.core is None:
            if trainer.optimizer is None or trainer.lr_scheduler is None:
                trainer.create_optimizer_and_scheduler(num_training_steps=_max_steps(trainer))
            self._hf = _HFState(trainer)
            state = {
                "model": trainer.model,
                "optimizer": trainer.optimizer,
                "scheduler": trainer.lr_scheduler,
                HF_KEY: self._hf,
            }
            self.core = Resilient(
                state, save_every=self._save_every, rng=False, persist_every_s=self._persist_every_s
            )
            # the Trainer derives its data position from its global step (`global_step %
            # batches per epoch` at a resume), so batches a rollback skips cannot be skipped
            self.core.skips_mid_run = self.core.skips_at_restore = False
        return self.core

    def resume(self, trainer: Trainer) -> str | None:
        """Restore the newest saved step (collective); the directory to pass as
        `resume_from_checkpoint`, or None for a fresh start."""
        core = self._core(trainer)
        try:
            restored = core.restore()
        finally:  # from now on save what the Trainer holds then (see `_Attr`)
            core.state["optimizer"] = _Attr(trainer, "optimizer")
            core.state["scheduler"] = _Attr(trainer, "lr_scheduler")
        if not restored or self._hf is None or self._hf.loaded is None:
            return None
        if core.restored_from == "dcp":
            return None  # weights (and what else the checkpoint held) only: a fresh run
        loaded = self._hf.loaded
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.resume_dir = tempfile.mkdtemp(prefix="unbroken-hf-", dir=root)
        model = trainer.model
        assert model is not None  # the Trainer was built with a model
        torch.save(model.state_dict(), os.path.join(self.resume_dir, WEIGHTS_NAME))
        # the Trainer loads these into the optimizer and the scheduler it uses in `train`
        # (it creates the scheduler again for the run's steps)
        assert trainer.optimizer is not None and trainer.lr_scheduler is not None
        torch.save(trainer.optimizer.state_dict(), os.path.join(self.resume_dir, OPTIMIZER_NAME))
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(self.resume_dir, SCHEDULER_NAME))
        with open(os.path.join(self.resume_dir, TRAINER_STATE_NAME), "w") as f:
            f.write(loaded["trainer_state"])
        gens = pickle.loads(loaded["generators"])
        gens["cpu"] = loaded["cpu"]
        world = trainer.args.world_size
        name = f"rng_state_{trainer.args.process_index}.pth" if world > 1 else "rng_state.pth"
        buf = io.BytesIO()
        torch.save(gens, buf)
        with open(os.path.join(self.resume_dir, name), "wb") as f:
            f.write(buf.getvalue())
        return self.resume_dir

    def on_step_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if self.core is not None and model is not None:  # a fault injected for this step
            self.core.step_begin(state.global_step + 1, model)

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        core = self.core
        if core is None:
            return
        core.fault_end()
        core.progress.step = state.global_step
        core.save(state.global_step)
        core.skip_due(state.global_step + 1)  # says it cannot (see `_core`)
        if args.logging_steps != 1:  # no per-step loss: report the step alone
            hooks.report(state.global_step)
        if hooks.should_stop():
            control.should_training_stop = True

    def on_log(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.core is not None and logs and "loss" in logs and args.logging_steps == 1:
            loss = float(logs["loss"])
            hooks.report(state.global_step, loss)
            # a spike: wait here for the driver's rollback, and leave before the next step
            if hooks.spike_wait(state.global_step, loss) and hooks.should_stop():
                control.should_training_stop = True

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.core is not None:
            self.core.close()
        if self.resume_dir is not None:
            shutil.rmtree(self.resume_dir, ignore_errors=True)
            self.resume_dir = None
