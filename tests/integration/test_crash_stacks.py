"""A worker that crashes in native code leaves its Python stacks in its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.trainer import hookchannel

pytestmark = pytest.mark.integration

# a worker that installs the hooks, then dies in native code (a read of address 0)
CRASH = """
import ctypes
from unbroken.trainer import hookchannel

def step_of_a_crashing_extension():
    ctypes.string_at(0)

hookchannel.install()
step_of_a_crashing_extension()
"""


def _run(tmp_path: Path, agent_socket: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "PYTHONFAULT"))}
    env["UNBROKEN_AGENT_SOCKET"] = agent_socket
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-c", CRASH], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_segfault_under_an_agent_dumps_the_python_stacks(tmp_path: Path) -> None:
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(path)  # where the worker's hello and reports go
        done = _run(tmp_path, path)
    assert done.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert "step_of_a_crashing_extension" in done.stderr


def test_outside_an_agent_the_hooks_change_nothing(tmp_path: Path) -> None:
    done = _run(tmp_path, "")
    assert done.returncode == -signal.SIGSEGV
    assert "Fatal Python error" not in done.stderr


def test_a_process_that_set_faulthandler_itself_keeps_it() -> None:
    import faulthandler

    was = faulthandler.is_enabled()
    faulthandler.enable()
    try:
        assert hookchannel.crash_stacks() is False
        assert faulthandler.is_enabled()
    finally:
        if not was:
            faulthandler.disable()
