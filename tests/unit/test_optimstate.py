"""trainer/optimstate.py: the Adam state made without a step is the one torch's path makes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from unbroken.trainer.optimstate import create_adam_state

pytestmark = pytest.mark.unit

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # as the embedded engine saves


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    m[2].bias.requires_grad_(False)  # a frozen parameter gets no state either way
    return m


def _layout(sd: dict) -> dict:
    return {
        k: (type(v).__name__, v.dtype, tuple(v.shape), v.device.type)
        if isinstance(v, torch.Tensor)
        else v
        for k, v in sd.items()
    }


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 8, generator=g)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
    ],
    ids=["adamw-foreach", "adamw-amsgrad", "adamw-fused", "adam"],
)
def test_the_state_has_torchs_layout_and_a_restore_through_it_is_bitwise(make) -> None:
    ours_m, torchs_m = _model(), _model()
    ours, torchs = make(ours_m.parameters()), make(torchs_m.parameters())
    assert create_adam_state(ours)
    before = copy.deepcopy(ours_m.state_dict())
    ours_sd = get_optimizer_state_dict(ours_m, ours, options=FLAT)
    torchs_sd = get_optimizer_state_dict(torchs_m, torchs, options=FLAT)  # torch's zero step
    assert _layout(ours_sd) == _layout(torchs_sd)
    assert all(torch.equal(v, before[k]) for k, v in ours_m.state_dict().items())
    # a state saved before any step holds step 0 (torch's zero step leaves 1)
    assert all(float(v) == 0.0 for k, v in ours_sd.items() if k.endswith(".step"))

    # a trained state restored into a fresh optimizer whose state was made here trains on
    # exactly as the original does
    src_m = _model()
    src = make(src_m.parameters())
    _train(src_m, src, 3)
    saved = copy.deepcopy((src_m.state_dict(), get_optimizer_state_dict(src_m, src)))
    want = _train(src_m, src, 3)
    dst_m = _model()
    dst = make(dst_m.parameters())
    assert create_adam_state(dst)
    dst_m.load_state_dict(saved[0])
    set_optimizer_state_dict(dst_m, dst, saved[1])
    assert _train(dst_m, dst, 3) == want


def test_other_optimizers_and_stepped_ones_are_left_to_torch() -> None:
    m = _model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    assert not create_adam_state(sgd) and not sgd.state

    class MyAdam(torch.optim.AdamW):
        pass

    assert not create_adam_state(MyAdam(m.parameters()))
    adam = torch.optim.AdamW(m.parameters())
    _train(m, adam, 1)
    state = copy.deepcopy(adam.state_dict())
    assert not create_adam_state(adam)
    assert str(adam.state_dict()) == str(state)
    fresh = torch.optim.AdamW(m.parameters())
    m[0].weight.grad = torch.ones_like(m[0].weight)  # a gradient waiting: torch's path
    assert not create_adam_state(fresh) and not fresh.state
