"""The loop guard: a small real-time process that ends the agent loop's waits for the GIL.

The agent's event loop (heartbeats, commands) runs at SCHED_RR (agent/starvation.py
`realtime_loop`), yet a line of Python needs the GIL, and the agent's background threads
hold it now and then: the persister at nice 19, the flash thread at `--flash-nice`.
Preempted by busy workers while it holds the GIL, such a thread keeps it until the
scheduler runs it again, and the real-time loop waits that long. In-process, the loop sees
that lag only once it holds the GIL again, after the heartbeat it owed (`GilBoost` in the
loop reacted that late): in a clean-clone CI run (2026-12-06 09:07 UTC, `make run`'s drill
in test_up) a world agent was silent 516 ms while its persister wrote the job's first
checkpoint beside the workers' first steps and a standby's torch import, was declared lost,
and a spare took its place.

The guard is another process, with a GIL of its own. The loop stamps the time of each of
its wake-ups (every 20 ms, `LoopLag`) into a page both share (a memfd); the guard, at
SCHED_RR priority 2, looks every `period` and, when the stamp is older than the loop's own
period plus `lag_ms`, moves the agent's normal threads to SCHED_RR 1 (`GilBoost`: the
holder runs at once and lets the GIL go) until `hold_s` pass without a stall. A stamp of 0
means "not watched" (the loop has not started it yet). The guard exits when the agent does.
`bench/loop_guard.py` measures the loop's lag with and without it.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import signal
import struct
import subprocess
import sys
import time

RT_PRIORITY = 1  # SCHED_RR's lowest: above every normal task, below the kernel's own
STAMP = struct.Struct("d")  # offset 0: the loop's last wake-up (monotonic s; 0: not watched)
BOOSTS = struct.Struct("Q")  # offset 8: boosts so far (written by the guard only)
PAGE_BYTES = 16
SCHED_RR = getattr(os, "SCHED_RR", -1)
RESET = getattr(os, "SCHED_RESET_ON_FORK", 0)
GUARD_PRIORITY = RT_PRIORITY + 1  # above the threads it boosts: it must run to boost them
PERIOD_S = 0.01
LAG_MS = 50.0
HOLD_S = 10.0


def is_realtime(pid: int = 0) -> bool:
    """Whether process `pid` (0: the calling thread) runs at SCHED_RR."""
    try:
        return SCHED_RR >= 0 and os.sched_getscheduler(pid) & ~RESET == SCHED_RR
    except OSError:
        return False


class GilBoost:
    """The agent's other threads at the loop's real-time priority while its loop lags.

    A real-time loop still needs the GIL to run a line of Python, and the agent's other
    threads hold it now and then: its flash thread (replication, persistence, ring scans)
    runs at nice 19 so that this work fills the cores' idle time. Preempted while it holds
    the GIL on an overloaded host, such a thread keeps it until the scheduler gives it a
    core again, and the loop waits that long: in a 20-minute run under `stress-ng --stream
    8` at load 60-70 a world agent whose last heartbeat said its loop lagged 89 ms was then
    silent 2.5 s (the flash thread, persisting a checkpoint, took 8 s for 1.5 MB) and was
    declared lost. A loop lag of `lag_ms` at real-time priority is that inversion's sign (a
    real-time thread waits for no normal task's CPU), so `note` moves every normal thread of
    the process (children reset) to SCHED_RR `priority` until `hold_s` pass without one;
    they then get their own policy and nice back. Their work then runs ahead of the
    workers only while the agent's own loop is being held up. In the agent the loop guard
    (agent/loopguard.py) runs it from another process, `pid` the agent's: the loop itself
    sees its lag only once it holds the GIL again, after the heartbeat it owed."""

    def __init__(
        self,
        lag_ms: float = 50.0,
        hold_s: float = 10.0,
        priority: int = RT_PRIORITY,
        pid: int | str = "self",
    ):
        self.lag_ms, self.hold_s, self.priority = lag_ms, hold_s, priority
        self.tasks = f"/proc/{pid}/task"
        self.until = 0.0  # boosted until then (monotonic; 0: not boosted)
        self.saved: dict[int, tuple[int, int]] = {}  # tid -> (policy, nice) before the boost
        self.boosts = 0

    def note(self, lag_ms: float, now: float) -> None:
        """One heartbeat's loop lag at monotonic `now`: boost, keep, or restore."""
        if lag_ms >= self.lag_ms:
            if not self.until:
                self.boosts += 1
            self.until = now + self.hold_s
            self._boost()  # again each time: threads started since are boosted too
        elif self.until and now >= self.until:
            self.restore()

    def _boost(self) -> None:
        if SCHED_RR < 0 or not RESET:
            return
        try:
            tids = [int(t) for t in os.listdir(self.tasks)]
        except OSError:
            return
        for tid in tids:
            try:
                was = os.sched_getscheduler(tid) & ~RESET
                if was in (SCHED_RR, getattr(os, "SCHED_FIFO", -1)):
                    continue  # real-time already (the loop, gRPC's threads)
                nice = os.getpriority(os.PRIO_PROCESS, tid)
                os.sched_setscheduler(tid, SCHED_RR | RESET, os.sched_param(self.priority))
                self.saved[tid] = (was, nice)
            except OSError:
                continue  # gone, or not permitted: it stays as it was

    def restore(self) -> None:
        """Every boosted thread back to its own policy and nice."""
        for tid, (policy, nice) in self.saved.items():
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        self.saved.clear()
        self.until = 0.0


