"""The decider seam (driver/decider.py) and the shell's performers (driver/loop.py)."""

from __future__ import annotations

import asyncio
import inspect
import typing

import pytest

from unbroken.driver import machine
from unbroken.driver import state as statelib
from unbroken.driver.decider import Decision, RecordOnly
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.journal import Journal
from unbroken.driver.loop import PERFORMERS, Observation, RecoveryLoop, Settle, StartJob
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def test_every_action_the_machine_emits_has_a_performer() -> None:
    """Walk `machine.Action`: each type is performed by a coroutine of the recovery loop
    (an action emitted and left unperformed would be a decision nobody carries out)."""
    actions = set(typing.get_args(machine.Action))
    assert len(actions) >= 7, actions
    assert actions == set(PERFORMERS), actions ^ set(PERFORMERS)
    for kind, performer in PERFORMERS.items():
        assert inspect.iscoroutinefunction(performer), kind
        assert getattr(RecoveryLoop, performer.__name__) is performer, kind


def test_the_loop_decides_every_kind_of_observation() -> None:
    """`RecoveryLoop.decide` takes a typed union; each member has its own branch."""
    assert set(typing.get_args(Observation)) == {ev.Event, machine.Paused, Settle, StartJob}
    source = inspect.getsource(RecoveryLoop.decide)
    for kind in ("ev.Event", "machine.Paused", "Settle"):
        assert f"isinstance(observation, {kind})" in source, kind


def _evict(cause: str, reason: str = "disk died") -> ev.Event:
    return ev.Event(
        event_id="op1",
        cause=cause,
        operator_action=ev.OperatorAction(action="evict", target="n1", who="alice", reason=reason),
    )


def test_record_only_evicts_at_once_on_an_operators_word() -> None:
    state = statelib.initial("j")
    d = RecordOnly().decide(state, _evict("operator"))
    assert [e.WhichOneof("payload") for e in d.events] == ["operator_action", "node_evicted"]
    evicted = d.events[1]
    assert evicted.cause == "op1"
    assert (evicted.node_evicted.node_id, evicted.node_evicted.reason) == ("n1", "disk died")
    assert d.actions == () and d.after is None
    assert RecordOnly().decide(state, _evict("operator", "")).events[1].node_evicted.reason == (
        "operator"
    )


def test_record_only_records_everything_else_as_it_is() -> None:
    state = statelib.initial("j")
    drained = _evict("slurm: DRAIN")  # a scheduler's drain: the node is out already
    assert RecordOnly().decide(state, drained) == Decision([drained])
    lost = ev.Event(node_lost=ev.NodeLost(node_id="n1", epoch=1))
    assert RecordOnly().decide(state, lost).events == [lost]
    assert RecordOnly().decide(state, machine.Paused(step=3)).events == []  # nobody to act
    assert not RecordOnly().recovers


def test_a_journal_built_without_a_decider_records_as_it_is() -> None:
    async def body() -> list[str]:
        store = InMemoryStore()
        j = Journal(InMemoryEventLog(store, "j", store.elect("d")), statelib.initial("j"))
        assert isinstance(j.decider, RecordOnly) and not j.decider.recovers
        j.start()
        try:
            stored = await j.observe(_evict("operator"), 5.0)
        finally:
            await j.close()
        return [e.WhichOneof("payload") or "" for e in stored]

    assert asyncio.run(body()) == ["operator_action", "node_evicted"]
