"""Which saves a worker marks for persistence (`PersistClock`)."""

from __future__ import annotations

import pytest

from unbroken.recovery.lifecycle import persist_steps
from unbroken.trainer import persistclock
from unbroken.trainer.persistclock import PersistClock

pytestmark = pytest.mark.unit


class FakeTime:
    def __init__(self, step_s: float) -> None:
        self.t, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.t += self.step_s
        return self.t


def persisted(
    clock: PersistClock, first: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    monkeypatch.setattr(persistclock.time, "perf_counter", FakeTime(0.125))
    return [s for s in range(first, first + n) if clock.due(s)]


def test_a_fresh_job_persists_its_first_save_then_one_every_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = PersistClock(2.5, agree=lambda wish: wish)  # 2.5 s at 0.125 s a step: every 20 steps
    got = persisted(clock, 1, 100, monkeypatch)
    assert got[0] == 1 and clock.every_steps == 20
    assert [s for s in got if s > 1] == [20, 40, 60, 80, 100]


def test_a_restored_process_does_not_persist_its_first_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = PersistClock(2.5, agree=lambda wish: wish, persist_first=False)
    got = persisted(clock, 41, 100, monkeypatch)
    assert got == [60, 80, 100, 120, 140]  # the interval's steps only: no commit per restart


def test_the_ranks_take_the_most_frequent_wish(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = PersistClock(2.5, agree=lambda wish: min(wish, 10))  # a slower rank wants 10
    persisted(clock, 1, 60, monkeypatch)
    assert clock.every_steps == 10


def test_the_interval_stays_put_while_step_times_wobble(monkeypatch: pytest.MonkeyPatch) -> None:
    """Persisted steps are the interval's multiples: re-derived from each re-measured step
    time (338, 375, 346 steps) it hit few of them. Four values an octave, moved only past
    30 %: the interval stays, and a job as fast on another restart picks the same one."""
    wishes = iter([391, 338, 375, 346, 560])
    clock = PersistClock(110.0, agree=lambda wish: next(wishes))
    persisted(clock, 1, 8 + 3 * 128, monkeypatch)  # agreements at calls 8, 136, 264, 392
    assert clock.every_steps == 384  # 391 rounded down; 338, 375, 346 within 30 %
    persisted(clock, 393, 128, monkeypatch)  # the fifth, at call 520: steps got a third shorter
    assert clock.every_steps == 512
    assert [persist_steps(0, w) for w in (5, 20, 391, 400, 2500)] == [5, 20, 384, 384, 2048]
