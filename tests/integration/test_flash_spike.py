"""A loss spike injected through the data triggers a rollback from flash memory and a skip.

Single process, real flash store: a small model trains with a flash save after every
step; batch 12 is poisoned (targets x 1000). The detector flags the spike after the bad
update was applied, the policy rolls back to step 11 (held in memory) and skips batches
12..14; training continues. The result must equal, exactly, a run that never saw those
batches, and the decisions map onto LossSpike / Rollback events.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.spike import RollbackDecision, RollbackPolicy, SpikeConfig, SpikeDetector

pytestmark = pytest.mark.integration

POISON = 12
STEPS = 20


def _batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    return (x, y * 1000) if index == POISON else (x, y)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 8)).sum().backward()  # materialise optimizer state for loading
    opt.step()
    opt.zero_grad()
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int) -> float:
    x, y = _batch(batch)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    root = tempfile.mkdtemp(prefix="ub-spike-", dir="/dev/shm")
    try:
        yield FlashOwner(FlashConfig(root=root, job="spike"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_spike_rolls_back_from_memory_and_skips_batches(owner: FlashOwner) -> None:
    cfg = SpikeConfig(window=20, min_history=5, factor=6.0, skip_before=0, skip_after=3)
    detector, policy = SpikeDetector(cfg), RollbackPolicy(cfg)
    model, opt = _model()
    writer = FlashWriter(0, owner)
    step, batch = 0, 1
    losses: dict[int, float] = {}
    decisions: list[RollbackDecision] = []
    skip: RollbackDecision | None = None
    while step < STEPS:
        while skip is not None and skip.skips(batch):
            batch += 1
        step += 1
        loss = _step(model, opt, batch)
        batch += 1
        spike = detector.observe(step, loss)
        if spike is not None:
            assert spike.to_event().step == POISON
            in_memory = [c.manifest.step for c in owner.copies()[0]]
            skip = policy.decide(spike, in_memory)
            decisions.append(skip)
            assert not skip.halt
            sd = {"model": model.state_dict(), "optim": opt.state_dict(), "data": {"batch": -1}}
            manifest = writer.load(sd, step=skip.to_step)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            step, batch = manifest.step, sd["data"]["batch"]
            owner.discard_newer_than(step)
            continue
        losses[step] = loss
        sd = {"model": model.state_dict(), "optim": opt.state_dict(), "data": {"batch": batch}}
        writer.save(sd, step).wait()
    writer.close()

    assert len(decisions) == 1
    d = decisions[0]
    assert (d.from_step, d.to_step, d.skip_first, d.skip_last) == (POISON, POISON - 1, 12, 14)
    event = d.to_event()
    assert (event.from_step, event.to_step, event.skip_batches) == (POISON, POISON - 1, 3)

    # The reference never sees batches 12..14.
    ref_model, ref_opt = _model()
    batches = [b for b in range(1, STEPS + 4) if not 12 <= b <= 14][:STEPS]
    reference = {s: _step(ref_model, ref_opt, b) for s, b in enumerate(batches, start=1)}
    assert losses == reference
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
