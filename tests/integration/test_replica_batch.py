"""`--replica-batch` (docs/in-job-recovery.md, the replica policy): each dp replica trains a
fixed batch, so the global batch follows the world, and the learning rate scales with it
(linear rule against `--global-batch`). Unset, the global batch is kept at any dp.

Checked on the real engine (gloo, CPU): a dp1 world with `replica_batch 2` of a job tuned
for `global_batch 4` trains exactly what a dp1 job with `global_batch 2` and half the
learning rate trains (the schedule scales by an exact factor of two), and in the full dp2
world the flag changes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from unbroken.trainer.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.launch import spawn

pytestmark = pytest.mark.integration

STEPS = 14  # past the 10 warmup steps into the cosine decay


def _config(dp: int, global_batch: int, replica_batch: int, lr_factor: float = 1.0) -> TrainConfig:
    o = OptimConfig()
    return TrainConfig(
        model=preset("tiny"),
        parallel=ParallelConfig(dp=dp),
        data=DataConfig(
            seq_len=32,
            global_batch=global_batch,
            replica_batch=replica_batch,
            max_corpus_bytes=256 << 10,
        ),
        optim=dataclasses.replace(o, lr=o.lr * lr_factor, min_lr=o.min_lr * lr_factor),
        steps=100,
    )


def _train(cfg: TrainConfig) -> dict[str, Any]:
    from unbroken.trainer.gpt3d import GPT3DTrainer

    t = GPT3DTrainer()
    t.setup(cfg)
    out: dict[str, Any] = {"loss": [], "lr": [], "position": []}
    try:
        for _ in range(STEPS):
            m = t.train_step()
            out["loss"].append(m["loss"])
            out["lr"].append(m["lr"])
            out["position"].append(t.state_dict()["data"]["sample_index"])
    finally:
        t.close()
    return out


def test_a_shrunk_world_trains_its_replicas_batches_at_a_scaled_rate() -> None:
    shrunk = spawn(_train, 1, _config(1, 4, 2), timeout_s=240)[0]
    same = spawn(_train, 1, _config(1, 2, 0, lr_factor=0.5), timeout_s=240)[0]
    assert shrunk["position"] == [2 * (i + 1) for i in range(STEPS)]  # 2 sequences a step
    assert shrunk["lr"] == same["lr"] and shrunk["lr"][-1] > 0
    assert shrunk["loss"] == same["loss"]  # bitwise: the same batches at the same rates


def test_the_full_world_trains_as_without_the_flag() -> None:
    flagged = spawn(_train, 2, _config(2, 4, 2), timeout_s=240)
    plain = spawn(_train, 2, _config(2, 4, 0), timeout_s=240)
    assert flagged[0] == plain[0] and flagged[1] == plain[1]
    assert flagged[0]["position"][-1] == 4 * STEPS
