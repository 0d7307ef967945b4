"""The installed `unbroken` script runs `unbroken plan` and exits 0, or 2 on bad input (a
process, so not a unit test; the plan itself: tests/unit/test_plan_cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

OPT = ["--params", "175B", "--tokens", "300B", "--gpus", "1024", "--gpu", "a100-80gb"]


def test_installed_script_exit_codes() -> None:
    script = Path(sys.executable).with_name("unbroken")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run(
        [str(script), "plan", *OPT, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["gpus"] == 1024
    bad = subprocess.run(
        [str(script), "plan", *OPT[:-1], "tpu"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert bad.returncode == 2
    assert "unknown GPU type 'tpu'" in bad.stderr
