"""A node's step timing in six numbers, from its ranks' windows.

The agent summarises its running ranks into `Heartbeat.timing` every heartbeat, and the
driver's straggler sweep (driver/straggler.py) reads that summary: six fields per node
rather than every rank's, which keeps the sweep O(nodes) in protobuf reads. The driver
computes the same summary itself from `Heartbeat.workers` when a sender leaves it out.

Each rank's window (`StepWindow`) is its recent steps: those of the last `WINDOW_S`
seconds, but never fewer than `WINDOW_MIN_STEPS` (the detector's `min_steps`) nor more than
`WINDOW_STEPS`. A window of a fixed 128 steps shifted its median only once a slow node's
slow steps were half of it: with the drill's 0.4 s steps a 20 % straggler was named 26 s
after it began, 64 of its steps; bounded by time, a short step still fills a long window
(the detector's precision for small slowdowns) and a long one shifts within seconds.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable

from unbroken.proto import driver_pb2 as dpb

WINDOW_STEPS = 128  # the most steps a rank's reported compute / wait medians stand for
WINDOW_MIN_STEPS = 32  # ...the fewest (StragglerConfig.min_steps: judged from there)
WINDOW_S = 8.0  # ...and between the two, the steps of this many recent seconds


def median_mad(xs: Iterable[float]) -> tuple[float, float]:
    """The (upper) median of `xs` and their median absolute deviation from it; zeros when
    empty."""
    ordered = sorted(xs)
    if not ordered:
        return 0.0, 0.0
    mid = ordered[len(ordered) // 2]
    return mid, statistics.median(abs(x - mid) for x in ordered)


class StepWindow:
    """One rank's recent per-step compute and collective-wait times (ms), with when each
    came; the straggler detector's input."""

    def __init__(self) -> None:
        self._steps: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=WINDOW_STEPS
        )  # (monotonic time, compute, wait)

    def add(self, now: float, compute_ms: float, wait_ms: float) -> None:
        self._steps.append((now, compute_ms, wait_ms))

    def __len__(self) -> int:
        return len(self._steps)

    def recent(self, now: float) -> int:
        """How many of the newest steps the window stands for at `now`."""
        since, n = now - WINDOW_S, 0
        for t, _, _ in reversed(self._steps):
            if t < since:
                break
            n += 1
        return max(n, min(len(self._steps), WINDOW_MIN_STEPS))

    def summary(self, now: float) -> tuple[float, float, float, float, int]:
        """(compute median, its MAD, wait median, its MAD, steps) over the recent steps."""
        n = self.recent(now)
        tail = list(self._steps)[len(self._steps) - n :]
        mid, mad = median_mad(c for _, c, _ in tail)
        wait, wait_mad = median_mad(w for _, _, w in tail)
        return mid, mad, wait, wait_mad, n


def node_timing(workers: Iterable[dpb.WorkerStatus]) -> dpb.NodeTiming | None:
    """The upper medians over the running ranks with a window of each rank's compute and
    wait and their MADs, the shortest window and a generation that changes with any rank's restart;
    None when no rank has a window."""
    compute, mad, wait, wait_mad = [], [], [], []
    generation, steps = 0, 1 << 30
    running = dpb.WORKER_STATE_RUNNING
    for w in workers:
        if w.state == running and w.window_steps:
            compute.append(w.compute_ms)
            mad.append(w.compute_mad_ms)
            wait.append(w.wait_ms)
            wait_mad.append(w.wait_mad_ms)
            generation += w.restarts * 1_000_003 + w.pid
            steps = min(steps, w.window_steps)
    if not compute:
        return None
    mid = len(compute) // 2  # the upper median: one of the ranks' own values
    return dpb.NodeTiming(
        generation=generation,
        compute_ms=sorted(compute)[mid],
        mad_ms=sorted(mad)[mid],
        wait_ms=sorted(wait)[mid],
        wait_mad_ms=sorted(wait_mad)[mid],
        window_steps=steps,
    )
