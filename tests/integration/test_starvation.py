"""The agent's own starvation figures (agent/starvation.py), read from real /proc texts
and a real event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from unbroken.agent import starvation

pytestmark = pytest.mark.integration

PSI = "some avg10=62.65 avg60=89.59 avg300=78.78 total=508262969\nfull avg10=0.00 avg60=0.00\n"


def test_pressure_and_run_queue_are_parsed_and_missing_ones_say_so() -> None:
    assert starvation.parse_pressure(PSI) == 62.65
    assert starvation.parse_pressure("") == -1.0
    assert starvation.parse_runnable("cpu 1 2 3\nprocs_running 5\nprocs_blocked 0\n") == 5
    assert starvation.parse_runnable("cpu 1 2 3\n") == -1
    assert starvation.cpu_pressure_pct("/nonexistent/pressure") == -1.0
    assert starvation.runnable_per_cpu("/nonexistent/stat") == 0.0
    assert starvation.runnable_per_cpu() >= 0.0  # this host's, whatever it is now


def test_a_blocked_loop_is_seen_late_and_the_figure_is_taken_once() -> None:
    async def go() -> tuple[float, float]:
        lag = starvation.LoopLag(period_s=0.01)
        lag.start()
        await asyncio.sleep(0.05)
        lag.take()
        time.sleep(0.3)  # a synchronous call on the loop: the agent's heartbeat would wait
        await asyncio.sleep(0.05)
        first = lag.take()
        await asyncio.sleep(0.05)
        lag.stop()
        return first, lag.take()

    first, second = asyncio.run(go())
    assert first >= 250.0
    assert second < 250.0


def test_the_real_time_loop_leaves_its_children_normal_tasks() -> None:
    """The agent's loop thread at SCHED_RR; a child it starts (a worker, a standby) and a
    thread it starts are normal tasks (SCHED_RESET_ON_FORK), so they never outrank it."""
    import os
    import subprocess
    import sys
    import threading

    out: dict[str, object] = {}

    def body() -> None:  # on a thread of its own: the test process's main thread stays normal
        why = starvation.realtime_loop()
        if why:
            out["skip"] = why
            return
        out["me"] = os.sched_getscheduler(0)
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
            capture_output=True,
            text=True,
            check=True,
        )
        out["child"] = int(child.stdout)
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        t.start()
        t.join()
        out["thread"] = seen[0]

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "skip" in out:
        pytest.skip(f"no real-time scheduling here: {out['skip']}")
    assert out["me"] & ~os.SCHED_RESET_ON_FORK == os.SCHED_RR
    assert out["child"] == os.SCHED_OTHER and out["thread"] == os.SCHED_OTHER


PROBE = """
import asyncio, contextlib, os, grpc
from unbroken.agent import starvation

async def main():
    ch = grpc.aio.insecure_channel("127.0.0.1:1")
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ch.channel_ready(), 0.3)
    moved = starvation.realtime_grpc_threads()
    rt = []
    for t in os.listdir("/proc/self/task"):
        if os.sched_getscheduler(int(t)) & ~os.SCHED_RESET_ON_FORK == os.SCHED_RR:
            rt.append(open(f"/proc/self/task/{t}/comm").read().strip())
    print(moved, os.sched_getscheduler(0), ",".join(sorted(rt)))
    await ch.close()

asyncio.run(main())
"""


def test_grpc_threads_carrying_heartbeats_are_made_real_time_too() -> None:
    """The threads a gRPC aio channel starts (its I/O, timers, the asyncio poller) are
    moved to SCHED_RR; the process's own main thread is left alone (in a child process,
    so this test process keeps no real-time thread)."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    moved, main = int(out[0]), int(out[1])
    if moved == 0:
        pytest.skip("no real-time scheduling here (or no gRPC threads to move)")
    rt = out[2].split(",")
    assert main == os.SCHED_OTHER
    assert "event_engine" in rt and set(rt) <= {*starvation.GRPC_THREADS, "python"}, rt


BOOST_PROBE = r"""
import os, threading, time
from unbroken.agent import loopguard, starvation

why = starvation.realtime_loop()
if why:
    print("skip", why.replace(" ", "_")); raise SystemExit
ready, done = threading.Event(), threading.Event()
tid = []
def flash():  # a low-priority helper thread, like the agent's flash thread
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    tid.append(threading.get_native_id()); ready.set(); done.wait()
threading.Thread(target=flash, daemon=True).start()
ready.wait()
def state():
    policy = os.sched_getscheduler(tid[0]) & ~os.SCHED_RESET_ON_FORK
    return policy, os.getpriority(os.PRIO_PROCESS, tid[0])
b = loopguard.GilBoost(lag_ms=50, hold_s=10)
b.note(10.0, 100.0); calm = state()
b.note(80.0, 101.0); boosted = state()
b.note(0.0, 105.0); held = state()
b.note(0.0, 111.5); back = state()
print("ok", *[f"{p}:{n}" for p, n in (calm, boosted, held, back)], b.boosts)
done.set()
"""


def test_a_lagging_real_time_loop_lifts_its_other_threads_until_it_is_calm() -> None:
    """A real-time loop that lags waits for the GIL a preempted low-priority thread holds:
    the process's other threads go to SCHED_RR while it lags, and back to their own policy
    and nice value `hold_s` after the last lag (in a child process)."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", BOOST_PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    if out[0] == "skip":
        pytest.skip(f"no real-time scheduling here: {out[1]}")
    calm, boosted, held, back, boosts = out[1:]
    other, rr = os.SCHED_OTHER, os.SCHED_RR
    assert calm == f"{other}:19" and back == f"{other}:19"
    assert boosted.startswith(f"{rr}:") and held.startswith(f"{rr}:")
    assert boosts == "1"
