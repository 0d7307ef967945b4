"""A child run for its output never outlives the call that runs it.

`unbroken.common.aio.communicate` is how the agent and the driver run a self-check, a
check, a py-spy dump or a Slurm command. A call that timed out or was cancelled (an agent
stopping mid self-check) used to leave the child running with its pipes open; once the
event loop closed, the garbage collector's close of that transport raised "Event loop is
closed" from a finalizer, at whatever moment it ran (a CI run: inside pytest's report of a
failure, which ended the run). Real child processes, real pipes; a finalizer's exception
fails the test (the filter below) once the collector has run.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys

import pytest

from unbroken.common import aio

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _sleeper() -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        *SLEEPER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"up\n"  # running, its pipes open
    return proc


def test_a_timed_out_or_cancelled_call_kills_and_reaps_its_child() -> None:
    async def go() -> list[int]:
        timed_out = await _sleeper()
        with pytest.raises(TimeoutError):
            await aio.communicate(timed_out, None, 0.3)
        assert timed_out.returncode == -9

        cancelled = await _sleeper()
        call = asyncio.create_task(aio.communicate(cancelled, b"", 60))
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert cancelled.returncode == -9

        done = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "print('out')", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert await aio.communicate(done, None, 60) == (b"out\n", b"")
        return [timed_out.pid, cancelled.pid, done.pid]

    pids = asyncio.run(go())
    gc.collect()  # a transport left open would raise from its finalizer here
    assert all(_gone(pid) for pid in pids)


def test_a_task_cancelled_while_its_loop_ends_leaves_no_child() -> None:
    """asyncio.run cancels what is still running when its main coroutine returns: the
    child a cancelled call was waiting on is reaped before the loop closes."""
    pids: list[int] = []

    async def go() -> None:
        proc = await _sleeper()
        pids.append(proc.pid)
        asyncio.get_running_loop().create_task(aio.communicate(proc, None, 60))
        await asyncio.sleep(0.1)  # the call is waiting; main returns with it pending

    asyncio.run(go())
    gc.collect()
    assert pids and _gone(pids[0])
