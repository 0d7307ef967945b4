"""What the Transformers and Lightning adapters save each step encodes what the libraries'
own checkpoints hold: the TrainerState's JSON is `save_to_json`'s (its log history encoded
once per entry), and Lightning's small values load back (also from copies saved before
they were pickled)."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.unit


class _Holder:
    def __init__(self, state: Any) -> None:
        self.state = state


def _expected(state: Any) -> str:
    return json.dumps(dataclasses.asdict(state), sort_keys=True)


def test_trainer_state_json_is_asdicts_through_a_run_and_a_resume() -> None:
    pytest.importorskip("transformers")
    from transformers import TrainerState

    from unbroken.trainer.adapters.transformers import _HFState

    control = {"TrainerControl": {"args": {"should_save": False}, "attributes": {}}}
    trainer = _Holder(TrainerState(global_step=0, stateful_callbacks=control))
    hf = _HFState(trainer)  # type: ignore[arg-type]
    for step in range(1, 40):
        trainer.state.global_step = step
        entry: dict[str, Any] = {"loss": 4.0 / step, "step": step, "learning_rate": 1e-3}
        if step == 7:
            entry["grad_norm"] = float("nan")
        trainer.state.log_history.append(entry)
        assert hf.trainer_state_json() == _expected(trainer.state), step
        if step % 10 == 0:  # a save without a new log entry
            assert hf.trainer_state_json() == _expected(trainer.state), step
    # a resume: another TrainerState (a history of its own, shorter or the same length)
    for n in (3, 39):
        resumed = TrainerState(global_step=n)
        resumed.log_history = [{"loss": 1.0, "step": i} for i in range(n)]
        trainer.state = resumed
        assert hf.trainer_state_json() == _expected(resumed)
    trainer.state = TrainerState()
    assert hf.trainer_state_json() == _expected(trainer.state)


def test_lightning_small_values_load_back_pickled_and_from_older_copies() -> None:
    pytest.importorskip("lightning")
    from unbroken.trainer.adapters.lightning import _Checkpoint

    meta = {
        "epoch": 1,
        "global_step": 9,
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
        "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.25)}},
    }
    ckpt = {
        "state_dict": {"w": torch.ones(2)},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "lr_schedulers": [{"last_epoch": 9}],
        **meta,
    }
    saved = _Checkpoint(ckpt).state_dict()
    older = dict(saved)
    buf = io.BytesIO()
    torch.save(dict(meta), buf)  # how copies saved before held them
    older["meta"] = buf.getvalue()
    for state in (saved, older):
        back = _Checkpoint({})
        back.load_state_dict(state)
        assert back.ckpt["loops"] == meta["loops"] and back.ckpt["global_step"] == 9
        score = back.ckpt["callbacks"]["ModelCheckpoint"]["best_model_score"]
        assert torch.equal(score, torch.tensor(0.25))
        assert back.ckpt["optimizer_states"] == ckpt["optimizer_states"]
        assert torch.equal(back.ckpt["state_dict"]["w"], torch.ones(2))
