"""DCP save under one mesh, load under another, and training continues on the same curve.

The uninterrupted single-process run is the reference; a run that stops after 3 steps,
saves through torch.distributed.checkpoint and is resumed by *different* processes under a
different layout must reproduce steps 4..6 (same data order, same optimizer state) to 1e-6.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from unbroken.trainer import checkpoint
from unbroken.trainer.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.gpt3d import GPT3DTrainer
from unbroken.trainer.launch import spawn
from unbroken.trainer.run import train

pytestmark = pytest.mark.integration

TOTAL, SPLIT = 6, 3


def config(steps: int, **parallel: Any) -> TrainConfig:
    return TrainConfig(
        model=preset("tiny"),
        parallel=ParallelConfig(**parallel),
        optim=OptimConfig(warmup_steps=2, decay_steps=TOTAL),
        data=DataConfig(seq_len=32, global_batch=8, max_corpus_bytes=256 << 10),
        steps=steps,
    )


def run(cfg: TrainConfig, **kw: Any) -> list[float]:
    hist = spawn(functools.partial(train, cfg, **kw), cfg.parallel.world_size, timeout_s=240)
    return [m["loss"] for m in hist[0]]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return run(config(TOTAL))


def _resharded(tmp: Path, before: dict[str, Any], after: dict[str, Any]) -> list[float]:
    ckpt = str(tmp / "ckpt")
    first = run(config(SPLIT, **before), save_to=ckpt)
    second = run(config(TOTAL, **after), resume_from=ckpt)
    assert len(first) == SPLIT and len(second) == TOTAL - SPLIT
    return first + second


def _close(reference: list[float], curve: list[float]) -> None:
    diff = max(abs(a - b) for a, b in zip(reference, curve, strict=True))
    assert diff < 1e-6, f"max |Δloss| {diff:.3g}: {reference} vs {curve}"


def test_dp2_checkpoint_resumes_on_dp1(reference: list[float], tmp_path: Path) -> None:
    _close(reference, _resharded(tmp_path, {"dp": 2}, {}))


@pytest.mark.slow
def test_dp1_checkpoint_resumes_on_dp2(reference: list[float], tmp_path: Path) -> None:
    _close(reference, _resharded(tmp_path, {}, {"dp": 2, "dp_mode": "zero2"}))


@pytest.mark.slow
def test_pp2_tp2_checkpoint_resumes_on_dp2(reference: list[float], tmp_path: Path) -> None:
    _close(reference, _resharded(tmp_path, {"pp": 2, "tp": 2, "microbatches": 2}, {"dp": 2}))


@pytest.mark.slow
def test_dp1_checkpoint_resumes_on_zbv_pp2(reference: list[float], tmp_path: Path) -> None:
    after = {"pp": 2, "microbatches": 2, "schedule": "ZBV"}
    _close(reference, _resharded(tmp_path, {}, after))


def test_resume_from_a_folder_without_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no DCP checkpoint"):
        checkpoint.load(GPT3DTrainer(), tmp_path)
