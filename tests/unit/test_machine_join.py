"""A registration while the job has not started decides without a draft, and decides the
same as the full machine does (the draft copied the whole state per registration)."""

from __future__ import annotations

import pytest

from unbroken.driver import machine as m
from unbroken.driver import state as statelib
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def _reg(node: str, epoch: int = 1, *, spare: bool = False) -> ev.Event:
    return ev.Event(
        event_id=f"r-{node}-{epoch}",
        node_registered=ev.NodeRegistered(node_id=node, epoch=epoch, spare=spare, num_workers=2),
    )


def _states() -> list[ev.JobState]:
    s = statelib.initial("job")
    events = [_reg(f"n{i}") for i in range(6)]
    events += [
        ev.Event(node_lost=ev.NodeLost(node_id="n1", epoch=1)),
        ev.Event(node_evicted=ev.NodeEvicted(node_id="n2")),
        _reg("n3", 2, spare=True),
    ]
    for i, e in enumerate(events, 1):
        e.seq = i
    out = [s]
    for e in events:
        s = statelib.apply(s, e)
        out.append(s)
    return out


@pytest.mark.parametrize(
    "obs",
    [_reg("n0"), _reg("n0", 2), _reg("n1", 2), _reg("n2", 3), _reg("new"), _reg("sp", spare=True)],
)
def test_a_registration_before_the_start_decides_as_the_full_machine(
    obs: ev.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = m.Policy()
    for s in _states():
        assert s.phase == ev.PHASE_STARTING
        fast = m.decide(s, obs, policy)
        with monkeypatch.context() as mp:
            mp.setattr(m, "_JOINING", ())  # the full machine: a draft, _react, _settle
            full = m.decide(s, obs, policy)
        assert fast == full
        assert fast.events == (obs,) and fast.actions == ()
