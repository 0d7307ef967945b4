"""asyncio helpers the package uses instead of the standard library's where 3.11 differs.

`wait_for`: Python 3.11's `asyncio.wait_for` returns the awaited result instead of
raising when the task is cancelled in the same loop iteration as the awaited thing
completes (CPython gh-86296, fixed in 3.12 by building `wait_for` on `asyncio.timeout`).
The cancellation is lost: a task that was told to stop goes on. A standby driver's
campaign hung for good that way: its leader prober (a `wait_for` around a TCP connect
that completes at once against a frozen leader) swallowed the cancel that ended a watch
round, and the campaign waited on the prober forever. This one is 3.12's, on every version.

`communicate`: a child process's output with a deadline that never leaves the child
behind. A task cancelled while it waited (an agent stopping mid self-check) left the
child running and its pipes open; once the event loop closed, the garbage collector's
close of that transport raised "Event loop is closed" from a finalizer, at whatever
moment it ran (in a test run, inside pytest's own report of a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """`await aw`, raising TimeoutError after `timeout` seconds (None: no limit); a
    cancellation of the calling task always propagates. A coroutine runs in the caller's
    task (not a new one, as 3.11's `asyncio.wait_for` does); a future or task passed in is
    cancelled on timeout."""
    if timeout is None:
        return await aw
    async with asyncio.timeout(timeout):
        return await aw


async def communicate(
    proc: asyncio.subprocess.Process, stdin: bytes | None, timeout: float | None
) -> tuple[bytes, bytes]:
    """`proc.communicate(stdin)` within `timeout` seconds (TimeoutError after it). On any
    way out but its end (the timeout, the caller cancelled, an error) the child is killed
    and reaped first, so no process or pipe outlives the call."""
    try:
        return await wait_for(proc.communicate(stdin), timeout)
    except BaseException:
        await reap(proc)
        raise


async def reap(proc: asyncio.subprocess.Process, timeout: float = 10.0) -> None:
    """Kill `proc` if it still runs and wait for its end and its pipes' (at most `timeout`
    seconds: a SIGKILLed child ends at once unless the kernel holds it in a D state)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(Exception):
        await asyncio.shield(wait_for(proc.wait(), timeout))


async def cancel_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel those of `tasks` not done and wait until each has ended (its `finally` ran)."""
    left = [t for t in tasks if not t.done()]
    for t in left:
        t.cancel()
    await asyncio.gather(*left, return_exceptions=True)
