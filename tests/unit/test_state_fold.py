"""The fold is pure and snapshot-then-tail equals the full fold, for any events and split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.event_strategies import numbered, payloads
from unbroken.driver import state as statelib
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


@settings(max_examples=300, deadline=None)
@given(st.lists(payloads, max_size=60), st.data())
def test_snapshot_then_tail_equals_full_fold(events: list[ev.Event], data: st.DataObject) -> None:
    events = numbered(events)
    split = data.draw(st.integers(0, len(events)))
    base = statelib.initial("job")
    full = statelib.fold(events, base)
    snap = statelib.fold(events[:split], base)
    # a snapshot goes through bytes, as it does in etcd
    snap = ev.JobState.FromString(snap.SerializeToString())
    assert statelib.fold(events[split:], snap) == full
    assert full.last_seq == len(events)


@given(st.lists(payloads, min_size=1, max_size=20))
def test_apply_does_not_mutate_its_input(events: list[ev.Event]) -> None:
    s = statelib.initial("job")
    for e in numbered(events):
        before = s.SerializeToString(deterministic=True)
        nxt = statelib.apply(s, e)
        assert s.SerializeToString(deterministic=True) == before
        s = nxt


def test_a_nodes_record_keeps_the_replica_key_it_registered() -> None:
    """The key a node registered is in its record (StartWorkers hands it to its peers; a
    new leader has it from the log, for a node lost before it led)."""
    reg = ev.Event(
        seq=1,
        node_registered=ev.NodeRegistered(node_id="n1", epoch=7, replica_pubkey=b"k" * 32),
    )
    s = statelib.fold([reg], statelib.initial("job"))
    assert s.nodes["n1"].replica_pubkey == b"k" * 32
