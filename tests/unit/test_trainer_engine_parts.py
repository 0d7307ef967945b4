"""The engine's pure pieces: shard-local init, context-parallel chunks, MoE routing, recompute."""

from __future__ import annotations

import pytest
import torch

from unbroken.trainer import context, init
from unbroken.trainer.config import preset
from unbroken.trainer.model import Transformer, cross_entropy, moe_layers
from unbroken.trainer.moe import MoE

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shape", [(300, 64), (5, 7), (8, 70000), (4, 33, 17), (64,)])
def test_any_row_range_draws_the_rows_of_the_whole_tensor(shape: tuple[int, ...]) -> None:
    whole = init.values("layers.0.attention.wq.weight", shape, 3, 4)
    for a, b in [(0, shape[0]), (1, 3), (shape[0] - 1, shape[0]), (2, 2)]:
        part = init.values("layers.0.attention.wq.weight", shape, 3, 4, rows=(a, b))
        assert torch.equal(part, whole[a:b])
    other = init.values("layers.1.attention.wq.weight", shape, 3, 4)
    assert len(shape) == 1 or not torch.equal(other, whole)


def test_meta_model_materialises_to_the_same_weights_and_residuals_are_scaled() -> None:
    cfg = preset("tiny")
    with torch.device("meta"):
        lazy = Transformer(cfg, seed=5)
    init.materialize(lazy, torch.device("cpu"))
    eager = Transformer(cfg, seed=5)
    for (name, a), b in zip(lazy.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(lazy.rope, eager.rope)
    wq, wo = eager.layers["0"].attention.wq.weight, eager.layers["0"].attention.wo.weight
    assert wo.std() < wq.std() / 2  # 0.02 / sqrt(2 L)


def test_a_deferred_init_fills_only_the_buffers_until_the_weights_are_asked_for() -> None:
    cfg = preset("tiny")
    with torch.device("meta"):
        lazy = Transformer(cfg, seed=5)
    init.materialize(lazy, torch.device("cpu"), values=False)
    eager = Transformer(cfg, seed=5)
    assert torch.equal(lazy.rope, eager.rope)  # the non-persistent buffer is built at once
    with torch.no_grad():
        for p in lazy.parameters():
            p.fill_(7.0)  # what a restore would have written
    assert all(bool((p == 7.0).all()) for p in lazy.parameters())
    lazy.reset_parameters()  # nothing was restored: the initial weights after all
    for (name, a), b in zip(lazy.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_context_chunks_balance_the_causal_mask_and_cover_the_sequence() -> None:
    cp, seq = 4, 32
    pos = [context.positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(pos).tolist()) == list(range(seq))
    visible = [int((p + 1).sum()) for p in pos]  # keys each rank's queries may attend to
    assert max(visible) == min(visible)
    x = torch.arange(seq).view(1, seq)
    assert torch.equal(context.split(x, cp, 1)[0], pos[1])


def test_moe_routes_to_top_k_and_its_balance_loss_reaches_the_router() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("moe-tiny"), seed=1)
    moe = moe_layers(model)[0]
    assert isinstance(moe, MoE) and moe.w1.shape == (8, 64, 64)
    x = torch.randint(0, 256, (2, 16))
    loss = cross_entropy(model(x), x)
    aux = moe.last_aux
    assert aux is not None and aux >= 1.0 - 1e-6  # E·Σ f·P ≥ 1, equal when balanced
    loss.backward()
    g_with = moe.router.weight.grad.clone()  # type: ignore[union-attr]
    model.zero_grad()
    for m in moe_layers(model):
        m.aux_weight = 0.0
    cross_entropy(model(x), x).backward()
    assert not torch.allclose(g_with, moe.router.weight.grad)  # type: ignore[arg-type]


def test_moe_layer_equals_a_dense_loop_over_tokens() -> None:
    torch.manual_seed(0)
    moe = MoE(preset("moe-tiny"))
    for w in (moe.w1, moe.w2, moe.w3, moe.router.weight):
        torch.nn.init.normal_(w, std=0.1)
    x = torch.randn(2, 5, 64)
    out = moe(x)
    probs = torch.softmax(moe.router(x.reshape(-1, 64)), -1)
    w, idx = probs.topk(2)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros(10, 64)
    for t in range(10):
        for j in range(2):
            e = int(idx[t, j])
            h = torch.nn.functional.silu(moe.w1[e] @ x.reshape(-1, 64)[t]) * (
                moe.w3[e] @ x.reshape(-1, 64)[t]
            )
            ref[t] += w[t, j] * (moe.w2[e] @ h)
    assert torch.allclose(out.reshape(-1, 64), ref, atol=1e-5)


@pytest.mark.parametrize(("mode", "every"), [("full", 2), ("op", 1)])
def test_selective_recompute_gives_the_same_gradients(mode: str, every: int) -> None:
    model = Transformer(preset("tiny"), seed=2)
    x = torch.randint(0, 256, (2, 16))
    cross_entropy(model(x), x).backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    model.set_activation_checkpointing(mode, every)
    on = [b.checkpointing for b in model.layers.values()]  # type: ignore[union-attr]
    assert on == ([mode, "none", mode, "none"] if every == 2 else [mode] * 4)
    cross_entropy(model(x), x).backward()
    for p, g in zip(model.parameters(), want, strict=True):
        assert torch.allclose(p.grad, g, atol=1e-6)  # type: ignore[arg-type]
