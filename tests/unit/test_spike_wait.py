"""A rank that sees its own loss spike waits (bounded) for the driver's hold."""

from __future__ import annotations

import math
import time

import pytest

from unbroken.trainer.spikewait import SpikeWait

pytestmark = pytest.mark.unit


def _calm(w: SpikeWait, n: int = 20) -> None:
    for step in range(1, n + 1):
        assert w.after(step, 4.0 + 0.05 * (step % 3)) is False


def test_a_spike_waits_for_the_hold_and_reports_it() -> None:
    polls: list[float] = []
    flushed: list[int] = []

    def held(timeout_s: float) -> bool:
        polls.append(timeout_s)
        return len(polls) >= 3  # the agent's hold arrives on the third look

    w = SpikeWait(held, lambda: flushed.append(1), wait_s=5.0)
    _calm(w)
    assert polls == [] and flushed == []  # ordinary steps cost no wait
    assert w.after(21, 40.0) is True  # 10x the median: the driver calls it at once
    assert flushed == [1] and len(polls) == 3 and all(0 <= t <= 0.005 for t in polls)
    assert (w.waits, w.holds) == (1, 1)


def test_no_hold_means_training_goes_on_after_the_bounded_wait() -> None:
    w = SpikeWait(lambda t: time.sleep(t) or False, wait_s=0.05)
    _calm(w)
    t0 = time.monotonic()
    assert w.after(21, math.nan) is False
    assert 0.05 <= time.monotonic() - t0 < 1.0
    assert (w.waits, w.holds) == (1, 0)
    # a moderate outlier alone is noise to the driver (it confirms over two steps): no wait
    assert w.after(22, 5.5) is False and w.waits == 1
    assert w.after(23, None) is False


def test_the_baseline_outlives_a_world_but_not_a_restore_far_back() -> None:
    from unbroken.trainer import spikewait

    w = spikewait.shared(lambda t: False, None)
    assert spikewait.shared(lambda t: True, None) is w  # one per process, the new world's reads
    w.detector.reset()
    _calm(w, 30)
    assert len(w.detector._window) == 30
    w.after(5, 4.0)  # a restore 25 steps back: the curve starts again
    assert len(w.detector._window) == 1