class LoopGuard:
    """The agent's side: the shared page and the guard process (`start`)."""

    def __init__(self, proc: subprocess.Popen[bytes], fd: int, page: mmap.mmap) -> None:
        self.proc, self._fd, self._page = proc, fd, page
        self._boosts = 0

    @classmethod
    def start(
        cls, loop_period_s: float, lag_ms: float = LAG_MS, hold_s: float = HOLD_S
    ) -> LoopGuard:
        """Start the guard of this process's loop; OSError when it cannot be started."""
        fd = os.memfd_create("unbroken-loopguard", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            page = mmap.mmap(fd, PAGE_BYTES)
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "unbroken.agent.loopguard",
                    str(os.getpid()),
                    str(fd),
                    "--loop-period-s",
                    str(loop_period_s),
                    "--lag-ms",
                    str(lag_ms),
                    "--hold-s",
                    str(hold_s),
                ],
                pass_fds=[fd],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the agent's group is the agent's
            )
        except BaseException:
            os.close(fd)
            raise
        out = cls(proc, fd, page)
        out.stamp(time.monotonic())  # watched from now: the caller's loop is running
        return out

    def stamp(self, now: float) -> None:
        """The loop woke at monotonic `now` (0: stop watching it)."""
        if not self._page.closed:
            STAMP.pack_into(self._page, 0, now)

    def ready(self) -> bool:
        """Whether the guard runs at its real-time priority (it sets that itself)."""
        return is_realtime(self.proc.pid)

    @property
    def boosts(self) -> int:
        """Boosts so far (as of `stop`, once stopped)."""
        if not self._page.closed:
            self._boosts = int(BOOSTS.unpack_from(self._page, 8)[0])
        return self._boosts

    def stop(self) -> None:
        """End the guard (its boosted threads get their own priority back)."""
        if self._page.closed:
            return
        self.stamp(0.0)
        _ = self.boosts
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2.0)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._page.close()
        os.close(self._fd)


def guard(
    pid: int,
    page: mmap.mmap,
    loop_period_s: float,
    lag_ms: float = LAG_MS,
    hold_s: float = HOLD_S,
    period_s: float = PERIOD_S,
) -> None:
    """Watch process `pid`'s loop through `page` until `pid` is gone (not our parent)."""
    boost = GilBoost(lag_ms=lag_ms, hold_s=hold_s, pid=pid)
    limit_s = loop_period_s + lag_ms / 1000.0
    boosts = 0
    try:
        while os.getppid() == pid:
            time.sleep(period_s)
            (woke,) = STAMP.unpack_from(page, 0)
            now = time.monotonic()
            stalled = woke > 0 and now - woke > limit_s
            boost.note(lag_ms if stalled else 0.0, now)
            if boost.boosts != boosts:
                boosts = boost.boosts
                BOOSTS.pack_into(page, 8, boosts)
    finally:
        boost.restore()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unbroken.agent.loopguard")
    ap.add_argument("pid", type=int)
    ap.add_argument("fd", type=int)
    ap.add_argument("--loop-period-s", type=float, required=True)
    ap.add_argument("--lag-ms", type=float, default=LAG_MS)
    ap.add_argument("--hold-s", type=float, default=HOLD_S)
    ns = ap.parse_args(argv)
    if SCHED_RR < 0:
        print("loop guard: no SCHED_RR on this platform", file=sys.stderr)
        return 2
    try:
        os.sched_setscheduler(0, SCHED_RR | RESET, os.sched_param(GUARD_PRIORITY))
    except OSError as e:
        print(f"loop guard: not real-time ({e.strerror or e})", file=sys.stderr)
        return 2
    page = mmap.mmap(ns.fd, PAGE_BYTES)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # ...and the boosted threads back
    with contextlib.suppress(KeyboardInterrupt):
        guard(ns.pid, page, ns.loop_period_s, ns.lag_ms, ns.hold_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
