"""An agent with warm standbys that waits for its job starts its SDC buddy helper at once
(recovery/sdcbuddy.py `prestart`), and the helper goes when the agent does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


def _agent(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "unbroken.cli", "agent", "--driver", "127.0.0.1:1",
        "--node-id", "n0", "--worker-cmd", "true", "--nproc-per-node", "1", "--no-start",
        "--socket", str(tmp_path / "agent.sock"), "--log-dir", str(tmp_path / "logs"),
        "--flash-dir", str(tmp_path / "shm"), "--flash-job", "prestart",
        "--persist-url", str(tmp_path / "persist"), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _lines_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            time.sleep(0.05)
            continue
        seen.append(line)
        if marker in line:
            return seen
    return seen


def test_a_warm_agent_waiting_for_its_job_prestarts_its_helper(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "--warm-workers", "--warm-after-s", "0")
    try:
        seen = _lines_until(agent, "sdc.helper_started", 60)
        assert agent.poll() is None, "".join(seen)[-3000:]
        assert any("sdc.helper_started" in x for x in seen), "".join(seen)[-3000:]
        helpers = [
            p for p in psutil.Process(agent.pid).children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline())
        ]  # fmt: skip
        assert len(helpers) == 1, [p.cmdline() for p in helpers]
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        assert not helpers[0].is_running() or helpers[0].status() == psutil.STATUS_ZOMBIE
    finally:
        agent.kill()
        agent.wait(10)


def test_an_agent_without_standbys_starts_no_helper_before_a_copy(tmp_path: Path) -> None:
    """No `--warm-workers`: the memory is not spent; the first copy starts the helper."""
    agent = _agent(tmp_path)
    try:
        seen = _lines_until(agent, "driver unreachable", 60)  # it runs, trying the driver
        seen += _lines_until(agent, "sdc.helper_started", 2)
        assert agent.poll() is None, "".join(seen)[-3000:]
        assert any("driver unreachable" in x for x in seen), "".join(seen)[-3000:]
        assert not any("sdc.helper_started" in x for x in seen), "".join(seen)[-3000:]
        kids = psutil.Process(agent.pid).children(recursive=True)
        assert not [p for p in kids if "spawn_main" in " ".join(p.cmdline())]
    finally:
        agent.kill()
        agent.wait(10)
