"""A survivor's kept trainer trains on exactly (trainer/keeptrainer.py).

Two real processes (torch.distributed.run, gloo, the embedded engine's tiny model): a step
fails in the middle of its backward on every rank; each rank keeps its trainer, joins a new
world, loads the state of 3 steps before and trains those 3 steps again. Loss and gradient
norm equal the first time's, bitwise, for FSDP2's sharded and replicated data parallelism;
and when no step is found, the kept trainer starts as a new one would.
Before FSDP2's unsharded gradients were dropped on leaving, the first step after had the
same loss and another gradient norm (the failed backward's partial gradients added in).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from unbroken.diagnostics.check import free_port

pytestmark = pytest.mark.integration


def _run(mode: str, *flags: str) -> dict[str, list[list[float]]]:
    # the workers' own store gets a free port too, not torchrun's port + 1 (another test's)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KEEPRUN_STORE_PORT": str(free_port())}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        f"--master-port={free_port()}", "-m", "tests.integration.keeprun", mode,
        "--dp", "2", *flags,
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("{"))
    result: dict[str, list[list[float]]] = json.loads(line)
    return result


@pytest.mark.parametrize("dp_mode", ["zero3", "replicate"])
def test_a_kept_trainer_repeats_the_steps_exactly_after_a_failed_backward(dp_mode: str) -> None:
    r = _run("load", "--dp-mode", dp_mode)
    assert r["got"] == r["ref"], r


def test_a_kept_trainer_whose_restore_finds_nothing_starts_as_a_new_one() -> None:
    """No rank holds a step: the kept trainer is built again on its meshes, and its first
    three steps are a new trainer's, bitwise (not the steps of the weights it held)."""
    r = _run("afresh")
    assert r["got"] == r["ref"], r


def test_a_kept_pipeline_stage_trainer_repeats_the_steps_exactly() -> None:
    """pp2 (one stage per rank): the last stage fails in its backward and shuts its world
    down, the first stage's wait for its gradients fails; each keeps its trainer, and new
    pipeline stages on the kept parts train the 3 steps again bitwise."""
    r = _run("load", "--dp", "1", "--pp", "2")
    assert r["got"] == r["ref"], r
