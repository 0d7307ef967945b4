"""Meta-device init of the 1b preset: each of 4 ranks holds only its shard, same first loss.

(CI runs the same check on the 125m preset; the 1b case is marked slow: about 4 minutes here.)

Four real processes (gloo, ZeRO-3 over dp4) set up the 1b preset (~1.1e9 parameters, 4.4 GB
fp32 whole) from the meta device. Each rank's peak host memory (`ru_maxrss`, measured in
the rank) may exceed what it had before setup by at most its shard share (params / 4 × 4 B)
plus a fixed margin: no rank ever holds the whole model. Their first-step loss (the forward
of the initial weights on step 1's batch) must equal the one a single process computes
after building the whole model on the host (`init="full"`).
"""

from __future__ import annotations

import functools
import resource
from typing import Any

import pytest
import torch

from unbroken.trainer.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.launch import spawn

pytestmark = pytest.mark.integration

RANKS = 4
PRESET = "1b"
MARGIN = 128 << 20  # corpus, gloo buffers, allocator slack (observed +20..45 MiB over the share)


def config(init: str, dp: int, model: str = PRESET) -> TrainConfig:
    return TrainConfig(
        model=preset(model),
        parallel=ParallelConfig(dp=dp),
        optim=OptimConfig(warmup_steps=1, decay_steps=1),
        data=DataConfig(seq_len=16, global_batch=RANKS, max_corpus_bytes=64 << 10),
        steps=1,
        init=init,
    )


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@torch.no_grad()
def _first_loss(cfg: TrainConfig) -> dict[str, Any]:
    """Set up, measure the peak, then the loss of step 1's batch under the initial weights."""
    import torch.distributed as dist

    from unbroken.trainer.gpt3d import GPT3DTrainer
    from unbroken.trainer.model import cross_entropy

    before = _peak_bytes()
    trainer = GPT3DTrainer()
    try:
        trainer.setup(cfg)
        after_setup = _peak_bytes()
        local = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainer.parameters()
        )
        inputs, targets = trainer.loader.next_batch()
        loss = cross_entropy(trainer.parts[0](inputs), targets).reshape(1)
        if dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return {
            "loss": float(loss),
            "before": before,
            "after_setup": after_setup,
            "local_params": local,
            "init_s": trainer.init_s,
        }
    finally:
        trainer.close()


def _check(model: str) -> None:
    n = preset(model).n_params()
    share = n * 4 // RANKS
    sharded = spawn(
        functools.partial(_first_loss, config("meta", RANKS, model)), RANKS, timeout_s=600
    )
    for rank, r in enumerate(sharded):
        grew = r["after_setup"] - r["before"]
        print(
            f"rank {rank}: peak +{grew / 2**20:.0f} MiB at setup (shard share "
            f"{share / 2**20:.0f} MiB, whole model {n * 4 / 2**20:.0f} MiB), "
            f"init {r['init_s']:.1f} s"
        )
        assert abs(r["local_params"] - n / RANKS) < n / RANKS * 0.01
        assert grew < share + MARGIN < n * 4, f"rank {rank} grew {grew / 2**20:.0f} MiB"
    whole = spawn(functools.partial(_first_loss, config("full", 1, model)), 1, timeout_s=600)[0]
    print(f"first-step loss: meta dp{RANKS} {sharded[0]['loss']:.7f}, full {whole['loss']:.7f}")
    # ru_maxrss is a high-water mark: the reference's peak holds the whole model at least
    assert whole["after_setup"] > n * 4
    for r in sharded:
        assert abs(r["loss"] - whole["loss"]) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_1b_meta_init_holds_only_the_shard_and_gives_the_same_first_loss() -> None:
    """~4 min on the shared 2 cores (observed: +1002 MiB per rank for a 962 MiB share,
    first-step loss 5.7958369 vs 5.7958374 from the whole model)."""
    _check("1b")


def test_125m_meta_init_holds_only_the_shard_and_gives_the_same_first_loss() -> None:
    """The same check at CI size."""
    _check("125m")
