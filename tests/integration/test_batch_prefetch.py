"""On a GPU the gpt3d trainer draws its next batch at the end of a step and starts its copy
then, ahead of a flash save's device-to-host copy. Drawing ahead must change nothing a
checkpoint or a drill sees: the same losses, the data position of the step just taken, a
loss-spike drill that poisons the very next step, a skip, a load.

Each check runs one CPU process (gloo) with drawing ahead forced on (`prefetch_batches`;
off by default on a CPU) and off, and compares.
"""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.trainer.config import DataConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.launch import spawn

pytestmark = pytest.mark.integration


def _run(prefetch: bool, drill: bool = True) -> dict[str, Any]:
    from unbroken.common.faults import LOSS_SPIKE, WorkerFault
    from unbroken.trainer.gpt3d import GPT3DTrainer
    from unbroken.trainer.run import applied_fault

    cfg = TrainConfig(
        model=preset("tiny"),
        parallel=ParallelConfig(),
        data=DataConfig(seq_len=32, global_batch=4, max_corpus_bytes=256 << 10),
        steps=100,
    )
    t = GPT3DTrainer()
    t.setup(cfg)
    t.prefetch_batches = prefetch
    out: dict[str, Any] = {"loss": [], "data": []}
    try:

        def step() -> None:
            out["loss"].append(t.train_step()["loss"])
            out["data"].append(dict(t.state_dict()["data"]))
            out.setdefault("pending", []).append(t._prefetched is not None)

        for _ in range(2):
            step()
        saved = t.state_dict()  # at step 2, with the batch of step 3 drawn already
        if drill:
            with applied_fault(t, WorkerFault(kind=LOSS_SPIKE, step=t.step, id="f")):
                step()  # the poisoned batch: a prefetched one is drawn again through it
        else:
            step()
        step()
        t.skip(2)
        step()
        assert t.snapshot_key() is not None
        out["snapshot_data"] = dict(t.snapshot_fresh_shared()[0]["data"])
        t.load_state_dict(saved)  # back to step 2 (the model's tensors are the live ones)
        step()
    finally:
        t.close()
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    ahead = spawn(_run, 1, True, timeout_s=240)[0]
    plain = spawn(_run, 1, False, timeout_s=240)[0]
    no_drill = spawn(_run, 1, True, False, timeout_s=240)[0]
    return ahead, plain, no_drill


def test_drawing_ahead_changes_no_loss_and_no_saved_position(
    runs: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> None:
    ahead, plain, _ = runs
    assert all(ahead["pending"]) and not any(plain["pending"])  # it did draw ahead
    assert ahead["loss"] == plain["loss"]
    assert ahead["data"] == plain["data"]  # the position of the step taken, not the next
    assert ahead["snapshot_data"] == plain["snapshot_data"]


def test_a_drill_skip_and_load_see_the_batch_they_expect(
    runs: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> None:
    ahead, _, no_drill = runs
    losses = ahead["loss"]
    # the drill poisoned the third step's batch (NUL targets), not the one drawn before it
    assert losses[:2] == no_drill["loss"][:2] and losses[2] != no_drill["loss"][2]
    assert ahead["data"] == no_drill["data"]
    # after the skip the position moved by the skipped batches plus the step
    per_step = ahead["data"][1]["sample_index"] - ahead["data"][0]["sample_index"]
    assert ahead["data"][4]["sample_index"] == ahead["data"][3]["sample_index"] + 3 * per_step
    # after the load, the step drew the batch right after the saved position
    assert ahead["data"][5]["sample_index"] == ahead["data"][1]["sample_index"] + per_step
