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


STACKS = """
import os, signal, sys
from unbroken.trainer import hookchannel

if sys.argv[1] == "claimed":
    signal.signal(signal.SIGUSR1, lambda *_: print("the script's own handler", flush=True))

def a_hung_step():
    print(hookchannel.stacks_on_signal(), flush=True)
    os.kill(os.getpid(), signal.SIGUSR1)

a_hung_step()
print("still running", flush=True)
"""


@pytest.mark.parametrize("claimed", [False, True], ids=["default", "claimed"])
def test_sigusr1_dumps_the_stacks_unless_the_script_claimed_it(claimed: bool) -> None:
    """An attached worker (torchrun's, not the agent's child) registers the stack dump on
    SIGUSR1 where the signal still ends the process; a script's own handler stays."""
    done = subprocess.run(
        [sys.executable, "-c", STACKS, "claimed" if claimed else "default"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "still running" in done.stdout
    if claimed:
        assert done.stdout.startswith("False") and "the script's own handler" in done.stdout
        assert "a_hung_step" not in done.stderr
    else:
        assert done.stdout.startswith("True") and "a_hung_step" in done.stderr
