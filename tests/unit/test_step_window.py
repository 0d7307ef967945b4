"""A rank's straggler window: its steps of the last WINDOW_S seconds, bounded in steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.agent.workers import Worker
from unbroken.common.timing import (
    WINDOW_MIN_STEPS,
    WINDOW_S,
    WINDOW_STEPS,
    StepWindow,
    median_mad,
)
from unbroken.driver.straggler import StragglerConfig

pytestmark = pytest.mark.unit


def _filled(period_s: float, computes: list[float], t0: float = 1000.0) -> StepWindow:
    w = StepWindow()
    for i, c in enumerate(computes):
        w.add(t0 + i * period_s, c, 1.0)
    return w


def test_the_floor_is_the_detectors_min_steps() -> None:
    assert WINDOW_MIN_STEPS == StragglerConfig().min_steps


@pytest.mark.parametrize(
    ("period_s", "expected"),
    [
        (0.01, WINDOW_STEPS),  # 800 steps in 8 s: the cap
        (0.1, int(WINDOW_S / 0.1)),  # between: the steps of the last 8 s
        (0.4, WINDOW_MIN_STEPS),  # 21 steps in 8 s: the floor
    ],
)
def test_the_window_is_the_recent_seconds_within_its_bounds(period_s: float, expected: int) -> None:
    w = _filled(period_s, [10.0] * 300)
    now = 1000.0 + 299.5 * period_s
    assert w.recent(now) == expected
    assert w.summary(now)[4] == expected


def test_a_short_history_is_all_of_it() -> None:
    w = _filled(0.4, [10.0] * 7)
    assert w.recent(1000.0 + 6 * 0.4) == 7
    assert len(StepWindow()) == 0 and StepWindow().summary(5.0) == (0.0, 0.0, 0.0, 0.0, 0)


def test_old_steps_leave_the_window_after_a_pause() -> None:
    # 40 steps at 0.1 s, a 30 s pause (an incident), then 5 more: the floor keeps 32 of them
    w = _filled(0.1, [10.0] * 40)
    for i in range(5):
        w.add(1034.0 + i * 0.1, 20.0, 1.0)
    assert w.recent(1034.5) == WINDOW_MIN_STEPS
    mid, _, _, _, n = w.summary(1034.5)
    assert (mid, n) == (10.0, WINDOW_MIN_STEPS)


def test_slow_steps_move_the_median_within_half_the_floor() -> None:
    """The drill's straggler: ~0.4 s steps, 20 % slower from step 64. With the window of a
    fixed 128 steps the (upper) median moved after 64 slow steps; now after 16."""
    healthy = [10.0 + 0.01 * (i % 7) for i in range(64)]
    for slow in range(1, 40):
        w = _filled(0.4, healthy + [12.0] * slow)
        mid = w.summary(1000.0 + (63 + slow) * 0.4)[0]
        if mid >= 12.0:
            break
    assert slow == WINDOW_MIN_STEPS // 2


def test_the_median_and_mad_are_of_the_recent_steps_only() -> None:
    w = StepWindow()
    for i in range(100):  # 0.1 s steps: the last 80 are within 8 s
        w.add(100.0 + i * 0.1, 50.0 if i < 19 else 10.0 + (i % 3), float(i % 2))
    mid, mad, wait, wait_mad, n = w.summary(100.0 + 99.5 * 0.1)
    assert n == 80
    assert (mid, mad) == median_mad(10.0 + (i % 3) for i in range(20, 100))
    assert (wait, wait_mad) == median_mad(float(i % 2) for i in range(20, 100))


def test_a_workers_heartbeat_reports_the_recent_window(tmp_path: Path) -> None:
    w = Worker(0, 0, tmp_path / "w.log")
    timings = {"compute": 300.0, "collective_wait": 100.0}
    for i in range(1, 201):  # 0.4 s steps: the floor
        w.on_step(i, 1.0, 400.0, now=100.0 + i * 0.4, timings_ms=timings)
    s = w.status(100.0 + 200 * 0.4)
    assert (s.window_steps, s.compute_ms, s.wait_ms) == (WINDOW_MIN_STEPS, 300.0, 100.0)
