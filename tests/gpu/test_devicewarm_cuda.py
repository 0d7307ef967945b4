"""The device warm-up on a GPU (trainer/devicewarm.py): it runs its step in bf16 with the
optimizer's kernels and leaves the CPU's and the device's random streams as they were.
Skips without a CUDA GPU (CI has none): `.venv/bin/python -m pytest tests/gpu`."""

from __future__ import annotations

import argparse

import pytest
import torch

from unbroken.trainer import devicewarm
from unbroken.trainer.flags import add_arguments, to_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_the_warm_step_runs_on_the_gpu_and_draws_no_random_numbers(impl: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = to_config(
        parser.parse_args(["--preset", "tiny", "--device", "cuda", "--optimizer-impl", impl])
    )
    dev = torch.device("cuda", 0)
    torch.manual_seed(11)
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state(dev)
    devicewarm.warm(config, dev)
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(torch.cuda.get_rng_state(dev), gpu)
