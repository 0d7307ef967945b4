"""A rank stopped before it reported anything is judged hung (a real SIGSTOPped process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken.agent import hang
from unbroken.agent.workers import Worker
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.integration

CFG = hang.HangConfig(floor_ms=1000.0, k=5.0, quantile=0.9, phase_limit_ms=60_000.0)


def _worker(tmp_path: object) -> Worker:
    w = Worker(1, 3, Path(str(tmp_path)) / "w.log")
    w.state = dpb.WORKER_STATE_RUNNING
    return w


def test_a_rank_stopped_before_it_said_anything_is_hung(tmp_path: object) -> None:
    """A just-promoted warm standby still importing (or any rank before its first report)
    is judged from its start: stopped, it is hung once STOPPED_AFTER_MS passed."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        w = _worker(tmp_path)
        w.proc = proc  # type: ignore[assignment]
        t0 = w.last_progress
        assert not w.status(t0 + 1.0, CFG).hung  # running, silent: a hookless script, fine
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not hang.process_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not w.status(t0 + hang.STOPPED_AFTER_MS / 2000, CFG).hung  # not yet
        s = w.status(t0 + 1.0, CFG)
        assert s.hung and s.phase == "stopped"
    finally:
        proc.kill()
        proc.wait()
