"""What keeps a 10,240-node job's paths small: a reconnect decides nothing (the recovery
loop records it without the decision's draft), RestoreStarted lists only the exceptions of a
large world, and a snapshot is stored compressed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.event_strategies import numbered, payloads
from tests.unit.machine_harness import Sim, crash, job, register
from unbroken.driver import etcdlog
from unbroken.driver import fold as foldlib
from unbroken.driver import machine as m
from unbroken.driver import state as statelib
from unbroken.driver.eventlog import EventLogError
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def _reconnect_decides_nothing(s: ev.JobState, e: ev.Event) -> None:
    """What lets the loop skip `decide` for `e`: it records `e` alone, keeps the phase and
    the pending actions, and the fold leaves the node's state as it was."""
    node = e.node_registered.node_id
    policy = m.Policy()
    d = m.decide(s, e, policy)
    assert d.events == (e,) and d.phase == s.phase
    after = statelib.apply(s, e)
    assert after.nodes[node].state == s.nodes[node].state
    assert after.phase == s.phase and after.world == s.world
    assert tuple(m.pending_actions(after, policy)) == d.actions


def test_a_reconnect_of_each_kind_is_one_and_decides_nothing() -> None:
    sim = Sim(m.Policy())
    sim.append(job(nodes=4, wpn=2, spares=1))
    s = sim.state
    assert s.phase == ev.PHASE_RUNNING
    same_world, same_spare = register("n1", 1, 2), register("s0", 1, 2, spare=True)
    for e in (same_world, same_spare):
        assert m.reconnect(s, e)
        _reconnect_decides_nothing(s, e)
    # not reconnects: a new agent (its workers and flash memory are gone), an unknown node,
    # a spare's agent now saying it is a worker, a world node's saying it is a spare
    restarted = register("n1", 2, 2)
    assert not m.reconnect(s, restarted)
    assert m.decide(s, restarted, m.Policy()).phase == ev.PHASE_SUSPECTED
    assert not m.reconnect(s, register("n9", 1, 2))
    assert not m.reconnect(s, register("s0", 1, 2))
    assert not m.reconnect(s, register("n1", 1, 2, spare=True))
    assert not m.reconnect(s, crash("n1"))
    # a lost node coming back with its old epoch is no reconnect: its loss is decided
    sim.feed(ev.Event(node_lost=ev.NodeLost(node_id="n2", epoch=1)))
    assert not m.reconnect(sim.state, register("n2", 1, 2))


@settings(max_examples=200, deadline=None)
@given(st.lists(payloads, max_size=50), st.booleans())
def test_every_reconnect_in_any_state_decides_nothing(events: list[ev.Event], spare: bool) -> None:
    s = statelib.fold(numbered(events), statelib.initial("job"))
    if m.settle(s, m.Policy()).events:
        return  # a state the loop never decides on: it settles every state it records
    for node, rec in s.nodes.items():
        e = register(node, rec.epoch, spare=spare)
        if m.reconnect(s, e):
            _reconnect_decides_nothing(s, e)


def test_restore_started_of_81920_ranks_fits_an_event_and_names_every_source() -> None:
    ranks = 10_240 * 8
    sources = {r: "memory" for r in range(ranks)}
    sources.update({5: "buddy", 6: "buddy", 77_000: "storage"})
    e = m.restore_started(40, sources, reshard=False)
    assert e.source_default == "memory"
    assert dict(e.source_by_rank) == {5: "buddy", 6: "buddy", 77_000: "storage"}
    assert ev.Event(restore_started=e).ByteSize() < 1024
    assert all(m.restore_source(e, r) == src for r, src in sources.items())
    # a small world keeps every rank by name (what readers of small jobs see)
    small = m.restore_started(40, {0: "memory", 1: "buddy"}, reshard=True)
    assert small.source_default == "" and dict(small.source_by_rank) == {0: "memory", 1: "buddy"}
    assert m.restore_source(small, 1) == "buddy" and m.restore_source(small, 9) == ""


