"""The model and the pipeline split: stages keep global names and compose to the whole."""

from __future__ import annotations

import pytest
import torch

from unbroken.trainer.config import OptimConfig, ParallelConfig, preset
from unbroken.trainer.gpt3d import lr_at
from unbroken.trainer.model import Transformer, apply_rope, rope_table
from unbroken.trainer.parallel import cut_stage, layer_split, reshards_after_forward, stage_ids

pytestmark = pytest.mark.unit


def test_layer_split_and_stage_placement() -> None:
    assert layer_split(5, 2) == [range(0, 3), range(3, 5)]
    assert layer_split(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_ids(ParallelConfig(pp=2, microbatches=2, schedule="1F1B"), 1) == [1]
    loop = ParallelConfig(pp=2, microbatches=2, schedule="Interleaved1F1B")
    assert [stage_ids(loop, r) for r in range(2)] == [[0, 2], [1, 3]]
    vee = ParallelConfig(pp=2, microbatches=2, schedule="ZBV")
    assert [stage_ids(vee, r) for r in range(2)] == [[0, 3], [1, 2]]


def test_stages_keep_names_and_compose_to_the_full_model() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    x = torch.randint(0, 256, (2, 16))
    stages = [cut_stage(model, s, 3) for s in range(3)]
    names = [set(dict(s.named_parameters())) for s in stages]
    assert set().union(*names) == set(dict(model.named_parameters()))
    assert not (names[0] & names[1]) and "layers.3.attention.wq.weight" in names[2]
    h = x
    for s in stages:
        h = s(h)
    assert torch.allclose(h, model(x), atol=1e-6)
    model.set_activation_checkpointing(True)
    assert torch.allclose(model(x), h, atol=1e-6)


def test_rope_is_a_rotation_and_attention_is_causal() -> None:
    table = rope_table(16, 32, 10000.0)
    q = torch.randn(1, 32, 2, 16)
    assert torch.allclose(apply_rope(q, table).norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 256
    assert torch.allclose(model(x)[:, :10], model(y)[:, :10], atol=1e-6)


def test_lr_warmup_then_cosine() -> None:
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=10)
    assert [lr_at(s, o) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, o) == pytest.approx(0.55)
    assert lr_at(14, o) == pytest.approx(0.1) and lr_at(100, o) == pytest.approx(0.1)


def test_zbv_keeps_parameters_unsharded_between_forward_and_backward() -> None:
    assert reshards_after_forward(ParallelConfig(dp=2, dp_mode="zero3"))
    assert not reshards_after_forward(ParallelConfig(dp=2, dp_mode="zero2"))
    zbv = ParallelConfig(dp=2, pp=2, microbatches=2, schedule="ZBV")
    assert not reshards_after_forward(zbv)
    assert reshards_after_forward(ParallelConfig(dp=2, pp=2, microbatches=2, schedule="1F1B"))
