"""The optional trainer protocols (trainer/plugin.py) say what the runner and the flash
checkpoint use beyond `Trainer`: the embedded engine offers them, a plain plugin need not,
and a trainer without one loses only that feature."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from unbroken.common.faults import LOSS_SPIKE, WorkerFault
from unbroken.trainer import hooks, run
from unbroken.trainer.gpt3d import GPT3DTrainer
from unbroken.trainer.plugin import (
    Batches,
    BatchSource,
    Collectives,
    Meshed,
    Optimizers,
    Skips,
    Stateful,
    Throttled,
    Trainer,
)

pytestmark = pytest.mark.unit


class Loader:
    def next_batch(self) -> tuple[Any, Any]:
        return torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)


class Plain:
    """The smallest plugin: the `Trainer` methods and nothing else."""

    def setup(self, config: Any) -> None: ...

    def train_step(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class WithLoader(Plain):
    def __init__(self) -> None:
        self.loader = Loader()
        self.skipped = 0

    def skip(self, n_batches: int) -> None:
        self.skipped += n_batches


def test_the_embedded_engine_offers_every_optional_protocol() -> None:
    t = GPT3DTrainer()  # before setup: the methods and the drill attributes are there
    assert isinstance(t, Trainer) and isinstance(t, Stateful)
    for proto in (Meshed, Skips, Throttled, Collectives):
        assert isinstance(t, proto), proto.__name__


def test_a_plain_plugin_is_a_trainer_and_nothing_more() -> None:
    t = Plain()
    assert isinstance(t, Trainer)
    for proto in (Optimizers, Meshed, Skips, Batches, Throttled, Collectives):
        assert not isinstance(t, proto), proto.__name__


def test_skip_needs_the_skips_protocol() -> None:
    run._skip(Plain(), 3, 10)  # warns, does nothing
    t = WithLoader()
    run._skip(t, 3, 10)
    assert t.skipped == 3


def test_a_loss_spike_poisons_the_loaders_next_batch_once() -> None:
    t = WithLoader()
    assert isinstance(t, Batches) and isinstance(t.loader, BatchSource)
    fault = WorkerFault(kind=LOSS_SPIKE, step=1, id="f")
    with run.applied_fault(t, fault):
        _, targets = t.loader.next_batch()
        assert int(targets.sum()) == 0
    _, targets = t.loader.next_batch()
    assert int(targets.sum()) == 6  # undone
    with run.applied_fault(Plain(), fault):  # no loader: not applied, no error
        pass


def test_the_sdk_names_the_optimizers_of_a_state_dict() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with_opt = hooks._bundle({"model": model, "opt": opt})
    assert isinstance(with_opt, Stateful) and isinstance(with_opt, Optimizers)
    assert list(with_opt.optimizers) == [opt]
    without = hooks._bundle({"model": model})
    assert isinstance(without, Stateful) and not isinstance(without, Optimizers)
