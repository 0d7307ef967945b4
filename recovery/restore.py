"""The restore decision: which step, and where each rank's shard comes from. Pure.

Given, for every shard-holding rank of the world being restored, the steps it can obtain
from each source (its node's memory, the buddy's replica, storage) and the copies found
corrupt, `decide` picks the newest step that every rank can obtain and each rank's
source, preferring memory over the buddy replica over storage. Ranks that can only use
storage are grouped by replica group (ranks holding identical state, i.e. the same
position in every non-data-parallel dimension): one of them reads, the others receive a
broadcast. When another member of the group holds the step in memory or a replica, that
member broadcasts instead and storage is not touched at all.

When the world changed, copies of the newest step were saved under another layout and no
rank's own shard fits: `newest_reshardable` picks the newest step, saved under a layout
other than the current one, of which every new rank can reach every saved rank's shard
(the input of a DCP load through `unbroken.recovery.reshard`); `same_layout_steps` keeps
such steps out of `decide`.

The shell around it (surveying the sources, verifying checksums) lives in
`unbroken.recovery.sources`; the driver turns the plan into a `RestoreStarted` event.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from unbroken.proto import events_pb2 as ev


class Source(enum.IntEnum):
    """Where a shard comes from, best first."""

    MEMORY = 0
    BUDDY = 1
    STORAGE = 2

    @property
    def label(self) -> str:
        """The name used in events (`RestoreStarted.source_by_rank`)."""
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Availability:
    """What one rank can obtain: steps per source, and (source, step) pairs found corrupt."""

    memory: frozenset[int] = frozenset()
    buddy: frozenset[int] = frozenset()
    storage: frozenset[int] = frozenset()
    corrupt: frozenset[tuple[Source, int]] = frozenset()

    def steps(self, source: Source) -> frozenset[int]:
        """Usable steps from `source` (corrupt copies removed)."""
        raw = (self.memory, self.buddy, self.storage)[source]
        return frozenset(s for s in raw if (source, s) not in self.corrupt)

    def best(self, step: int) -> Source | None:
        """The best usable source of `step`, or None."""
        for src in Source:
            if step in self.steps(src):
                return src
        return None


@dataclass(frozen=True, slots=True)
class Broadcast:
    """`root` obtains the shard (from `root_source`) and sends it to `receivers`."""

    root: int
    root_source: Source
    receivers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """The decision: one step, a source per rank, and broadcasts for storage-only ranks."""

    step: int
    source_by_rank: Mapping[int, Source]
    storage_readers: tuple[int, ...]
    broadcasts: tuple[Broadcast, ...] = field(default=())

    def labels(self) -> dict[int, str]:
        """`source_by_rank` as event strings."""
        return {r: s.label for r, s in self.source_by_rank.items()}

    def to_event(self, *, reshard: bool) -> ev.RestoreStarted:
        """The `RestoreStarted` payload the driver appends."""
        return ev.RestoreStarted(step=self.step, source_by_rank=self.labels(), reshard=reshard)


class NoCommonStepError(Exception):
    """No step is obtainable by every rank: the job cannot be restored."""


def common_steps(availability: Mapping[int, Availability]) -> frozenset[int]:
    """Steps every rank can obtain from some usable source."""
    sets = [frozenset().union(*(a.steps(s) for s in Source)) for a in availability.values()]
    return frozenset.intersection(*sets) if sets else frozenset()


def decide(
    availability: Mapping[int, Availability],
    replica_groups: Sequence[Sequence[int]] | None = None,
    *,
    not_after: int | None = None,
) -> RestorePlan:
    """Pick the newest step every rank can obtain, and each rank's source.

    Args:
        availability: for every rank to restore, what it can obtain.
        replica_groups: partition of the ranks into groups holding identical state (e.g.
            the data-parallel replicas of one tp/pp position under DDP or HSDP). Default:
            every rank alone (pure FSDP: no two ranks hold the same shard).
        not_after: only steps <= this (a rollback target).

    Returns:
        The plan.

    Raises:
        ValueError: `replica_groups` is not a partition of the ranks.
        NoCommonStepError: no step is obtainable by every rank.
    """
    ranks = set(availability)
    if not ranks:
        raise ValueError("availability is empty: name every rank to restore")
    groups = [tuple(g) for g in replica_groups] if replica_groups else [(r,) for r in ranks]
    seen: list[int] = [r for g in groups for r in g]
    if len(seen) != len(set(seen)) or set(seen) != ranks:
        raise ValueError(
            "replica_groups must partition the ranks in availability exactly once each; "
            f"got groups over {sorted(seen)} for ranks {sorted(ranks)}"
        )
    candidates = [s for s in common_steps(availability) if not_after is None or s <= not_after]
    if not candidates:
        raise NoCommonStepError(
            "no step is available to every rank"
            + ("" if not_after is None else f" at or before step {not_after}")
            + "; "
            + ", ".join(f"rank {r}: {_describe(availability[r])}" for r in sorted(ranks))
        )
    step = max(candidates)
    best: dict[int, Source] = {}
    for r in ranks:
        src = availability[r].best(step)
        assert src is not None, "a common step has a source for every rank"
        best[r] = src
    readers: list[int] = []
    broadcasts: list[Broadcast] = []
    sources = dict(best)
    for group in groups:
        storage_only = [r for r in group if best[r] is Source.STORAGE]
        if not storage_only:
            continue
        # A peer with the step in memory or a replica is cheaper than storage.
        peers = sorted((r for r in group if best[r] is not Source.STORAGE), key=best.__getitem__)
        if peers:
            root = peers[0]
            broadcasts.append(Broadcast(root, best[root], tuple(storage_only)))
            for r in storage_only:
                sources[r] = best[root]
        else:
            root = storage_only[0]
            readers.append(root)
            if len(storage_only) > 1:
                broadcasts.append(Broadcast(root, Source.STORAGE, tuple(storage_only[1:])))
    return RestorePlan(
        step=step,
        source_by_rank=dict(sorted(sources.items())),
        storage_readers=tuple(sorted(readers)),
        broadcasts=tuple(broadcasts),
    )


def _describe(a: Availability) -> str:
    parts = [f"{s.label}={sorted(a.steps(s))}" for s in Source if a.steps(s)]
    return " ".join(parts) or "nothing"


def describe_newest(availability: Mapping[int, Availability]) -> dict[int, str]:
    """Each rank's newest step per source, in a few words (why a restore went to storage)."""
    return {
        r: " ".join(f"{s.label}={max(a.steps(s))}" for s in Source if a.steps(s)) or "nothing"
        for r, a in sorted(availability.items())
    }


