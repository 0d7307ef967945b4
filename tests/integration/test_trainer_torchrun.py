"""The engine runs standalone: under torchrun (4 processes, dp2×tp2) and as `unbroken train`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run in a fresh process group so that a timeout kills torchrun's workers too."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} timed out after {timeout_s}s:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# 21 s of CI's 25 minutes on 2 cores: in `make test-all`; CI's torchrun runs are the
# README's (test_torchrun_readme.py), the backend's (test_torchrun_rdzv.py) and the SDK's
@pytest.mark.slow
def test_torchrun_4_processes_trains_on_the_default_corpus(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "unbroken.trainer.run", "--preset", "tiny", "--dp", "2", "--tp", "2",
        "--steps", "40", "--warmup-steps", "5", "--seq-len", "64", "--global-batch", "8",
        "--metrics-out", str(metrics),
    ]  # fmt: skip
    res = _run(cmd, timeout_s=280)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)
    assert all(r["tokens_per_s"] > 0 and r["flops_per_s"] > 0 and r["mfu"] is None for r in rows)
    # the loop turns tile the run: each from the last report to this one (the first has
    # none), holding the step and the loop's time after it, and together the whole span
    assert "turn_s" not in rows[0] and all("turn_s" in r for r in rows[1:])
    assert all(r["turn_s"] >= r["step_time_s"] + r["host_s"] for r in rows[1:])
    span = rows[-1]["end_unix_s"] - rows[0]["end_unix_s"]
    assert abs(sum(r["turn_s"] for r in rows[1:]) - span) < 0.01 * span + 0.05, span


def test_unbroken_train_subcommand_and_bad_flags(tmp_path: Path) -> None:
    unbroken = [sys.executable, "-m", "unbroken.cli", "train"]
    ok = _run([*unbroken, "--steps", "3", "--max-corpus-bytes", "65536"], timeout_s=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = _run([*unbroken, "--tp", "3"], timeout_s=120)
    assert bad.returncode == 2
    assert "model.n_heads (4) must be divisible by parallel.tp (3)" in bad.stderr
