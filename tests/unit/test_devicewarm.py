"""The device warm-up (trainer/devicewarm.py): its step runs on the job's shapes and draws
no random numbers; off the GPU and when turned off it starts nothing."""

from __future__ import annotations

import pytest
import torch

from unbroken.trainer import devicewarm
from unbroken.trainer.config import TrainConfig
from unbroken.trainer.flags import add_arguments, to_config

pytestmark = pytest.mark.unit


def _config(*argv: str) -> TrainConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return to_config(parser.parse_args(["--preset", "tiny", *argv]))


@pytest.mark.parametrize("impl", ["foreach", "fused", "for-loop"])
def test_the_warm_step_runs_and_leaves_the_rng_streams_alone(impl: str) -> None:
    config = _config("--device", "cpu", "--dp", "2", "--optimizer-impl", impl)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    devicewarm.warm(config, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_block_too_big_warms_only_a_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[object] = []
    monkeypatch.setattr(devicewarm, "MAX_WARM_PARAMS", 1)
    import unbroken.trainer.model as model

    real = model.Transformer

    def counting(*a: object, **k: object) -> object:
        built.append(a)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "Transformer", counting)
    devicewarm.warm(_config("--device", "cpu"), torch.device("cpu"))
    assert built == []


def test_nothing_starts_on_the_cpu_or_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devicewarm, "_started", False)
    assert devicewarm.start(_config("--device", "cpu"), 0) is None
    monkeypatch.setenv(devicewarm.ENV, "0")
    assert devicewarm.start(_config("--device", "cuda"), 0) is None
    assert devicewarm._started is False