def availability_of(
    memory: Set[int] = frozenset(),
    buddy: Set[int] = frozenset(),
    storage: Set[int] = frozenset(),
    corrupt: Set[tuple[Source, int]] = frozenset(),
) -> Availability:
    """Convenience constructor from any sets."""
    return Availability(frozenset(memory), frozenset(buddy), frozenset(storage), frozenset(corrupt))


@dataclass(frozen=True, slots=True)
class StepCopies:
    """What one rank of the new world can reach of one saved step.

    `layout` is the parallel layout the step was saved under (`{"world": 2, "dp_shard": 2,
    ...}`; empty when the copies predate layouts in manifests), `ranks` the saved ranks whose
    shard of the step the rank can open from some usable source.
    """

    layout: Mapping[str, int]
    ranks: frozenset[int]


def saved_layouts(
    reach: Mapping[int, Mapping[int, StepCopies]],
) -> dict[int, dict[str, int] | None]:
    """Step -> the layout it was saved under, merged over what the ranks saw.

    Empty when no rank knows it (copies without a layout); None when ranks saw different
    layouts for the same step (such a step is never restored).
    """
    seen: dict[int, list[dict[str, int]]] = {}
    for by_step in reach.values():
        for step, c in by_step.items():
            known = seen.setdefault(step, [])
            if c.layout and dict(c.layout) not in known:
                known.append(dict(c.layout))
    return {s: (k[0] if len(k) == 1 else {} if not k else None) for s, k in seen.items()}


def newest_reshardable(
    reach: Mapping[int, Mapping[int, StepCopies]],
    layout: Mapping[str, int],
    *,
    not_after: int | None = None,
) -> int | None:
    """The newest step saved under another layout that every rank can reshard from.

    A step qualifies when it was saved under a known layout other than `layout` (and no
    rank saw a different one), and every rank of the new world can reach every saved rank's
    shard (`range(layout["world"])`): a DCP load planner may ask any of them.

    Args:
        reach: new rank -> step -> what that rank can reach of the step.
        layout: the layout being restored into.
        not_after: only steps <= this.

    Returns:
        The step, or None when no step qualifies.
    """
    if not reach:
        return None
    layouts = saved_layouts(reach)
    steps = frozenset.intersection(*(frozenset(r) for r in reach.values()))
    best: int | None = None
    for step in steps:
        saved = layouts[step]
        if not saved or "world" not in saved or saved == dict(layout):
            continue
        if not_after is not None and step > not_after:
            continue
        need = frozenset(range(int(saved["world"])))
        if all(need <= r[step].ranks for r in reach.values()) and (best is None or step > best):
            best = step
    return best


def newest_healable(
    reach: Mapping[int, Mapping[int, StepCopies]], *, not_after: int | None = None
) -> int | None:
    """The newest step saved under a known layout whose every saved rank's shard at least
    one rank of the new world can reach: the ranks that hold a shard can send it to the
    others (a heal from live peers), where `newest_reshardable` needs every rank to reach
    every shard itself.

    Args:
        reach: new rank -> step -> what that rank can reach of the step.
        not_after: only steps <= this.

    Returns:
        The step, or None when no step qualifies.
    """
    best: int | None = None
    for step, saved in saved_layouts(reach).items():
        if not saved or "world" not in saved:
            continue
        if (not_after is not None and step > not_after) or (best is not None and step <= best):
            continue
        held: set[int] = set()
        for by_step in reach.values():
            if step in by_step:
                held |= by_step[step].ranks
        if held >= set(range(int(saved["world"]))):
            best = step
    return best


def same_layout_steps(
    reach: Mapping[int, Mapping[int, StepCopies]], layout: Mapping[str, int]
) -> frozenset[int]:
    """Steps saved under `layout`, or under no recorded layout (such copies restore as
    before, shard by shard)."""
    return frozenset(
        s
        for s, saved in saved_layouts(reach).items()
        if saved is not None and saved in ({}, dict(layout))
    )


def restrict(a: Availability, steps: Set[int]) -> Availability:
    """`a` with only `steps` left in every source."""
    return Availability(a.memory & steps, a.buddy & steps, a.storage & steps, a.corrupt)
