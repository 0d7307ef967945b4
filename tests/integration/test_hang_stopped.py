"""A hung rank whose process is stopped is named the culprit (agent/hang.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from unbroken.agent import hang

pytestmark = pytest.mark.integration


def _wait_for(pred: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_sigstopped_process_reads_as_stopped_and_a_running_one_does_not() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not hang.process_stopped(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        _wait_for(lambda: hang.process_stopped(p.pid), "the stop to be delivered")
        os.kill(p.pid, signal.SIGCONT)
        _wait_for(lambda: not hang.process_stopped(p.pid), "the process to run again")
    finally:
        p.kill()
        p.wait()
    assert not hang.process_stopped(p.pid)  # gone: not stopped
    assert not hang.process_stopped(os.getpid())
