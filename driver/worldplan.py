"""The world a recovery restarts, and where each rank restores from (pure).

Helpers of the recovery machine (driver/machine.py) over the folded job state: which nodes
are healthy and reachable, the diagnosis id of the open incident, the world after removing
lost, evicted and bad nodes (spares first or shrink dp, within the policy's limits), and
each rank's restore source (memory, a buddy's replica, storage) with the RestoreStarted
event that records it, and what must (still) be done in each phase (`pending_actions`).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

from unbroken.driver.actions import (
    Action,
    EvictNode,
    Layout,
    Restore,
    ResumeAll,
    RunDiagnosis,
    StartWorkers,
    StopAll,
    StopWorkers,
)
from unbroken.driver.policy import IN_JOB, Policy, Reshape
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.recovery import spike as spikelib


# ---------------------------------------------------------------- helpers on the state
def _state_of(s: ev.JobState, node_id: str) -> int:
    rec = s.nodes.get(node_id)
    return ev.NODE_STATE_UNSPECIFIED if rec is None else rec.state


_HEALTHY = frozenset((ev.NODE_STATE_ACTIVE, ev.NODE_STATE_SPARE))


def _healthy(s: ev.JobState, node_id: str) -> bool:
    return _state_of(s, node_id) in _HEALTHY


def _inactive(s: ev.JobState, ids: Iterable[str]) -> list[str]:
    """The nodes of `ids` that are not ACTIVE (`_state_of` inlined: asked of the world)."""
    nodes, active = s.nodes, ev.NODE_STATE_ACTIVE
    return [n for n in ids if (r := nodes.get(n)) is None or r.state != active]


def _reachable(s: ev.JobState) -> tuple[str, ...]:
    """World nodes that can still take commands (`_healthy`, inlined: every decision asks,
    and at 10,240 nodes two calls per node were a tenth of the driver's loop)."""
    nodes, ok = s.nodes, _HEALTHY
    return tuple(n for n in s.world.node_ids if (r := nodes.get(n)) is not None and r.state in ok)


def few(items: Iterable[object], limit: int = 16) -> str:
    """`items` as a list's repr, the first `limit` of them and how many more: a reason
    names a few, never a 10,240-node world (bench-scale: a RESHAPED reason of 123 KB was
    over the event cap, its decision was dropped, and the incident never went on)."""
    out = list(items)
    if len(out) <= limit:
        return repr(out)
    return f"{out[:limit]!r} (+{len(out) - limit} more)"


def diagnosis_id(s: ev.JobState) -> str:
    """The id of the diagnosis the open incident needs (same suspects = same id)."""
    digest = hashlib.sha1(",".join(sorted(s.suspects)).encode()).hexdigest()[:8]
    return f"{s.incident_id}-d{digest}"


def _pool(s: ev.JobState, survivors: Sequence[str], *, with_spares: bool) -> list[str]:
    """Healthy nodes not working in the world: returned nodes first, then spares, oldest first.

    A world node whose agent came back as a spare is a spare here.
    """
    taken = set(survivors) | set(s.bad_nodes)
    free = [r for r in s.nodes.values() if r.node_id not in taken and _healthy(s, r.node_id)]
    returned = [r for r in free if r.state == ev.NODE_STATE_ACTIVE]
    spares = [r for r in free if r.state == ev.NODE_STATE_SPARE] if with_spares else []
    key = lambda r: (r.registered_seq == 0, r.registered_seq, r.node_id)  # noqa: E731
    return [r.node_id for r in sorted(returned, key=key) + sorted(spares, key=key)]


def _best_dp(s: ev.JobState, policy: Policy, available: int) -> int | None:
    """The largest dp (<= the configured dp) whose whole nodes fit in `available`."""
    w = s.world
    unit, wpn = w.pp * w.tp, w.workers_per_node
    top = (s.configured_world.dp if s.HasField("configured_world") else 0) or w.dp
    for dp in range(top, 0, -1):
        if (dp * unit) % wpn:
            continue
        nodes = dp * unit // wpn
        if policy.min_nodes <= nodes <= min(available, policy.max_nodes or available):
            return dp
    return None


def plan_world(s: ev.JobState, policy: Policy) -> Layout | str:
    """The world after removing lost, evicted and bad nodes, or why there is none.

    Removed nodes are replaced in place by pool nodes when dp stays the same; otherwise
    the survivors keep their order and pool nodes follow.
    """
    w = s.world
    bad = set(s.bad_nodes)
    out = set(s.sitting_out)  # the replica policy's: neither in the world nor in the pool
    gone = set(_inactive(s, w.node_ids))
    survivors = [n for n in w.node_ids if n not in gone and n not in bad and n not in out]
    returned = [n for n in _pool(s, survivors, with_spares=False) if n not in out]
    everyone = [n for n in _pool(s, survivors, with_spares=True) if n not in out]
    dp = None
    pool = everyone
    if out:  # the other replicas train on alone; a spare comes in by the grow-back
        dp = _best_dp(s, policy, len(survivors))
        pool = []
    if dp is None and policy.reshape is Reshape.SHRINK_FIRST:
        dp = _best_dp(s, policy, len(survivors) + len(returned))
        pool = returned
    if dp is None:
        dp = _best_dp(s, policy, len(survivors) + len(everyone))
        pool = everyone
    if dp is None:
        have = len(survivors) + len(everyone)
        return (
            f"only {have} healthy node(s) of {w.workers_per_node} worker(s) remain; "
            f"pp x tp = {w.pp * w.tp} needs whole nodes and min_nodes is {policy.min_nodes}"
        )
    need = dp * w.pp * w.tp // w.workers_per_node
    if dp == w.dp and len(w.node_ids) == need:
        keep = {*survivors, *pool}  # sets: lists made this O(world^2), 1 s at 10,240
        inplace = {n for n in w.node_ids if n in keep}
        free = iter([n for n in pool if n not in inplace])
        ids = [n if n in inplace else next(free) for n in w.node_ids]
    else:
        ids = (survivors + pool)[:need]
    return Layout(dp, w.pp, w.tp, tuple(ids), w.workers_per_node)


def restore_sources(s: ev.JobState) -> tuple[tuple[tuple[int, str], ...], bool]:
    """Each rank's preferred restore source, and whether the world changed shape."""
    w, old = s.world, s.incident_world
    reshard = (w.dp, w.pp, w.tp, w.workers_per_node) != (
        old.dp,
        old.pp,
        old.tp,
        old.workers_per_node,
    )
    # a rollback to a committed step reads storage; to a step only the rings hold, memory
    rollback = s.HasField("rollback_to") and s.restore_step in {c.step for c in s.checkpoints}
    out = []
    for i, node_id in enumerate(w.node_ids):
        same = i < len(old.node_ids) and old.node_ids[i] == node_id
        src = "storage" if reshard or rollback else "memory" if same else "buddy"
        for lr in range(w.workers_per_node):
            out.append((i * w.workers_per_node + lr, src))
    return tuple(out), reshard


SOURCES_BY_NAME = 1024  # ranks a RestoreStarted lists one by one; past it, the exceptions


def restore_started(step: int, sources: dict[int, str], reshard: bool) -> ev.RestoreStarted:
    """The RestoreStarted of a restore from `sources` (rank -> source). Past
    `SOURCES_BY_NAME` ranks only those whose source is not the most common one are listed
    (`source_default` names it), so the event stays small at any world size."""
    e = ev.RestoreStarted(step=step, reshard=reshard)
    if len(sources) > SOURCES_BY_NAME:
        common = collections.Counter(sources.values()).most_common(1)[0][0]
        e.source_default = common
        sources = {r: src for r, src in sources.items() if src != common}
    e.source_by_rank.update(sources)
    return e


def restore_source(e: ev.RestoreStarted, rank: int) -> str:
    """Where `rank` restores from, by a RestoreStarted ("" when it does not say)."""
    return e.source_by_rank.get(rank, e.source_default)


# ---------------------------------------------------------------- pending actions
def pending_actions(state: ev.JobState, policy: Policy) -> list[Action]:
    """What must (still) be done in the current phase; idempotent, from the state only.

    Call `settle` first after a replay: DIAGNOSED and RESHAPED (and PAUSED without a
    diagnosis) are transient and have no actions of their own.
    """
    s = state
    nodes = _reachable(s)
    phase = s.phase
    if phase == ev.PHASE_RUNNING:
        return [ResumeAll(s.step, nodes)]
    if phase == ev.PHASE_SUSPECTED:
        if s.recovery_mode == IN_JOB:
            return [StopWorkers(nodes, s.incident_cause, True, replace_slots(s))]
        return [StopWorkers(nodes, s.incident_cause)]
    if phase == ev.PHASE_PAUSED and s.needs_diagnosis:
        # a node already to be evicted (its own self-check, an operator) is no partner
        partners = tuple(n for n in nodes if n not in s.bad_nodes or n in s.suspects)
        return [
            StopWorkers(nodes, s.incident_cause),
            RunDiagnosis(diagnosis_id(s), tuple(sorted(s.suspects)), partners),
        ]
    if phase == ev.PHASE_RESTORING:
        out: list[Action] = [EvictNode(n, f"incident {s.incident_id}") for n in sorted(s.bad_nodes)]
        # the replica policy: what is left of a replica that sits out stops (a node of
        # several workers held its healthy ones)
        idle = tuple(n for n in s.sitting_out if _healthy(s, n) and n not in s.world.node_ids)
        if idle:
            out.append(StopAll(idle))
        wpn = s.world.workers_per_node
        out.append(
            StartWorkers(
                Layout.of(s.world),
                tuple((n, i * wpn) for i, n in enumerate(s.world.node_ids)),
                in_job=s.recovery_mode == IN_JOB,
            )
        )
        sources, reshard = restore_sources(s)
        out.append(Restore(s.restore_step, sources, reshard, s.incident_id, s.restore_attempts))
        return out
    if phase == ev.PHASE_FAILED:
        return [StopAll(nodes)]
    return []


def replace_slots(s: ev.JobState) -> tuple[tuple[str, int], ...]:
    """(node, local rank) of the open incident's ranks to replace, in the incident's world:
    its `replace_ranks`, and every rank of a node it evicts (`bad_nodes`, known at the stop:
    a failed self-check of its own, an operator's eviction).

    An evicted node's workers never rejoin, and its ranks restore from its buddy's copies,
    not from its ring (driver/loop.py `_ring_held`): held, they only cost the hold. A bad
    node's worker caught in a collective whose peers had left stayed there until the hold's
    limit killed it (2 s, twice in one bench-recovery ETTR run, every time the silently bad
    node's own worker); stopped at once, its peers' collectives end at once too."""
    w = s.incident_world if s.incident_world.node_ids else s.world
    wpn = max(1, w.workers_per_node)
    ranks = set(s.replace_ranks)
    bad = set(s.bad_nodes)
    for i, node in enumerate(w.node_ids):
        if node in bad:
            ranks.update(range(i * wpn, (i + 1) * wpn))
    out = []
    for r in sorted(ranks):
        i = r // wpn
        if 0 <= i < len(w.node_ids):
            out.append((w.node_ids[i], r % wpn))
    return tuple(out)


def restore_point(after: ev.JobState, restore: Restore | None, policy: Policy) -> dpb.RestorePoint:
    """Where the restarted workers restore (a rollback's step, else the newest: 0) and the
    newest rollback's batches to skip, in the state `after` the decision.

    The skip range is the newest Rollback event's (folded into the state), so nothing
    re-runs the policy. The skip goes with every restore, not only the rollback's own: a
    worker that crashes after the rollback but before the skipped step restores a copy
    from before the skip and must skip again (it skips only when its next step is the
    skip's; later copies hold the data position past the skipped batches).
    """
    if restore is None or not after.rollback_steps:
        return dpb.RestorePoint()
    point = dpb.RestorePoint(step=restore.step if after.HasField("rollback_to") else 0)
    if after.last_skip_batches and after.last_skip_from:
        point.skip_from_step = after.last_skip_from
        point.skip_batches = after.last_skip_batches
    elif after.last_skip_batches:  # a Rollback recorded before it carried its range
        spike_step, target = after.rollback_steps[-1], after.last_rollback_to
        skip = spikelib.RollbackPolicy(policy.spike).decide(
            spikelib.Spike(spike_step, 0.0, 0.0, 0.0, 0.0, False), [target]
        )
        if not skip.halt and skip.skip_batches:
            point.skip_from_step = skip.skip_first
            point.skip_batches = skip.skip_batches
    return point
