"""A child's exit, seen when it happens.

`asyncio.subprocess.Process.wait()` (Python 3.11) returns only once the process has exited
*and* every holder of its stdout and stderr pipes has closed them. A worker's own children
inherit those pipes: a data loader's workers, a compile pool, a helper daemon, or a shell's
background job. After the worker is SIGKILLed they can live on for seconds (a data loader's
worker notices its parent is gone only at its next 5 s status check) or for good, and the
agent would not see the worker's death until they end. Here the exit is seen through a
pidfd (Linux 5.3+), readable the moment the process exits; its status comes from asyncio's
child watcher, which reaps it at once. Without a pidfd the status is polled.
"""

from __future__ import annotations

import asyncio
import os

#: How often the status is polled without a pidfd, and once the pidfd said "exited" while
#: the child watcher has not yet handed the status over (microseconds, in practice).
POLL_S = 0.05
AFTER_PIDFD_POLL_S = 0.002


async def exit_code(proc: asyncio.subprocess.Process) -> int:
    """`proc`'s exit status as soon as it exits, whoever still holds its pipes."""
    if proc.returncode is not None:
        return proc.returncode
    loop = asyncio.get_running_loop()
    waited: asyncio.Future[int] = asyncio.ensure_future(proc.wait())
    gone: asyncio.Future[int] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(0)

    fd = -1
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd here, or the process is already reaped
        pass
    if fd >= 0:
        loop.add_reader(fd, readable)
    try:
        if fd >= 0:
            await asyncio.wait({waited, gone}, return_when=asyncio.FIRST_COMPLETED)
        poll_s = AFTER_PIDFD_POLL_S if fd >= 0 else POLL_S
        while proc.returncode is None and not waited.done():
            await asyncio.wait({waited}, timeout=poll_s)
        code = proc.returncode
        return waited.result() if code is None else code
    finally:
        if fd >= 0:
            loop.remove_reader(fd)
            os.close(fd)
        if not waited.done():
            waited.cancel()
