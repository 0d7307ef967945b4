"""Loss parity: parallel layouts of the gpt3d engine against one process, fp32, same data.

Each layout runs as real processes (mp.spawn, gloo) through the same `run.train` a worker
uses; the reference is the identical config on one process. CI runs every pipeline schedule
at 2 processes, ZeRO-3 dp and tp(+SP) at 2, and one 8-process pp2×dp2×tp2 1F1B run;
ZeRO-2, replication, HSDP and wider layouts are marked slow.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from unbroken.trainer.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.launch import spawn
from unbroken.trainer.run import train

pytestmark = pytest.mark.integration

STEPS = 4
TOL = 1e-5  # observed ≤ 1e-6 in fp32


def config(**parallel: Any) -> TrainConfig:
    """The tiny model on 256 KiB of stdlib text; only the layout varies."""
    return TrainConfig(
        model=preset("tiny"),
        parallel=ParallelConfig(**parallel),
        optim=OptimConfig(warmup_steps=2, decay_steps=STEPS),
        data=DataConfig(seq_len=32, global_batch=8, max_corpus_bytes=256 << 10),
        steps=STEPS,
    )


def losses(cfg: TrainConfig) -> list[list[float]]:
    """Per-rank curves of (loss, global grad norm) of one spawned run, flattened."""
    hist = spawn(functools.partial(train, cfg), cfg.parallel.world_size, timeout_s=240)
    return [[v for m in h for v in (m["loss"], m["grad_norm"])] for h in hist]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return losses(config())[0]


def _assert_parity(reference: list[float], runs: list[list[float]]) -> None:
    assert len(reference) == 2 * STEPS and reference[-2] < reference[0]
    for rank, curve in enumerate(runs):
        diff = max(abs(a - b) for a, b in zip(reference, curve, strict=True))
        assert diff < TOL, f"rank {rank}: max |Δ(loss, grad norm)| {diff:.3g}: {reference}"


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "ZBV"])
def test_every_schedule_at_pp2(reference: list[float], schedule: str) -> None:
    _assert_parity(reference, losses(config(pp=2, microbatches=2, schedule=schedule)))


@pytest.mark.parametrize(
    "mode",
    [
        "zero3",
        pytest.param("zero2", marks=pytest.mark.slow),
        pytest.param("replicate", marks=pytest.mark.slow),
    ],
)
def test_data_parallel_modes_at_dp2(reference: list[float], mode: str) -> None:
    _assert_parity(reference, losses(config(dp=2, dp_mode=mode)))


def test_tensor_parallel_with_sequence_parallel(reference: list[float]) -> None:
    _assert_parity(reference, losses(config(tp=2)))


@pytest.mark.slow  # 8 processes on CI's 2 cores: 25 s; each axis above, pp2 x tp2 in-job in CI
def test_3d_pp2_dp2_tp2_1f1b_on_8_processes(reference: list[float]) -> None:
    _assert_parity(reference, losses(config(pp=2, dp=2, tp=2, microbatches=2, schedule="1F1B")))


@pytest.mark.slow
def test_hsdp_at_dp4(reference: list[float]) -> None:
    _assert_parity(reference, losses(config(dp=4, dp_mode="hsdp", dp_replicate=2)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"tp": 2, "sequence_parallel": False},
        {"tp": 2, "activation_checkpointing": "full"},
        {"dp": 2, "tp": 2},
        {"pp": 2, "tp": 2, "microbatches": 4, "schedule": "Interleaved1F1B"},
        {"pp": 2, "dp": 2, "microbatches": 2, "schedule": "ZBV"},
        {"dp": 2, "cpu_offload": True},
    ],
)
def test_more_layouts(reference: list[float], layout: dict[str, Any]) -> None:
    _assert_parity(reference, losses(config(**layout)))
