"""Checkpoint commits on the driver: one CheckpointCommitted per step, once every rank is in.

A flash copy becomes a checkpoint only when every rank's shard of that step is in durable
storage and its checksum verified. Each agent's persister verifies what it writes and the
agent reports it (`ShardPersisted`); `Commits` feeds the reports into one
`CommitTracker` per world size (a resized world is a different set of ranks) and turns the
report that completes a step into the `CheckpointCommitted` event the service appends.

Pure (no I/O, no clock), so the service's read loop calls it inline. Idempotent: a report
repeated after an agent reconnects, or one for a step at or below the newest commit, is
ignored. Bounded: each tracker remembers at most `max_pending` incomplete steps and
forgets those older than its newest commit; at most `MAX_WORLDS` world sizes are tracked.
A Rollback event makes the steps after its target committable again (a new timeline), from
shards saved in that timeline only: workers stamp each copy with the job's rollback count
(StartWorkers.timeline), and a shard of the dead timeline persisted late is dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.persist import CommitTracker, Persisted

log = structlog.get_logger(__name__)

MAX_WORLDS = 4  # world sizes tracked at once; the least recently reported is forgotten
MAX_RANKS = 1 << 20
MAX_OWNERS = 1 << 20  # (world size, rank) owners remembered
MAX_PERSIST_S = 86400.0  # a shard's reported write time above this (or NaN) is not believed


class Commits:
    """The driver's commit bookkeeping over every world size it has seen reports for."""

    def __init__(self, *, max_pending: int = 16) -> None:
        if max_pending < 1:
            raise ValueError(f"Commits.max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._trackers: dict[int, CommitTracker] = {}
        self.ignored = 0  # malformed reports dropped
        self.stale = 0  # reports of a dead timeline dropped
        # Rollbacks so far (the leader sets it from the replayed state): a shard saved in
        # an earlier timeline belongs to steps a rollback abandoned.
        self.timeline = 0
        # node -> global rank -> the step of its newest verified shard (ListCheckpoints)
        self.by_node: dict[str, dict[int, int]] = {}
        # (world size, rank) -> the node that first reported it (worlds we did not lay out)
        self._owners: dict[tuple[int, int], str] = {}
        self.url_of: dict[str, str] = {}  # node -> the storage root it persists to
        self.shard_bytes = 0  # the largest shard of the newest reports (ring slot size)

    def claim(
        self, node_id: str, world_size: int, rank: int, can_report: Callable[[str], bool]
    ) -> str:
        """Bind a rank of a world to the first node that reports it; why not ("" if ok).

        A rank whose owner can no longer report (`can_report` false: lost, evicted, its
        session closed; a replacement took its ranks) passes to the node reporting it now."""
        owner = self._owners.setdefault((world_size, rank), node_id)
        if owner != node_id and not can_report(owner):
            owner = self._owners[(world_size, rank)] = node_id
        if len(self._owners) > MAX_OWNERS:
            self._owners.clear()
            self._owners[(world_size, rank)] = owner
        if owner != node_id:
            return f"rank {rank} of world {world_size} is node {owner!r}'s"
        return ""

    def record(self, node_id: str, msg: dpb.ShardPersisted) -> ev.Event | None:
        """Record one agent's verified-shard report.

        Returns:
            The CheckpointCommitted event to append when this report completes its step,
            else None (incomplete, duplicate, stale, or malformed: logged and dropped).
        """
        problem = _problem(msg)
        if problem:
            self.ignored += 1
            log.warning("shard report ignored", node=node_id, problem=problem)
            return None
        if msg.HasField("timeline") and msg.timeline < self.timeline:
            self.stale += 1
            log.info(
                "shard of a dead timeline ignored",
                node=node_id,
                rank=msg.rank,
                step=msg.step,
                timeline=msg.timeline,
                current=self.timeline,
            )
            return None
        newest = self.by_node.setdefault(node_id, {})
        newest[msg.rank] = max(newest.get(msg.rank, 0), msg.step)  # (a report sent again)
        self.url_of[node_id] = msg.url
        self.shard_bytes = max(self.shard_bytes, msg.bytes)
        tracker = self._trackers.pop(msg.world_size, None)
        if tracker is None:
            tracker = CommitTracker(
                world_size=msg.world_size, url=msg.url, max_pending=self.max_pending
            )
            while len(self._trackers) >= MAX_WORLDS:
                del self._trackers[next(iter(self._trackers))]
        self._trackers[msg.world_size] = tracker  # most recently reported last
        commit = tracker.record(
            Persisted(
                rank=msg.rank,
                step=msg.step,
                uri=msg.uri,
                nbytes=msg.bytes,
                checksum=msg.checksum,
                seconds=msg.persist_s if 0 < msg.persist_s < MAX_PERSIST_S else 0.0,
                node=node_id,
            )
        )
        if commit is None:
            return None
        log.info(
            "checkpoint committed",
            step=commit.step,
            ranks=commit.ranks,
            bytes=commit.nbytes,
            uri=commit.uri,
        )
        return ev.Event(
            cause="shards persisted",
            checkpoint_committed=ev.CheckpointCommitted(
                step=commit.step,
                uri=commit.uri,
                bytes=commit.nbytes,
                ranks=commit.ranks,
                checksum=commit.checksum,
                persist_s=commit.seconds,
            ),
        )

    def rollback(self, to_step: int) -> None:
        """Steps after `to_step` belong to a dead timeline: forget them, commit them anew
        from shards of the new timeline only."""
        self.timeline += 1
        for tracker in self._trackers.values():
            tracker.rollback(to_step)

    def newest(self, world_size: int) -> int | None:
        """The newest step committed for `world_size` by this driver, None when none."""
        tracker = self._trackers.get(world_size)
        return tracker.committed[-1] if tracker is not None and tracker.committed else None


def _problem(msg: dpb.ShardPersisted) -> str:
    """What is wrong with a report ("" when nothing)."""
    if not 1 <= msg.world_size <= MAX_RANKS:
        return f"world_size {msg.world_size} must be in [1, {MAX_RANKS}] (agent without a world?)"
    if msg.rank >= msg.world_size:
        return f"rank {msg.rank} outside a world of {msg.world_size}"
    if not msg.uri:
        return "empty shard uri"
    return ""


def rank_slice_problem(
    node_id: str, members: list[str], world_size: int, rank: int, what: str
) -> str:
    """Why `node_id` may not report `rank` of a world of `world_size` whose nodes, in rank
    order, are `members` each holding the same number of ranks ("" when it may)."""
    if node_id not in members:
        return f"node {node_id!r} is not a node of {what}"
    n = len(members)
    if world_size % n:
        return f"world size {world_size} is not a multiple of the {n} nodes of {what}"
    per = world_size // n
    first = members.index(node_id) * per
    if not first <= rank < first + per:
        return f"rank {rank} is not one of its ranks [{first}, {first + per}) in {what}"
    return ""


def round_members(participants: list[str]) -> list[str] | None:
    """The unbroken node ids of a rendezvous round's participants (`node_id@descriptor`),
    in rank order; None when the driver did not know every participant's node id."""
    ids = [p.split("@", 1)[0] for p in participants if "@" in p]
    return ids if ids and len(ids) == len(participants) else None


def low_median(values: list[float]) -> float:
    """The lower median: one of two values cannot raise it, so no single node moves a
    policy input that every node of the world reports."""
    if not values:
        return 0.0
    return sorted(values)[(len(values) - 1) // 2]


def reached_step(steps: list[int]) -> int | None:
    """The newest step the live world reached by its nodes' own word (each node's highest
    step seen), as the lower median: one node's inflated step cannot raise it."""
    return int(low_median([float(s) for s in steps])) if steps else None
