"""An asyncio event loop on its own daemon thread, optionally at a lower CPU priority.

Two parts need one: the agent's flash work (hashing, copying and sending megabytes per copy
at `--flash-nice`, so heartbeats and the workers keep the cores: agent/flash.py) and the
`unbroken up` log watcher (the asyncio-only etcd client, called from synchronous code:
cli/cluster.py). Coroutines are handed over with `call` from another loop or `call_sync`
from plain code; `stop` lets the loop finish what it runs, shuts its executor and joins.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


# The lowest niceness: a thread asked for it runs at Linux's SCHED_IDLE where it can.
IDLE_NICE = 19


def lower_this_thread(nice: int) -> str:
    """Lower the calling thread's CPU priority (Linux: per thread; threads it starts later
    inherit it); returns what it got ("idle", "nice N", or "" for nothing).

    `nice` >= `IDLE_NICE` asks for SCHED_IDLE: the thread runs only on CPU time no other
    thread of its scheduling group wants, and one that wakes (a training thread back from
    a collective) takes the core at once, where a nice-19 thread first runs out its slice
    (bench-recovery's flash-on/off blocks with the agent's flash thread at nice 19: 0.919,
    0.933, 0.973 of the steps per second; at SCHED_IDLE 0.959, 0.956, 0.993, clusters
    alternated). Unprivileged threads may enter SCHED_IDLE but not leave it. Where it is
    refused (not Linux), and for other values, the nice value; one the thread may not take
    (it runs nicer already) is left as it is.
    """
    if nice <= 0:
        return ""
    if nice >= IDLE_NICE:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
            return "idle"
        except (OSError, AttributeError):
            pass
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)  # this thread only
        return f"nice {os.getpriority(os.PRIO_PROCESS, tid)}"
    except (OSError, AttributeError):
        return ""


class LoopThread:
    """A running event loop on a daemon thread named `name`.

    `nice` > 0 lowers this thread's priority (`lower_this_thread`: 19 is SCHED_IDLE), and
    the threads its loop starts (the `to_thread` pool, threads started from its coroutines)
    inherit it.
    """

    def __init__(self, name: str, nice: int = 0) -> None:
        self.nice = nice
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        if self.nice and not lower_this_thread(self.nice):
            log.warning("loopthread.priority_not_lowered", thread=self._thread.name, nice=self.nice)
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (False once `stop` joined it)."""
        return self._thread.is_alive()

    async def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run `coro` on this thread's loop; awaited from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def call_sync(self, coro: Coroutine[Any, Any, _T], timeout_s: float) -> _T:
        """Run `coro` on this thread's loop and wait for it from plain (non-async) code.

        Raises:
            TimeoutError: it took longer than `timeout_s` (it is cancelled), or whatever
                `coro` raised.
        """
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except BaseException:
            fut.cancel()
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (after what it runs now) and join the thread."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
