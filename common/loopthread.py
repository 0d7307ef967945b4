"""An asyncio event loop on its own daemon thread, optionally at a lower CPU priority.

Two parts need one: the agent's flash work (hashing, copying and sending megabytes per copy
at `--flash-nice`, so heartbeats and the workers keep the cores: agent/flash.py) and the
`unbroken up` log watcher (the asyncio-only etcd client, called from synchronous code:
cli/cluster.py). Coroutines are handed over with `call` from another loop or `call_sync`
from plain code; `stop` lets the loop finish what it runs, shuts its executor and joins.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


def lower_this_thread(nice: int, *, idle: bool = False) -> str:
    """Lower the calling thread's CPU priority (Linux: per thread; threads it starts later
    inherit it); returns what it got ("idle", "nice N", or "" for nothing).

    `idle` asks for SCHED_IDLE first: the thread runs only on CPU time no other thread of
    its scheduling group wants, and a thread that wakes takes the core at once. Only for
    threads whose stall nobody else in the process waits on: a SCHED_IDLE thread that is
    preempted while it holds the GIL keeps it until a core falls idle, and every thread of
    its process waits (the agent's flash thread at SCHED_IDLE stalled the agent's heartbeats
    past the miss limit on a busy host: false node losses, a failed bench-recovery run).
    The trainer's copy threads do (bench/sessions.py; the training thread takes over a copy
    it waits for, and a GIL held there comes back once the other ranks wait for this one).
    Unprivileged threads may enter SCHED_IDLE but not leave it. Otherwise, or where it is
    refused, the nice value; one the thread may not take (it runs nicer already) is left.
    """
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
            return "idle"
        except (OSError, AttributeError):
            nice = max(nice, 19)
    if nice <= 0:
        return ""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)  # this thread only
        return f"nice {os.getpriority(os.PRIO_PROCESS, tid)}"
    except (OSError, AttributeError):
        return ""


def runqueue_wait_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU since it began
    (Linux `/proc/thread-self/schedstat`, its second field; 0.0 where the kernel keeps no
    such count). A low-priority thread's wall time on a busy host is mostly this wait: it
    costs the work it yielded to nothing."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@functools.cache
def _sched_getcpu() -> Callable[[], int] | None:
    """glibc's `sched_getcpu` (a vDSO read, ~0.1 us through ctypes), or None without it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (None where the C library cannot say)."""
    fn = _sched_getcpu()
    if fn is None:
        return None
    cpu = fn()
    return cpu if cpu >= 0 else None


def pin_this_thread(cpu: int) -> bool:
    """Let the calling thread run only on `cpu` (Linux: this thread alone; threads it starts
    later inherit it). False where refused (a cpuset without that CPU, no such call)."""
    try:
        os.sched_setaffinity(0, {cpu})  # 0: this thread
    except (OSError, AttributeError, ValueError):
        return False
    return True


class LoopThread:
    """A running event loop on a daemon thread named `name`.

    `nice` > 0 lowers this thread's priority to that nice value (`lower_this_thread`; never
    SCHED_IDLE: other threads of the process wait for the GIL it holds), and the threads its
    loop starts (the `to_thread` pool, threads started from its coroutines) inherit it.
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
