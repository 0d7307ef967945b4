"""The optimizer guard with a closure (recovery/stepguard.py): a step that evaluates its
forward and backward in a closure (Lightning's automatic optimization) overlaps the copy in
flight with them, and its update still waits for the copy; other optimizers wait before.

Each test holds a real writer's copy in flight (its progress hook waits on an event), runs
a real optimizer step, and reads the copy back: it must be the state from before the step,
bit for bit.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from unbroken.recovery import stepguard
from unbroken.recovery.flash import FlashWriter, SaveHandle
from unbroken.recovery.flashowner import FlashConfig, FlashOwner

pytestmark = pytest.mark.unit


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    root = tempfile.mkdtemp(prefix="ub-stepguard-", dir="/dev/shm")
    try:
        yield FlashOwner(FlashConfig(root=root, job="t"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Held:
    """A writer whose copy waits for `release`, guarding every optimizer, and a model."""

    def __init__(self, owner: FlashOwner) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.release = threading.Event()
        self.writer = FlashWriter(0, owner, progress_hook=lambda i: self.release.wait(10))
        self.guards = self.writer.guard(None)
        self.before = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.x = torch.randn(8, 4)

    def save(self) -> SaveHandle:
        h = self.writer.save_async({"model": self.model.state_dict()}, 1)
        assert h is not None
        return h

    def loss(self) -> torch.Tensor:
        return self.model(self.x).pow(2).sum()

    def closure(self, h: SaveHandle, seen: list[bool]) -> Callable[[], torch.Tensor]:
        def closure() -> torch.Tensor:
            seen.append(h.copied())  # the copy is still in flight here...
            loss = self.loss()
            self.model.zero_grad()
            loss.backward()
            self.release.set()  # ...and may finish once the backward is done
            return loss

        return closure

    def copy_is_the_state_before(self) -> None:
        target = {"model": {k: torch.zeros_like(v) for k, v in self.before.items()}}
        self.writer.load(target)
        for k, v in self.before.items():
            assert torch.equal(target["model"][k], v), k
        assert not torch.equal(self.model.weight, self.before["weight"])  # the step updated

    def close(self) -> None:
        for g in self.guards:
            g.remove()
        self.writer.close()


@pytest.mark.parametrize("as_kwarg", [True, False], ids=["closure=", "positional"])
@pytest.mark.parametrize("make", [torch.optim.AdamW, torch.optim.SGD], ids=["adamw", "sgd"])
def test_a_torch_step_with_a_closure_runs_it_beside_the_copy_and_updates_after(
    owner: FlashOwner, as_kwarg: bool, make: Callable[..., torch.optim.Optimizer]
) -> None:
    held = Held(owner)
    opt = make(held.model.parameters(), lr=0.1)
    h = held.save()
    seen: list[bool] = []
    closure = held.closure(h, seen)
    loss = opt.step(closure=closure) if as_kwarg else opt.step(closure)
    assert seen == [False] and isinstance(loss, torch.Tensor)  # the closure ran first...
    assert h.copied()  # ...and the update waited for the copy
    held.copy_is_the_state_before()
    held.close()


def test_lbfgs_evaluating_its_closure_many_times_updates_only_after_the_copy(
    owner: FlashOwner,
) -> None:
    held = Held(owner)
    opt = torch.optim.LBFGS(held.model.parameters(), lr=0.1, max_iter=4)
    h = held.save()
    seen: list[bool] = []
    opt.step(held.closure(h, seen))
    assert seen[0] is False and all(seen[1:]) and len(seen) > 1
    held.copy_is_the_state_before()
    held.close()


class PerturbFirst(torch.optim.SGD):
    """A step that changes the parameters before it evaluates the closure (as SAM's first
    step does): the guard must not let the closure run ahead of the copy."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(1.0)
        loss = closure() if closure is not None else None
        super().step()
        return loss


def test_an_optimizer_of_its_own_waits_before_its_step(owner: FlashOwner) -> None:
    held = Held(owner)
    opt = PerturbFirst(held.model.parameters(), lr=0.1)
    assert not stepguard.closure_first(opt)
    h = held.save()
    threading.Timer(0.2, held.release.set).start()
    seen: list[bool] = []

    def closure() -> torch.Tensor:
        seen.append(h.copied())
        loss = held.loss()
        held.model.zero_grad()
        loss.backward()
        return loss

    opt.step(closure)
    assert seen == [True]  # waited before the step: the copy was out before the closure
    held.copy_is_the_state_before()
    held.close()


def test_a_closure_that_raises_still_waits_and_the_error_reaches_the_caller(
    owner: FlashOwner,
) -> None:
    held = Held(owner)
    opt = torch.optim.AdamW(held.model.parameters(), lr=0.1)
    h = held.save()

    def closure() -> torch.Tensor:
        threading.Timer(0.2, held.release.set).start()
        raise ValueError("the batch was bad")

    with pytest.raises(ValueError, match="the batch was bad"):
        opt.step(closure)
    assert h.copied()
    assert all(torch.equal(v, held.before[k]) for k, v in held.model.state_dict().items())
    held.close()


def test_torch_optimizers_and_their_subclasses_that_keep_torch_step_are_closure_first() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]

    class Tuned(torch.optim.Adam):
        pass

    for opt in (torch.optim.Adam(p), torch.optim.SGD(p, lr=0.1), Tuned(p)):
        assert stepguard.closure_first(opt), type(opt)
    assert not stepguard.closure_first(object())
