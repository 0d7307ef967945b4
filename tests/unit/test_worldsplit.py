"""World layouts over the event cap travel in parts; the fold of the parts equals the whole."""

from __future__ import annotations

import pytest

from unbroken.driver import state as statelib
from unbroken.driver import worldsplit
from unbroken.driver.eventlog import DEFAULT_MAX_EVENT_BYTES
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

IDS = [f"host-{i:06d}.example.com".ljust(30, "x") for i in range(10_240)]


def _world(ids: list[str]) -> ev.WorldLayout:
    return ev.WorldLayout(dp=len(ids), pp=1, tp=1, node_ids=ids, workers_per_node=1)


def _numbered(events: list[ev.Event], first: int = 1) -> list[ev.Event]:
    for i, e in enumerate(events, first):
        e.seq = i
    return events


def _history() -> list[ev.Event]:
    half = IDS[: len(IDS) // 2]
    return [
        ev.Event(job_started=ev.JobStarted(trainer="t", world=_world(IDS))),
        ev.Event(training_resumed=ev.TrainingResumed(world=_world(IDS))),
        *(ev.Event(node_registered=ev.NodeRegistered(node_id=n, epoch=1)) for n in IDS[:50]),
        ev.Event(node_registered=ev.NodeRegistered(node_id=IDS[-1], epoch=2, spare=True)),
        ev.Event(
            world_resized=ev.WorldResized(old_world=_world(IDS), new_world=_world(half + IDS[-1:]))
        ),
        ev.Event(checkpoint_committed=ev.CheckpointCommitted(step=5, world=_world(half))),
    ]


def test_split_events_fit_the_cap_and_fold_to_the_same_state() -> None:
    whole = _history()
    parts = worldsplit.split([_copy(e) for e in whole], DEFAULT_MAX_EVENT_BYTES)
    assert max(e.ByteSize() for e in parts) <= DEFAULT_MAX_EVENT_BYTES - worldsplit.ENVELOPE_BYTES
    assert len(parts) > len(whole)
    heads = [e for e in _numbered(parts) if e.WhichOneof("payload") != "world_nodes"]
    for e, h in zip(whole, heads, strict=True):
        e.seq = h.seq  # each whole event where its head landed
    a = statelib.fold(whole, statelib.initial("j"))
    b = statelib.fold(parts, statelib.initial("j"))
    a.ClearField("last_seq"), b.ClearField("last_seq")
    counts = dict(b.event_counts)
    assert counts.pop("world_nodes") == len(parts) - len(whole)
    a.ClearField("event_counts"), b.ClearField("event_counts")
    assert a == b
    assert list(b.world.node_ids) == IDS[: len(IDS) // 2] + IDS[-1:]
    assert b.nodes[IDS[-1]].state == ev.NODE_STATE_ACTIVE  # the spare taken by the resize


def test_merged_gives_back_the_whole_events() -> None:
    whole = _history()
    parts = worldsplit.split([_copy(e) for e in whole], DEFAULT_MAX_EVENT_BYTES)
    assert worldsplit.merged(parts) == whole
    assert worldsplit.merged(parts[1:])[0].WhichOneof("payload") != "world_nodes"  # orphans dropped


def test_small_events_are_left_alone() -> None:
    small = [ev.Event(job_started=ev.JobStarted(world=_world(IDS[:10])))]
    assert worldsplit.split(small, DEFAULT_MAX_EVENT_BYTES) == small


def _copy(e: ev.Event) -> ev.Event:
    out = ev.Event()
    out.CopyFrom(e)
    return out


def test_a_page_stops_at_its_byte_bound_with_the_token_where_it_stopped() -> None:
    from unbroken.driver import paging
    from unbroken.proto import driver_pb2 as dpb

    big = [dpb.NodeInfo(node_id=f"n{i:05d}", hostname="h" * 100_000) for i in range(100)]
    page, nxt = paging.bounded(big, 100, more=False)
    assert 0 < len(page) < 100 and sum(n.ByteSize() for n in page) <= paging.PAGE_BYTES
    assert nxt == page[-1].node_id
    page, nxt = paging.bounded(big[:5], 10, more=False)
    assert len(page) == 5 and nxt == ""  # the last page
    page, nxt = paging.bounded(big[:11], 10, more=False)
    assert len(page) == 10 and nxt == page[-1].node_id


def test_the_cli_folds_a_split_world_whole() -> None:
    from unbroken.cli.cluster import world_of

    parts = worldsplit.split([_copy(e) for e in _history()[:2]], DEFAULT_MAX_EVENT_BYTES)
    assert world_of(parts) == IDS
