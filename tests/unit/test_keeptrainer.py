"""trainer/keeptrainer.py: which trainers are kept for the next world, and what happens when
one cannot be pointed at it. (The engine's own leave and rejoin run over real gloo worlds in
tests/integration/test_injob_recovery.py, which checks every loss against an uninterrupted
run.)"""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.trainer import keeptrainer

pytestmark = pytest.mark.unit


class _Trainer:
    def __init__(self, leave: str | None = None, rejoin: str | None = None) -> None:
        self.leave, self.rejoin = leave, rejoin
        self.closed = self.afresh = False
        self.rejoined_with: Any = None

    def leave_world(self) -> str | None:
        return self.leave

    def rejoin_world(self, config: Any) -> str | None:
        self.rejoined_with = config
        return self.rejoin

    def start_afresh(self) -> None:
        self.afresh = True

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _nothing_kept() -> Any:
    keeptrainer._kept.clear()
    yield
    keeptrainer._kept.clear()


def test_a_trainer_leaving_by_held_is_kept_and_taken_in_the_next_world() -> None:
    t = _Trainer()
    assert keeptrainer.keep(t, leaving=True)
    assert keeptrainer.take("config") is t
    assert t.rejoined_with == "config" and not t.closed
    assert keeptrainer.take("config") is None  # taken once


def test_a_trainer_ending_otherwise_or_unable_to_leave_is_not_kept() -> None:
    assert not keeptrainer.keep(_Trainer(), leaving=False)
    assert not keeptrainer.keep(_Trainer(leave="pipelining holds groups"), leaving=True)
    assert not keeptrainer.keep(object(), leaving=True)  # not Rejoinable
    assert keeptrainer.take("config") is None


def test_a_kept_trainer_that_cannot_rejoin_is_closed_and_rebuilt() -> None:
    t = _Trainer(rejoin="another place: rank 1 of 4")
    assert keeptrainer.keep(t, leaving=True)
    assert keeptrainer.take("config") is None
    assert t.closed


def test_a_rejoin_whose_groups_differ_ends_the_worker() -> None:
    class Mismatch(_Trainer):
        def rejoin_world(self, config: Any) -> str | None:
            raise RuntimeError("the new world's groups differ from the kept trainer's")

    assert keeptrainer.keep(Mismatch(), leaving=True)
    with pytest.raises(RuntimeError, match="groups differ"):
        keeptrainer.take("config")


def test_a_taken_trainer_starts_afresh_when_its_first_restore_found_nothing() -> None:
    t, other = _Trainer(), _Trainer()
    assert keeptrainer.keep(t, leaving=True) and keeptrainer.take("config") is t
    keeptrainer.restored(other, False)  # not the taken one: nothing happens
    assert not other.afresh and not t.afresh
    keeptrainer.restored(t, False)
    assert t.afresh
    t.afresh = False
    keeptrainer.restored(t, False)  # its first restore only
    assert not t.afresh
