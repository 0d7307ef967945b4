"""How starved the agent is: its own event loop's lag and the host's CPU pressure.

A heartbeat that arrives late says nothing about why. The driver reads these figures from
the node's heartbeats (`Heartbeat.loop_lag_ms`, `late_ms`, `cpu_pressure_pct`,
`runnable_per_cpu`) before it declares the node lost: a node whose last heartbeats said it
was starved, and whose stream is still open, is given a grace (driver/detectors.py
`silent`), as members aware of their own health are in HashiCorp's Lifeguard.

- `LoopLag`: a task that wakes every `period_s` and keeps the largest lateness of its
  wake-ups since the last heartbeat took it: the agent's own event loop, starved of CPU or
  blocked by a synchronous call, is late to wake.
- `cpu_pressure_pct`: the kernel's pressure stall information (`/proc/pressure/cpu`, "some
  avg10": the share of the last 10 s in which a runnable task waited for a CPU); -1 where
  the kernel has no PSI.
- `realtime_loop`: the agent's event loop thread (heartbeats, commands) at SCHED_RR
  priority 1, as cluster heartbeat daemons (corosync) run theirs. Without it, the agent's
  heartbeats waited behind its own children's start-up: Linux's autogroup shares the CPU
  among sessions first, and the workers and warm standbys share the agent's session, so a
  standby's torch import or a restarted worker's spent the session's share and the agent
  woke late (bench/agent_loop_lag.py, two standbys importing at nice 5 on the 2-core host
  at load 17-27: the loop's largest lag 59-820 ms, median of 3 runs 90 ms, p99 47-319 ms;
  at SCHED_RR 1.4-14 ms, p99 1.4 ms).
  `SCHED_RESET_ON_FORK`: its children and threads start as normal tasks.
- `runnable_per_cpu`: runnable threads now (`/proc/stat` procs_running, less this reader)
  per CPU this process may use: a sudden restart storm shows here before in avg10.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable

from unbroken.agent.loopguard import RT_PRIORITY

PRESSURE_PATH = "/proc/pressure/cpu"
STAT_PATH = "/proc/stat"


class LoopLag:
    """The largest lateness (ms) of this loop's wake-ups since the last `take`."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        # each wake-up's time goes here too: the loop guard's page (agent/loopguard.py)
        self.stamp: Callable[[float], None] | None = None
        self._max_ms = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        due = time.monotonic() + self.period_s
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            if self.stamp is not None:
                self.stamp(now)
            late_ms = (now - due) * 1000.0
            if late_ms > self._max_ms:
                self._max_ms = late_ms
            due = now + self.period_s

    def note(self, late_ms: float) -> None:
        """Count a lateness seen by another timer of the loop (the heartbeat's own)."""
        self._max_ms = max(self._max_ms, late_ms)

    def take(self) -> float:
        out, self._max_ms = self._max_ms, 0.0
        return out


def realtime_loop(priority: int = RT_PRIORITY) -> str:
    """Put the calling thread at SCHED_RR `priority`, its children and threads reset to
    normal; "" when done, else why not (no CAP_SYS_NICE / RLIMIT_RTPRIO, a container that
    gives no real-time budget): the agent then runs as a normal task."""
    policy = getattr(os, "SCHED_RR", None)
    reset = getattr(os, "SCHED_RESET_ON_FORK", None)
    if policy is None or reset is None:
        return "no SCHED_RR on this platform"
    try:
        os.sched_setscheduler(0, policy | reset, os.sched_param(priority))
    except OSError as e:
        return f"{e.strerror or e} (needs CAP_SYS_NICE or RLIMIT_RTPRIO >= {priority})"
    return ""


#: gRPC's own threads that carry the agent's heartbeats: its I/O ("event_engine", with the
#: "lifeguard" that watches them), its timers, and the asyncio poller (a Python thread).
GRPC_THREADS = frozenset({"event_engine", "lifeguard", "grpc_global_tim"})
GRPC_PY_THREADS = ("_poll_wrapper",)


def realtime_grpc_threads(priority: int = RT_PRIORITY) -> int:
    """Put gRPC's threads of this process at SCHED_RR `priority` too (children reset),
    those not there yet; returns how many were moved. A heartbeat the real-time loop wrote
    still waited for these to run: a spare agent whose loop lagged 1 ms was silent 2.5 s
    while its registration self-check imported torch beside it at load 22."""
    policy = getattr(os, "SCHED_RR", None)
    reset = getattr(os, "SCHED_RESET_ON_FORK", None)
    if policy is None or reset is None:
        return 0
    tids = {t.native_id for t in threading.enumerate() if t.name.endswith(GRPC_PY_THREADS)}
    try:
        names = os.listdir("/proc/self/task")
    except OSError:
        return 0
    moved = 0
    for t in names:
        tid = int(t)
        if tid not in tids:
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    if f.read().strip() not in GRPC_THREADS:
                        continue
            except OSError:
                continue
        try:
            if os.sched_getscheduler(tid) & ~reset == policy:
                continue
            os.sched_setscheduler(tid, policy | reset, os.sched_param(priority))
            moved += 1
        except OSError:
            continue
    return moved


def parse_pressure(text: str) -> float:
    """ "some avg10" of a `/proc/pressure/cpu` text, -1.0 when it is not there."""
    for line in text.splitlines():
        if line.startswith("some "):
            for part in line.split()[1:]:
                key, _, value = part.partition("=")
                if key == "avg10":
                    with contextlib.suppress(ValueError):
                        return float(value)
    return -1.0


def cpu_pressure_pct(path: str = PRESSURE_PATH) -> float:
    try:
        with open(path) as f:
            return parse_pressure(f.read())
    except OSError:
        return -1.0


def parse_runnable(stat_text: str) -> int:
    """procs_running of a `/proc/stat` text (-1 when absent)."""
    for line in stat_text.splitlines():
        if line.startswith("procs_running "):
            with contextlib.suppress(ValueError):
                return int(line.split()[1])
    return -1


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def runnable_per_cpu(path: str = STAT_PATH, cpus: int | None = None) -> float:
    """Runnable threads per usable CPU, not counting this reader (0.0 when unknown)."""
    try:
        with open(path) as f:
            n = parse_runnable(f.read())
    except OSError:
        return 0.0
    if n < 0:
        return 0.0
    return max(0, n - 1) / (cpus or usable_cpus())
