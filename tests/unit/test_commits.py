"""The driver's commit bookkeeping: one CheckpointCommitted per step, only when complete."""

from __future__ import annotations

import zlib

import pytest

from unbroken.driver import state as statelib
from unbroken.driver.commits import MAX_WORLDS, Commits
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.persist import shard_uri, step_dir

pytestmark = pytest.mark.unit

URL = "/ckpt"


def _shard(
    step: int, rank: int, world: int = 2, url: str = URL, timeline: int | None = 0
) -> dpb.ShardPersisted:
    return dpb.ShardPersisted(
        timeline=timeline,
        step=step,
        rank=rank,
        uri=shard_uri(url, step, rank),
        bytes=100 + rank,
        checksum=1000 * step + rank,
        world_size=world,
        url=url,
    )


def test_commits_once_every_rank_is_in_and_ignores_duplicates() -> None:
    c = Commits()
    assert c.record("n0", _shard(5, 0)) is None
    assert c.record("n0", _shard(5, 0)) is None  # a resend after a reconnect
    e = c.record("n1", _shard(5, 1))
    assert e is not None and e.WhichOneof("payload") == "checkpoint_committed"
    p = e.checkpoint_committed
    crc = zlib.crc32((5001).to_bytes(8, "little"), zlib.crc32((5000).to_bytes(8, "little")))
    assert (p.step, p.uri, p.bytes, p.ranks, p.checksum) == (
        5,
        step_dir(URL, 5),
        201,
        2,
        f"{crc:08x}",
    )
    # Duplicates of a committed step, and older steps, never commit again.
    assert c.record("n1", _shard(5, 1)) is None
    assert c.record("n0", _shard(5, 0)) is None
    assert c.record("n0", _shard(4, 0)) is None and c.record("n1", _shard(4, 1)) is None
    assert c.newest(2) == 5


def test_incomplete_older_steps_are_forgotten_after_a_newer_commit() -> None:
    c = Commits(max_pending=4)
    assert c.record("n0", _shard(1, 0)) is None  # rank 1 never reports step 1
    for r in (0, 1):
        out = c.record(f"n{r}", _shard(2, r))
    assert out is not None and out.checkpoint_committed.step == 2
    assert c.record("n1", _shard(1, 1)) is None  # step 1 can no longer be committed
    # Pending incomplete steps are bounded.
    for step in range(10, 30):
        assert c.record("n0", _shard(step, 0)) is None
    tracker = c._trackers[2]
    assert len(tracker._reports) <= 4


def test_rollback_reopens_later_steps() -> None:
    c = Commits()
    for step in (7, 8):
        for r in (0, 1):
            c.record(f"n{r}", _shard(step, r))
    assert c.newest(2) == 8
    c.rollback(6)
    assert c.newest(2) is None
    assert c.record("n0", _shard(7, 0, timeline=1)) is None
    e = c.record("n1", _shard(7, 1, timeline=1))
    assert e is not None and e.checkpoint_committed.step == 7


def test_shards_of_a_dead_timeline_never_commit() -> None:
    """A rank persisted step 9 before the rollback to 6 but reported it after: its shard
    must not complete the new timeline's step 9 (which the other rank saved anew)."""
    c = Commits()
    c.rollback(6)
    assert c.timeline == 1
    assert c.record("n0", _shard(9, 0, timeline=0)) is None  # late, from the dead timeline
    assert c.stale == 1
    assert c.record("n1", _shard(9, 1, timeline=1)) is None  # still waits for rank 0
    e = c.record("n0", _shard(9, 0, timeline=1))
    assert e is not None and e.checkpoint_committed.step == 9
    # an older agent sends no timeline: not checked (a rolling upgrade keeps committing)
    assert c.record("n0", _shard(10, 0, timeline=None)) is None
    e = c.record("n1", _shard(10, 1, timeline=None))
    assert e is not None and e.checkpoint_committed.step == 10


def test_node_local_storage_and_world_sizes() -> None:
    c = Commits()
    # Each node persists to its own directory: the step still commits (under the
    # tracker's url), and a world of another size is tracked apart.
    assert c.record("n0", _shard(3, 0, url="/a")) is None
    e = c.record("n1", _shard(3, 1, url="/b"))
    assert e is not None and e.checkpoint_committed.uri == step_dir("/a", 3)
    one = c.record("n0", _shard(3, 0, world=1))
    assert one is not None and one.checkpoint_committed.ranks == 1
    for w in range(3, 3 + MAX_WORLDS + 2):
        c.record("n0", _shard(1, 0, world=w))
    assert len(c._trackers) == MAX_WORLDS


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        (dpb.ShardPersisted(step=1, rank=0, uri="u", world_size=0), "world_size"),
        (dpb.ShardPersisted(step=1, rank=2, uri="u", world_size=2), "outside"),
        (dpb.ShardPersisted(step=1, rank=0, uri="", world_size=2), "uri"),
    ],
)
def test_malformed_reports_are_dropped(msg: dpb.ShardPersisted, why: str) -> None:
    c = Commits()
    assert c.record("n0", msg) is None
    assert c.ignored == 1
    assert not c._trackers or c.newest(2) is None
    from unbroken.driver.commits import _problem

    assert why in _problem(msg)


def test_a_commit_costs_the_median_nodes_shards_in_turn_and_the_log_averages_it() -> None:
    """One persister thread per node writes its ranks' shards one after the other: a
    node's cost is its sum, and the step's is the lower median over nodes (one node's
    word cannot raise it). The fold keeps a moving average of it, so every leader
    computes the same persistence interval (a driver's own memory did not survive a
    failover: the next world went back to the agents' default)."""
    c = Commits()
    seconds = {0: 0.25, 1: 0.25, 2: 0.75, 3: float("nan")}  # n0: ranks 0, 1; n1: 2, 3
    out = None
    for rank, s in seconds.items():
        shard = _shard(7, rank, world=4)
        shard.persist_s = s
        out = c.record("n0" if rank < 2 else "n1", shard)
    assert out is not None and out.checkpoint_committed.persist_s == pytest.approx(0.5)
    state = statelib.initial("j")
    for seq, cost in enumerate((0.75, 0.75, 2.0, 0.0), 1):  # 0: not reported, not counted
        commit = ev.CheckpointCommitted(step=seq, persist_s=cost)
        state = statelib.fold([ev.Event(seq=seq, checkpoint_committed=commit)], state)
    assert state.persist_cost_s == pytest.approx(0.75 + 0.3 * (2.0 - 0.75))
