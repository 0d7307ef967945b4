"""`--flash-ab N`: a job measures what its flash saves cost, in one run.

A real trainer process (`trainer.launch.spawn`, gloo, the tiny gpt3d model) under a flash
store on /dev/shm, as under an agent: with `flash_ab=2` the memory saves happen in
alternate 2-step blocks, each metrics row says which block it is in, and the persisted
saves (the job's first, its last) happen whatever the block.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.recovery.flashcopy import list_copies
from unbroken.trainer.config import DataConfig, OptimConfig, TrainConfig, preset
from unbroken.trainer.launch import spawn
from unbroken.trainer.run import train

pytestmark = pytest.mark.integration


def _train(cfg: TrainConfig) -> list[dict[str, object]]:
    return train(cfg)


def test_flash_ab_saves_in_alternate_blocks_and_says_which(shm: str, tmp_path: Path) -> None:
    from unbroken.recovery.flashowner import FlashConfig, FlashOwner

    FlashOwner(FlashConfig(root=shm, job="job"))  # the agent creates the job's folder
    env = {
        "UNBROKEN_FLASH_ROOT": shm,
        "UNBROKEN_FLASH_JOB": "job",
        "UNBROKEN_FLASH_NODE": "n0",
        "UNBROKEN_PERSIST_URL": str(tmp_path / "storage"),
        "OMP_NUM_THREADS": "1",
    }
    cfg = TrainConfig(
        model=preset("tiny"),
        optim=OptimConfig(warmup_steps=2, decay_steps=8),
        data=DataConfig(seq_len=32, global_batch=4, max_corpus_bytes=256 << 10),
        steps=8,
        flash_ab=2,
    )
    (history,) = spawn(_train, 1, cfg, timeout_s=180, env=env)
    blocks = {int(m["step"]): m["flash_block"] for m in history}  # type: ignore[call-overload]
    assert blocks == {1: True, 2: False, 3: False, 4: True, 5: True, 6: False, 7: False, 8: True}
    saved = {int(m["step"]) for m in history if m.get("flash_save_s") is not None}  # type: ignore[call-overload]
    assert saved == {1, 4, 5, 8}  # on-blocks; 1 and 8 are persisted (the first, the last)
    (rank_dir,) = Path(shm, "job", "local").glob("rank-*")
    assert {r.manifest.step for r in list_copies(rank_dir)} == {1, 4, 5, 8}


def test_flash_ab_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="--flash-ab"):
        TrainConfig(model=preset("tiny"), flash_ab=-1)