def _world_of(n: int, width: int) -> ev.JobState:
    ids = [
        f"gpu-{i:06d}.rack{i // 64:04d}.dc1.example.com".ljust(width, "x")[:width] for i in range(n)
    ]
    world = ev.WorldLayout(dp=n * 8, pp=1, tp=1, node_ids=ids, workers_per_node=8)
    events = [
        ev.Event(job_started=ev.JobStarted(trainer="t", world=world)),
        *(
            ev.Event(
                node_registered=ev.NodeRegistered(
                    node_id=i, epoch=1_700_000_000_000_000_000 + k, hostname=i, ip="10.1.2.3",
                    num_workers=8,
                )
            )
            for k, i in enumerate(ids)
        ),
        ev.Event(training_resumed=ev.TrainingResumed(world=world)),
    ]  # fmt: skip
    s = statelib.initial("job")
    foldlib.fold_in_place(s, numbered(events))
    return s


def test_a_10240_node_snapshot_with_40_character_names_is_stored_under_1_mib() -> None:
    s = _world_of(10_240, 40)
    assert s.ByteSize() > 2 << 20  # serialized as it is: over 2 MiB
    data = etcdlog.snapshot_value(s.last_seq, s)
    assert len(data) <= 1 << 20
    snap = ev.Snapshot.FromString(data)
    assert snap.last_seq == s.last_seq and not snap.HasField("state")
    back = ev.JobState.FromString(etcdlog.inflate(snap.state_deflated))
    assert back == s


def test_a_snapshot_that_does_not_inflate_says_so() -> None:
    with pytest.raises(EventLogError, match="does not inflate"):
        etcdlog.inflate(b"not zlib data at all")


@settings(max_examples=200, deadline=None)
@given(st.lists(payloads, max_size=60), st.integers(1, 7))
def test_a_replay_folding_pages_equals_folding_event_by_event(
    events: list[ev.Event], page: int
) -> None:
    """A replay folds each page with the kinds counted once per page: the same state as
    the journal's event-by-event fold, whatever the events and the page size."""
    events = numbered(events)
    one_by_one = statelib.initial("job")
    for e in events:
        statelib.apply_in_place(one_by_one, e)
    paged = statelib.initial("job")
    for i in range(0, len(events), page):
        statelib.fold_into(paged, events[i : i + page])
    assert paged == one_by_one == statelib.fold(events, statelib.initial("job"))


def test_gone_nodes_past_the_limit_are_pruned_oldest_first_in_a_replay() -> None:
    """Past KEEP_GONE_NODES + PRUNE_SLACK losses the oldest records go, in a paged fold
    as in the journal's; world nodes and suspects are kept whatever their age."""
    n = statelib.KEEP_GONE_NODES + statelib.PRUNE_SLACK + 3
    events = [ev.Event(job_started=ev.JobStarted(world=ev.WorldLayout(node_ids=["n0", "n1"])))]
    events += [
        ev.Event(node_registered=ev.NodeRegistered(node_id=f"n{i}", epoch=1)) for i in range(n)
    ]
    events += [ev.Event(node_lost=ev.NodeLost(node_id=f"n{i}", epoch=1)) for i in range(n)]
    events = numbered(events)
    s = statelib.initial("job")
    for i in range(0, len(events), 500):
        statelib.fold_into(s, events[i : i + 500])
    assert s.gone_nodes == statelib.KEEP_GONE_NODES + 2
    assert s.pruned_nodes == n - s.gone_nodes
    assert {"n0", "n1", f"n{n - 1}"} <= set(s.nodes)
    first_kept = 2 + s.pruned_nodes  # n2.. went, oldest first
    assert f"n{first_kept - 1}" not in s.nodes and f"n{first_kept}" in s.nodes
    assert s == statelib.fold(events, statelib.initial("job"))
