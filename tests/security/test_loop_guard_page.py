"""The loop guard's shared page (agent/loopguard.py) read as hostile input.

The page is a memfd the agent passes to its guard alone (close-on-exec: its workers do not
inherit it); a process of the agent's own user could still open it through /proc. Whatever
it writes there, the guard compares one float with the clock: NaN, infinities, negative and
future stamps never read as a stall, so no thread is lifted for them; a real stale stamp is
(the guard works), and stopping the guard gives the threads back. Real guard process;
skips without real-time scheduling."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest

from unbroken.agent import loopguard
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

HOSTILE = [math.nan, math.inf, -math.inf, -1.0, 1e308, -1e308]


def test_garbage_stamps_lift_nothing_and_a_stale_one_does() -> None:
    stop = threading.Event()
    tid: list[int] = []

    def idle() -> None:  # a normal thread of this process: what a boost would lift
        tid.append(threading.get_native_id())
        stop.wait()

    t = threading.Thread(target=idle, daemon=True)
    t.start()
    guard = loopguard.LoopGuard.start(0.02)
    guard.stamp(0.0)  # not watched: this test has no loop to stamp it
    try:
        until(lambda: guard.ready() or guard.proc.poll() is not None, 30, "the guard to start")
        if not guard.ready():
            pytest.skip("no real-time scheduling here: the guard exited")
        for bad in HOSTILE:
            guard.stamp(bad)
            time.sleep(0.15)  # the guard looks every 10 ms; a stall is 70 ms old
            assert guard.boosts == 0, bad
            assert not loopguard.is_realtime(tid[0]), bad
        guard.stamp(time.monotonic() - 1.0)  # a loop silent for a second: lifted
        until(lambda: guard.boosts == 1, 10, "the guard to lift the threads")
        assert loopguard.is_realtime(tid[0])
    finally:
        guard.stop()
        stop.set()
    assert not loopguard.is_realtime(tid[0]) and os.sched_getscheduler(tid[0]) == os.SCHED_OTHER
