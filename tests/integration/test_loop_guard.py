"""The loop guard (agent/loopguard.py): a real real-time loop kept waiting for the GIL by a
preempted nice-19 thread, on a host whose cores are busy, is un-blocked by the guard's
process; the guard gives the thread its priority back when stopped and exits with the
process it guards. Real processes and the real scheduler; skips without real-time
scheduling (no CAP_SYS_NICE)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

# The agent's arrangement in small: its loop at SCHED_RR stamping each wake-up (LoopLag,
# every 20 ms) for a guard, and a background thread at nice 19 that holds the GIL often
# (pure Python), as the persister does while it writes a checkpoint.
PROBE = r"""
import asyncio, os, sys, threading, time
from unbroken.agent import loopguard, starvation

why = starvation.realtime_loop()
if why:
    print("skip", why.replace(" ", "_"), flush=True); raise SystemExit
tid = []
def busy():
    tid.append(threading.get_native_id())
    os.setpriority(os.PRIO_PROCESS, tid[0], 19)
    x = 0
    while True:
        for i in range(10000):
            x += i * i
threading.Thread(target=busy, daemon=True).start()

def policy():
    return os.sched_getscheduler(tid[0]) & ~os.SCHED_RESET_ON_FORK

async def main():
    lag = starvation.LoopLag(0.02)
    guard = loopguard.LoopGuard.start(lag.period_s)
    lag.stamp = guard.stamp
    lag.start()
    while not guard.ready():
        await asyncio.sleep(0.01)
    print("guard", guard.proc.pid, flush=True)
    seen_rr = False
    t0 = time.monotonic()
    while time.monotonic() - t0 < float(sys.argv[1]) and not (guard.boosts and seen_rr):
        await asyncio.sleep(0.05)
        seen_rr = seen_rr or policy() == os.SCHED_RR
    boosts = guard.boosts
    if sys.argv[2] == "stop":
        guard.stop()
        back = f"{policy()}:{os.getpriority(os.PRIO_PROCESS, tid[0])}"
    else:
        back = "kept"
    print("done", boosts, int(seen_rr), back, flush=True)
    if sys.argv[2] == "wait":
        await asyncio.sleep(600)  # killed by the test

asyncio.run(main())
"""

HOG = "while True: pass"


@pytest.fixture
def busy_cores() -> object:
    """Every core busy with a normal task, and one more: a nice-19 thread waits for CPU."""
    n = (os.cpu_count() or 2) + 1
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]
    yield hogs
    for h in hogs:
        h.kill()
        h.wait()


def _probe(mode: str, log: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, "60", mode],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _lines(log: Path) -> dict[str, list[str]]:
    out = {}
    for line in log.read_text().splitlines():
        parts = line.split()
        if parts:
            out[parts[0]] = parts[1:]
    return out


def test_the_guard_lifts_the_thread_that_holds_the_loop_and_gives_its_priority_back(
    tmp_path: Path, busy_cores: object
) -> None:
    log = tmp_path / "probe.log"
    p = _probe("stop", log)
    try:
        until(lambda: p.poll() is not None, 60, "the probe to finish", lambda: log.read_text())
    finally:
        p.kill()
    got = _lines(log)
    if "skip" in got:
        pytest.skip(f"no real-time scheduling here: {got['skip'][0]}")
    assert p.returncode == 0, log.read_text()
    boosts, seen_rr, back = got["done"]
    # the loop waited for the GIL the busy nice-19 thread held: the guard's process saw its
    # stamp go stale and moved the thread to SCHED_RR, and stopping it gave the thread its
    # own policy and nice value back
    assert int(boosts) >= 1 and seen_rr == "1", log.read_text()
    assert back == f"{os.SCHED_OTHER}:19"


def test_the_guard_exits_with_the_process_it_guards(tmp_path: Path, busy_cores: object) -> None:
    log = tmp_path / "probe.log"
    p = _probe("wait", log)
    try:
        got = until(
            lambda: (g := _lines(log)) and ("done" in g or "skip" in g) and g,
            60,
            "the probe to run",
            lambda: log.read_text(),
        )
        if "skip" in got:
            pytest.skip(f"no real-time scheduling here: {got['skip'][0]}")
        guard = int(got["guard"][0])
        os.kill(p.pid, signal.SIGKILL)  # the agent dies however it dies
        p.wait()
        until(lambda: not _alive(guard), 10, "the guard to exit after its process died")
    finally:
        p.kill()


def _alive(pid: int) -> bool:
    """`pid` runs (not a zombie: the probe's child is reparented and reaped by init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
