"""The SDK's per-step snapshot of a user's state dict (trainer/bundlesnap.py).

Its fresh values are every non-tensor value the full path saves, under the same names
and equal; its key stays while training updates tensors in place and changes whenever a
tensor `state_dict()` holds may be another one; a state that cannot be snapshotted takes
the full path; and saves through it into a real flash ring load back bitwise as the
state of the step saved, also after a parameter was replaced between saves.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.flashplan import flatten, resolve_stateful
from unbroken.trainer import bundlesnap, hooks
from unbroken.trainer.adapters.core import Progress, Rng

pytestmark = pytest.mark.unit

KEY = "trainer"


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 16)
        self.head.weight = self.emb.weight  # tied, as language models do
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)) * self.scale)


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return {
        "model": net,
        "optimizer": opt,
        "scheduler": sched,
        "unbroken": Progress(),
        "rng": Rng(),
        "extra": torch.arange(4.0),
    }


def _train(state: dict[str, Any], steps: int = 1) -> None:
    net, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    for _ in range(steps):
        x = torch.randint(0, 16, (4, 3))
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state["unbroken"].step += 1


def _snap(state: dict[str, Any]) -> Any:
    return bundlesnap.snapshot(KEY, state, hooks.stateful(state))


def test_fresh_values_are_every_small_value_the_full_path_saves() -> None:
    state = _state()
    _train(state, 2)
    snap = _snap(state)
    assert snap is not None
    full = flatten(resolve_stateful(snap.full()))
    small = {k: v for k, v in full.items() if not isinstance(v, torch.Tensor)}
    fresh = snap.fresh()
    # every small value, under its name and equal; the only tensor is the RNG state
    assert {k: v for k, v in fresh.items() if not isinstance(v, torch.Tensor)} == small
    tensors = {k for k, v in fresh.items() if isinstance(v, torch.Tensor)}
    assert tensors == {f"{KEY}.rng.cpu"}
    assert torch.equal(fresh[f"{KEY}.rng.cpu"], full[f"{KEY}.rng.cpu"])


def test_the_key_holds_across_in_place_steps_and_changes_with_any_new_tensor() -> None:
    state = _state()
    _train(state)
    key = _snap(state).key
    _train(state, 3)  # parameters and optimizer state updated in place
    assert _snap(state).key == key

    def changed(mutate: Any) -> None:
        s = _state()
        _train(s)
        before = _snap(s).key
        mutate(s)
        assert _snap(s).key != before

    changed(lambda s: setattr(s["model"].body[0], "bias", torch.nn.Parameter(torch.zeros(8))))
    changed(lambda s: setattr(s["model"].body[0].weight, "data", torch.zeros(8, 8)))
    changed(lambda s: setattr(s["model"], "scale", torch.ones(8)))  # a buffer replaced
    changed(lambda s: s["optimizer"].load_state_dict(copy.deepcopy(s["optimizer"].state_dict())))
    changed(lambda s: s.__setitem__("extra", torch.arange(4.0)))
    changed(lambda s: s.__setitem__("more", torch.zeros(1)))
    changed(lambda s: s["model"].body.append(torch.nn.Linear(8, 8)))

    fresh = _state()  # an optimizer that has not stepped: its state appears at the first
    before = _snap(fresh).key
    _train(fresh)
    assert _snap(fresh).key != before


def test_what_cannot_be_snapshotted_takes_the_full_path() -> None:
    s = _state()
    s["model"].body.register_state_dict_post_hook(lambda *a: None)
    assert _snap(s) is None
    s = _state()
    s["optimizer"].register_state_dict_post_hook(lambda opt, sd: sd)
    assert _snap(s) is None

    class Extra(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return {"x": 1}

        def set_extra_state(self, state: Any) -> None:
            pass

    s = _state()
    s["model"].body[0] = Extra(8, 8)
    assert _snap(s) is None

    class Wrapped(torch.Tensor):  # a tensor subclass (DTensor, a quantised weight...)
        pass

    s = _state()
    s["extra"] = torch.zeros(2).as_subclass(Wrapped)
    assert _snap(s) is None
    s = _state()
    s["model"].register_buffer("sparse", torch.eye(3).to_sparse())  # no storage pointer
    assert _snap(s) is None


@pytest.fixture
def writer() -> Iterator[FlashWriter]:
    root = tempfile.mkdtemp(prefix="ub-test-", dir="/dev/shm")
    w = FlashWriter(0, FlashOwner(FlashConfig(root=root, job="t")))
    try:
        yield w
    finally:
        w.close()
        shutil.rmtree(root, ignore_errors=True)


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    return flatten(resolve_stateful({KEY: hooks.stateful(state)}))


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_snapshot_saves_load_back_as_the_step_saved(writer: FlashWriter) -> None:
    state = _state()
    hits = []
    for step in range(1, 6):
        _train(state)
        if step == 3:  # a parameter replaced between saves: the next save copies the new one
            layer, opt = state["model"].body[0], state["optimizer"]
            old = layer.bias
            layer.bias = new = torch.nn.Parameter(old.detach() + 1)
            group = opt.param_groups[0]
            group["params"] = [new if p is old else p for p in group["params"]]
            opt.state[new] = opt.state.pop(old)
        snap = _snap(state)
        assert snap is not None
        writer.save_async({KEY: hooks.stateful(state)} if step == 1 else snap, step).wait()
        hits.append(writer._plans.hits)
    # step 1 a plain state dict, 2 the snapshot's first (its plan), 3 a new key (planned
    # again), 4 and 5 the cached plan
    assert hits == [0, 0, 0, 1, 2]
    want = _flat(state)

    target = _state(seed=1)
    _train(target)  # optimizer state to load into
    writer.load({KEY: hooks.stateful(target)})
    _same(_flat(target), want)
