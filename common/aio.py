"""asyncio helpers the package uses instead of the standard library's where 3.11 differs.

`wait_for`: Python 3.11's `asyncio.wait_for` returns the awaited result instead of
raising when the task is cancelled in the same loop iteration as the awaited thing
completes (CPython gh-86296, fixed in 3.12 by building `wait_for` on `asyncio.timeout`).
The cancellation is lost: a task that was told to stop goes on. A standby driver's
campaign hung for good that way: its leader prober (a `wait_for` around a TCP connect
that completes at once against a frozen leader) swallowed the cancel that ended a watch
round, and the campaign waited on the prober forever. This one is 3.12's, on every version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

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
