"""The reaper (common/reaper.py): when a process dies, by SIGKILL too, what it started dies,
including a grandchild in a session of its own whose parent exited (re-parented)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from unbroken.common import reaper

pytestmark = pytest.mark.integration

# The watched process: its reaper, a child that starts a grandchild in its own session and
# exits a while later (the grandchild is re-parented), and a plain child that sleeps on.
_PARENT = """
import subprocess, sys, time
from unbroken.common import reaper
assert reaper.start(grace_s=2.0) is not None
child = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
g = subprocess.Popen(["sleep", "300"], start_new_session=True)
print(g.pid, flush=True)
time.sleep(2.0)  # long enough for the reaper to note it while it is a descendant
'''], stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
sleeper = subprocess.Popen(["sleep", "300"])
print(grandchild, sleeper.pid, flush=True)
child.wait()
time.sleep(300)
"""


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_sigkilled_parents_children_and_reparented_grandchildren_are_stopped() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = [int(x) for x in parent.stdout.readline().split()]
        grandchild, sleeper = pids
        time.sleep(3.0)  # the child has exited: the grandchild is nobody's descendant now
        assert psutil.Process(grandchild).ppid() != parent.pid
        assert psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE
        parent.kill()
        parent.wait(10)
        assert _gone(sleeper, 15), "the parent's child outlived it"
        assert _gone(grandchild, 15), "the re-parented grandchild outlived the parent"
    finally:
        parent.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_the_watch_ends_at_once_when_the_parent_exits_with_nothing_left() -> None:
    """The normal case: the parent stopped its children itself; the watch finds nothing."""
    proc = subprocess.Popen(["sleep", "0.5"])
    t0 = time.monotonic()
    assert reaper.watch(proc.pid, grace_s=10.0, poll_s=0.05) == 0
    assert time.monotonic() - t0 < 5
    proc.wait(5)


def test_a_process_table_pass_finds_descendants_of_every_root() -> None:
    """One pass over the table finds the children of the watched process and of those
    noted before (`_descendants`), and `_alive_in` tells a pid's start time apart."""
    kid = subprocess.Popen(["sleep", "30"])
    try:
        table = reaper._table()
        assert kid.pid in reaper._descendants(table, [os.getpid()])
        assert reaper._descendants(table, [kid.pid]) == set()
        created = psutil.Process(kid.pid).create_time()
        assert reaper._alive_in(table, kid.pid, created)
        assert not reaper._alive_in(table, kid.pid, created - 1.0)  # a reused pid
    finally:
        kid.kill()
        kid.wait(5)
