"""The in-place fold (driver/fold.py) equals the pure fold, and its undo restores the state."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.event_strategies import numbered, payloads
from unbroken.driver import fold as foldlib
from unbroken.driver import state as statelib
from unbroken.driver.decider import Decision
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore, LogUnavailableError
from unbroken.driver.journal import Journal, JournalConfig
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def _bytes(s: ev.JobState) -> bytes:
    return s.SerializeToString(deterministic=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(payloads, max_size=60), st.data())
def test_in_place_equals_the_pure_fold_and_undo_restores(
    events: list[ev.Event], data: st.DataObject
) -> None:
    events = numbered(events)
    split = data.draw(st.integers(0, len(events)))
    base = statelib.fold(events[:split], statelib.initial("job"))
    before = _bytes(base)
    want = statelib.fold(events[split:], base)
    sp = foldlib.Savepoint(base)
    for e in events[split:]:
        sp.apply(e)
    assert base == want
    sp.undo()
    assert _bytes(base) == before
    foldlib.fold_in_place(base, events[split:])
    assert base == want


def test_undo_brings_back_records_the_fold_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statelib, "KEEP_GONE_NODES", 4)
    monkeypatch.setattr(statelib, "PRUNE_SLACK", 2)
    events = [
        ev.Event(node_registered=ev.NodeRegistered(node_id=f"n{i}", epoch=1)) for i in range(20)
    ]
    events += [ev.Event(node_lost=ev.NodeLost(node_id=f"n{i}", epoch=1)) for i in range(6)]
    base = statelib.fold(numbered(events), statelib.initial("job"))
    before = _bytes(base)
    tail = [ev.Event(node_lost=ev.NodeLost(node_id=f"n{i}", epoch=1)) for i in range(6, 12)]
    for i, e in enumerate(tail, len(events) + 1):
        e.seq = i
    want = statelib.fold(tail, base)
    assert want.pruned_nodes > 0  # the tail did prune
    sp = foldlib.Savepoint(base)
    for e in tail:
        sp.apply(e)
    assert base == want
    sp.undo()
    assert _bytes(base) == before


def test_a_fold_that_raises_leaves_the_state_as_it_was() -> None:
    s = statelib.fold(
        numbered([ev.Event(node_registered=ev.NodeRegistered(node_id="a", epoch=1))]),
        statelib.initial("job"),
    )
    before = _bytes(s)
    ok = ev.Event(seq=2, node_registered=ev.NodeRegistered(node_id="b", epoch=1))
    stale = ev.Event(seq=1, node_lost=ev.NodeLost(node_id="a"))  # folded after seq 2: refused
    with pytest.raises(AssertionError):
        foldlib.fold_in_place(s, [ok, stale])
    assert _bytes(s) == before


class _DownLog(InMemoryEventLog):
    down = False

    async def append_many(self, events):  # type: ignore[no-untyped-def]
        if self.down:
            raise LogUnavailableError("etcd at test:0 did not answer")
        return await super().append_many(events)


def test_a_batch_decides_on_its_drafts_and_a_failed_append_undoes_them() -> None:
    """Each decision in a batch sees the ones before it; when the append fails, readers
    are left with the durable state, and once the log is back the batch lands whole."""

    async def body() -> None:
        store = InMemoryStore()
        elog = _DownLog(store, "job", store.elect("d1"))
        j = Journal(
            elog, statelib.initial("job"), config=JournalConfig(retry_min_ms=5, retry_max_ms=20)
        )
        seen: list[int] = []
        durable: list[bytes] = []

        class Decide:
            recovers = True

            def decide(self, state: ev.JobState, obj: ev.Event) -> Decision:
                seen.append(len(state.nodes))
                return Decision([obj])

        j.decider = Decide()
        for i in range(10):
            j.submit(ev.Event(node_registered=ev.NodeRegistered(node_id=f"n{i}", epoch=1)))
        elog.down = True
        j.start()
        try:
            for _ in range(500):
                if len(seen) >= 20:
                    break
                durable.append(_bytes(j.state))
                await asyncio.sleep(0.002)
            assert seen[:10] == list(range(10))  # each decision saw the drafts before it
            assert set(durable) == {_bytes(statelib.initial("job"))}  # never the drafts
            elog.down = False
            for _ in range(500):
                if j.pending() == 0:
                    break
                await asyncio.sleep(0.005)
            assert j.state == await elog.replay()
            assert len(j.state.nodes) == 10
        finally:
            await j.close()

    asyncio.run(asyncio.wait_for(body(), 30.0))
