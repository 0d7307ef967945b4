"""The fold prunes gone node records from its heap of them exactly as a full scan would.

Random histories (seeded) of registrations, losses, returns, evictions and resizes are
folded with the indexed prune and with the full scan it replaced (tests/prunescan.py): the
states are equal, folded in one pass, in chunks through copies (`state.fold`), and in place
with batches undone as the journal does (driver/fold.py), where the heap kept for a state
goes stale under it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.prunescan import prune_by_scan, random_history
from unbroken.driver import fold as foldlib
from unbroken.driver import state as statelib
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

SEEDS = range(12)
GONE = (ev.NODE_STATE_LOST, ev.NODE_STATE_EVICTED)


@pytest.fixture
def small_keep(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keep 30 gone records with a slack of 15, so a short history prunes many times."""
    monkeypatch.setattr(statelib, "KEEP_GONE_NODES", 30)
    monkeypatch.setattr(statelib, "PRUNE_SLACK", 15)
    yield


def _by_scan(events: list[ev.Event], monkeypatch: pytest.MonkeyPatch) -> ev.JobState:
    with monkeypatch.context() as m:
        m.setattr(statelib, "_prune", prune_by_scan)
        return statelib.fold(events, statelib.initial("job"))


def _history(seed: int) -> list[ev.Event]:
    return random_history(random.Random(seed), 1500, world=8, pool=120)


@pytest.mark.parametrize("seed", SEEDS)
def test_one_pass_equals_the_full_scan(
    seed: int, small_keep: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _history(seed)
    want = _by_scan(events, monkeypatch)
    got = statelib.initial("job")
    statelib.fold_into(got, events)
    assert want.pruned_nodes > 10, "the history must prune"
    assert got == want
    # the heap kept for the state names every gone record: the next prune trusts it
    # and makes no pass over the nodes
    gone = {(r.gone_seq, n) for n, r in got.nodes.items() if r.state in GONE}
    assert gone <= set(statelib._GONE_HEAPS[id(got)])


@pytest.mark.parametrize("seed", SEEDS)
def test_chunks_through_copies_equal_the_full_scan(
    seed: int, small_keep: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _history(seed)
    want = _by_scan(events, monkeypatch)
    rng = random.Random(seed + 1000)
    got = statelib.initial("job")
    i = 0
    while i < len(events):
        k = rng.randint(1, 80)
        got = statelib.fold(events[i : i + k], got)  # a copy each time: a new state object
        i += k
    assert got == want


@pytest.mark.parametrize("seed", SEEDS)
def test_in_place_with_undone_batches_equals_the_full_scan(
    seed: int, small_keep: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's pattern: batches folded into one live state, some taken back (a
    failed append) and folded again later. An undone prune puts records back that the
    heap had given up, so the heap must be found stale, not trusted."""
    events = _history(seed)
    want = _by_scan(events, monkeypatch)
    rng = random.Random(seed + 2000)
    live = statelib.initial("job")
    i = 0
    undone = 0
    while i < len(events):
        batch = events[i : i + rng.randint(1, 60)]
        sp = foldlib.Savepoint(live)
        for e in batch:
            sp.apply(e)
        if rng.random() < 0.3:
            sp.undo()
            undone += 1
            continue  # the same batch again next round
        i += len(batch)
    assert undone > 5
    assert live == want


def test_a_copied_over_state_equals_the_full_scan(
    small_keep: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One state object whose content is replaced by CopyFrom (the heap kept under its id
    belongs to other content) still prunes as the full scan does."""
    events = _history(99)
    want = _by_scan(events, monkeypatch)
    other = statelib.initial("job")
    statelib.fold_into(other, _history(98))  # a different job's gone records, heap kept
    half = statelib.fold(events[:700], statelib.initial("job"))
    other.CopyFrom(half)
    statelib.fold_into(other, events[700:])
    assert other == want


def test_at_the_real_sizes_it_equals_the_full_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """KEEP_GONE_NODES as shipped: 4,000 nodes come and go in a 64-node world."""
    events = random_history(random.Random(7), 12_000, world=64, pool=4000)
    want = _by_scan(events, monkeypatch)
    got = statelib.initial("job")
    statelib.fold_into(got, events)
    assert want.pruned_nodes > 0
    assert got == want


@pytest.mark.parametrize("seed", range(6))
def test_a_world_too_large_to_prune_down_equals_the_full_scan(
    seed: int, small_keep: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 60-node world against a keep of 30: the gone records left after a prune are
    often all the world's, so it cannot get down to KEEP_GONE_NODES and waits (the
    `prune_mark`) until PRUNE_SLACK more are gone: the same in both prunes."""
    events = random_history(random.Random(seed), 1500, world=60, pool=60)
    want = _by_scan(events, monkeypatch)
    got = statelib.initial("job")
    marks = 0
    for e in events:
        statelib.fold_into(got, (e,))
        marks += got.prune_mark > 0
    assert marks > 50, "the history must hold a prune back"
    assert got == want


def test_a_storm_of_world_losses_prunes_once_per_slack_not_once_per_loss(
    small_keep: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every node of a 600-node world lost, one event each: none can be pruned (they are
    the world's). A prune reads the world and every gone record, so one per loss made an
    incident at 10,240 nodes quadratic; it is tried once per PRUNE_SLACK losses."""
    names = [f"w{i:04d}" for i in range(600)]
    layout = ev.WorldLayout(dp=600, node_ids=names, workers_per_node=1)
    s = statelib.initial("job")
    statelib.fold_into(s, [ev.Event(seq=1, job_started=ev.JobStarted(world=layout))])
    for n in names:
        s.nodes[n].CopyFrom(ev.NodeRecord(node_id=n, epoch=1, state=ev.NODE_STATE_ACTIVE))
    tries = 0
    real = statelib._gone_heap

    def counted(state: ev.JobState) -> list[tuple[int, str]]:
        nonlocal tries
        tries += 1
        return real(state)

    monkeypatch.setattr(statelib, "_gone_heap", counted)
    for i, n in enumerate(names):
        statelib.fold_into(s, [ev.Event(seq=2 + i, node_lost=ev.NodeLost(node_id=n, epoch=1))])
    assert s.gone_nodes == 600 and s.pruned_nodes == 0
    assert tries <= 600 // statelib.PRUNE_SLACK + 1, tries
