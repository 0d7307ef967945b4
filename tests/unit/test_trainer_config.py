"""Every validation error of the trainer config, the flag mapping and the pure helpers."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from unbroken.trainer.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    preset,
)
from unbroken.trainer.flags import add_arguments, to_argv, to_config

pytestmark = pytest.mark.unit


def _cfg(**kw: object) -> TrainConfig:
    parts: dict[str, object] = {"model": preset("tiny"), "data": DataConfig(seq_len=32)}
    parts.update(kw)
    return TrainConfig(**parts)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ModelConfig(dim=0), "model.dim"),
        (lambda: ModelConfig(n_layers=0), "model.n_layers"),
        (lambda: ModelConfig(ffn_hidden=-1), "model.ffn_hidden"),
        (lambda: ModelConfig(dim=66, n_heads=4), "model.n_heads"),
        (lambda: ModelConfig(dim=12, n_heads=4), "rotary"),
        (lambda: ModelConfig(vocab_size=100), "model.vocab_size"),
        (lambda: ParallelConfig(dp=0), "parallel.dp"),
        (lambda: ParallelConfig(tp=0), "parallel.tp"),
        (lambda: ParallelConfig(microbatches=0), "parallel.microbatches"),
        (lambda: ParallelConfig(schedule="PipeDream"), "parallel.schedule"),
        (lambda: ParallelConfig(dp_mode="zero9"), "parallel.dp_mode"),
        (lambda: ParallelConfig(dp=4, dp_mode="hsdp", dp_replicate=3), "parallel.dp_replicate"),
        (lambda: ParallelConfig(dp=4, dp_mode="hsdp", dp_replicate=4), "parallel.dp_replicate"),
        (lambda: ParallelConfig(dp=4, dp_replicate=2), "parallel.dp_replicate"),
        (lambda: ParallelConfig(pp=4, microbatches=2), "parallel.microbatches"),
        (lambda: OptimConfig(lr=0), "optim.lr"),
        (lambda: OptimConfig(lr=1e-3, min_lr=1e-2), "optim.min_lr"),
        (lambda: OptimConfig(warmup_steps=-1), "optim.warmup_steps"),
        (lambda: OptimConfig(beta2=1.0), "optim.beta1/beta2"),
        (lambda: OptimConfig(max_grad_norm=-1), "optim.max_grad_norm"),
        (lambda: DataConfig(seq_len=1), "data.seq_len"),
        (lambda: DataConfig(global_batch=0), "data.global_batch"),
        (lambda: DataConfig(replica_batch=-1), "data.replica_batch"),
        (
            lambda: _cfg(
                data=DataConfig(seq_len=32, replica_batch=3),
                parallel=ParallelConfig(pp=2, microbatches=2),
            ),
            "data.replica_batch",
        ),
        (lambda: DataConfig(max_corpus_bytes=10), "data.max_corpus_bytes"),
        (lambda: _cfg(steps=-1), "steps"),
        (lambda: _cfg(dtype="fp8"), "dtype"),
        (lambda: _cfg(device="tpu"), "device"),
        (lambda: _cfg(parallel=ParallelConfig(tp=8)), "model.n_heads"),
        (
            lambda: _cfg(model=preset("tiny", ffn_hidden=182), parallel=ParallelConfig(tp=4)),
            "model.ffn_hidden",
        ),
        (
            lambda: _cfg(model=preset("tiny", vocab_size=258), parallel=ParallelConfig(tp=4)),
            "model.vocab_size",
        ),
        (
            lambda: _cfg(data=DataConfig(seq_len=30), parallel=ParallelConfig(tp=4)),
            "data.seq_len",
        ),
        (lambda: _cfg(data=DataConfig(seq_len=128)), "model.max_seq_len"),
        (
            lambda: _cfg(
                data=DataConfig(seq_len=32, global_batch=6), parallel=ParallelConfig(dp=4)
            ),
            "data.global_batch",
        ),
        (
            lambda: _cfg(
                data=DataConfig(seq_len=32, global_batch=6),
                parallel=ParallelConfig(pp=2, microbatches=4),
            ),
            "parallel.microbatches",
        ),
        (
            lambda: _cfg(
                model=preset("tiny", n_layers=3),
                parallel=ParallelConfig(pp=2, microbatches=2, schedule="ZBV"),
            ),
            "model.n_layers",
        ),
        (lambda: preset("huge"), "preset"),
        (lambda: ParallelConfig(cp=0), "parallel.cp"),
        (lambda: ParallelConfig(activation_checkpointing="some"), "parallel.activation_ch"),
        (lambda: ParallelConfig(ac_every=0), "parallel.ac_every"),
        (lambda: ParallelConfig(dp=2, ep=4), "parallel.ep"),
        (lambda: ParallelConfig(dp=4, ep=2, dp_mode="replicate"), "parallel.ep"),
        (lambda: ParallelConfig(dp=2, ep=2, cp=2), "parallel.ep"),
        (lambda: OptimConfig(impl="apex"), "optim.impl"),
        (lambda: ModelConfig(moe_experts=1, moe_top_k=2), "model.moe_experts"),
        (lambda: _cfg(init="lazy"), "init"),
        (lambda: _cfg(data=DataConfig(seq_len=30), parallel=ParallelConfig(cp=2)), "data.seq_len"),
        (
            lambda: _cfg(data=DataConfig(seq_len=40), parallel=ParallelConfig(cp=4, tp=4)),
            "data.seq_len / parallel.cp",
        ),
        (lambda: _cfg(parallel=ParallelConfig(dp=2, ep=2)), "model.moe_experts"),
        (
            lambda: _cfg(
                model=preset("moe-tiny", moe_experts=6), parallel=ParallelConfig(dp=4, ep=4)
            ),
            "model.moe_experts",
        ),
        (lambda: _cfg(model=preset("moe-tiny"), parallel=ParallelConfig(tp=2)), "parallel.tp"),
        (
            lambda: _cfg(
                data=DataConfig(seq_len=32, global_batch=6), parallel=ParallelConfig(microbatches=4)
            ),
            "parallel.microbatches",
        ),
    ],
)
def test_each_invalid_field_is_named(build: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()  # type: ignore[operator]


def test_world_size_mismatch_names_the_layout() -> None:
    cfg = _cfg(parallel=ParallelConfig(dp=2, tp=2))
    cfg.check_world(4)
    with pytest.raises(ValueError, match=r"parallel.tp = 2×1×1×2 = 4 .* \(3\)"):
        cfg.check_world(3)
    assert _cfg(parallel=ParallelConfig(dp=2, cp=2, tp=2)).parallel.world_size == 8
    assert ParallelConfig(dp=4, ep=2).world_size == 4  # ep borrows its ranks from dp


def test_valid_layouts() -> None:
    cfg = _cfg(parallel=ParallelConfig(dp=2, pp=2, tp=2, microbatches=2, schedule="ZBV"))
    assert cfg.parallel.world_size == 8
    assert cfg.parallel.stages_per_rank == 2
    assert ParallelConfig(pp=1, schedule="ZBV").stages_per_rank == 1
    hsdp = ParallelConfig(dp=4, dp_mode="hsdp", dp_replicate=2)
    assert hsdp.world_size == 4


def test_model_counts() -> None:
    m = preset("tiny")
    assert m.hidden == 192 and m.head_dim == 16
    per_layer = 4 * 64 * 64 + 3 * 64 * 192 + 2 * 64
    assert m.n_params() == 4 * per_layer + 2 * 256 * 64 + 64
    assert m.flops_per_token(64) == 6 * (m.n_params() - 256 * 64) + 12 * 4 * 4 * 16 * 64
    assert 0.9e9 < preset("1b").n_params() < 1.3e9
    moe = preset("moe-tiny")
    experts = 3 * 64 * 64
    assert moe.n_params() - moe.n_params(active=True) == 4 * (8 - 2) * experts
    assert moe.flops_per_token(64) == 6 * (moe.n_params(active=True) - 256 * 64) + 12 * 4 * 64 * 64


def test_flags_map_onto_the_config_and_back() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--dp", "2", "--tp", "2", "--steps", "7", "--no-sequence-parallel", "--lr", "0.01"]
    args = parser.parse_args(argv)
    cfg = to_config(args)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.steps) == (2, 2, 7)
    assert cfg.parallel.sequence_parallel is False and cfg.optim.lr == 0.01
    assert cfg.optim.decay_steps == 7
    again = to_config(parser.parse_args(to_argv(args)))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
    with pytest.raises(ValueError, match=r"model\.n_heads"):
        to_config(parser.parse_args(["--tp", "3"]))


def test_new_dimensions_and_engine_options_round_trip_through_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--preset", "moe-tiny", "--dp", "4", "--ep", "2", "--microbatches", "2"]
    argv += ["--activation-checkpointing", "op", "--optimizer-impl", "fused", "--init", "full"]
    args = parser.parse_args(argv)
    cfg = to_config(args)
    assert (cfg.parallel.ep, cfg.parallel.microbatches, cfg.init) == (2, 2, "full")
    assert cfg.parallel.activation_checkpointing == "op" and cfg.optim.impl == "fused"
    again = to_config(parser.parse_args(to_argv(args)))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
    bare = to_config(parser.parse_args(["--activation-checkpointing", "--cp", "2"]))
    assert bare.parallel.activation_checkpointing == "full" and bare.parallel.world_size == 2


def test_driver_layout_counts_cp_in_dp_and_lowers_ep_on_a_shrink(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("UNBROKEN_DP", "4")
    cfg = to_config(parser.parse_args(["--cp", "2", "--dp", "2"]))
    assert (cfg.parallel.dp, cfg.parallel.cp) == (2, 2)
    monkeypatch.setenv("UNBROKEN_DP", "3")
    with pytest.raises(ValueError, match="UNBROKEN_DP=3"):
        to_config(parser.parse_args(["--cp", "2"]))
    monkeypatch.setenv("UNBROKEN_DP", "2")
    cfg = to_config(parser.parse_args(["--preset", "moe-tiny", "--dp", "4", "--ep", "4"]))
    assert (cfg.parallel.dp, cfg.parallel.ep) == (2, 2)
    monkeypatch.setenv("UNBROKEN_DP", "1")
    cfg = to_config(parser.parse_args(["--preset", "moe-tiny", "--dp", "2", "--ep", "2"]))
    assert (cfg.parallel.dp, cfg.parallel.ep) == (1, 1)


def test_microbatches_default_to_pp() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = to_config(parser.parse_args(["--pp", "2"]))
    assert cfg.parallel.microbatches == 2


def test_a_replica_batch_makes_the_step_batch_and_the_rate_follow_the_world() -> None:
    """`--replica-batch`: any dp is allowed (no divisibility of the global batch), the
    step's batch is replica_batch x dp and the rate scales against data.global_batch."""
    for dp, batch, scale in ((4, 8, 1.0), (3, 6, 0.75), (1, 2, 0.25)):
        cfg = _cfg(
            data=DataConfig(seq_len=32, global_batch=8, replica_batch=2),
            parallel=ParallelConfig(dp=dp),
        )
        assert (cfg.step_batch, cfg.lr_scale) == (batch, scale)
    plain = _cfg(data=DataConfig(seq_len=32, global_batch=8), parallel=ParallelConfig(dp=2))
    assert (plain.step_batch, plain.lr_scale) == (8, 1.0)
