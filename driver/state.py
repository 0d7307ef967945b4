"""The job state as a pure fold over the event log: `state = fold(events, initial(job))`.

`apply` never mutates its input and never reads a clock, a file or the network, so a
driver that replays the log (after a crash, or as a new leader) rebuilds exactly the
state the old leader had. Snapshots store the folded `JobState`; folding the tail onto
a snapshot equals folding the whole history (tests/unit/test_state_fold.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from unbroken.proto import events_pb2 as ev

KEEP_CHECKPOINTS = 16  # checkpoint records kept in the folded state (newest last)
KEEP_ROLLBACKS = 16  # rollback spike steps kept (the rollback policy looks at recent ones)
PERSIST_COST_ALPHA = 0.3  # weight of a commit's persist time in the moving average
#: Records of LOST/EVICTED nodes kept in the state (oldest dropped first, PRUNE_SLACK at a
#: time, so the sort is paid once per PRUNE_SLACK losses; their history stays in the log).
#: A 2,500-registration state measured 1.99 MB unpruned, over etcd's 1.5 MiB request
#: limit, so every snapshot failed.
KEEP_GONE_NODES = 1000
PRUNE_SLACK = KEEP_GONE_NODES // 2
_GONE = (ev.NODE_STATE_LOST, ev.NODE_STATE_EVICTED)


def initial(job_id: str) -> ev.JobState:
    """The state of a job before its first event."""
    return ev.JobState(job_id=job_id, phase=ev.PHASE_STARTING)


def fold(events: Iterable[ev.Event], state: ev.JobState) -> ev.JobState:
    """Apply `events` in order to a copy of `state`."""
    out = ev.JobState()
    out.CopyFrom(state)
    for e in events:
        _apply_in_place(out, e)
    return out


def apply(state: ev.JobState, event: ev.Event) -> ev.JobState:
    """The state after `event`. Pure: `state` is not modified."""
    return fold((event,), state)


def _node(s: ev.JobState, node_id: str) -> ev.NodeRecord:
    rec = s.nodes[node_id]  # map access creates the entry
    if not rec.node_id:
        rec.node_id = node_id
    return rec


def _set_state(s: ev.JobState, rec: ev.NodeRecord, state: int, seq: int) -> None:
    """Move `rec` to `state`, keeping the count of gone records."""
    was_gone, gone = rec.state in _GONE, state in _GONE
    rec.state = state  # type: ignore[assignment]
    if gone and not was_gone:
        s.gone_nodes += 1
        rec.gone_seq = seq or s.last_seq
    elif was_gone and not gone:
        s.gone_nodes = max(0, s.gone_nodes - 1)  # a snapshot older than the count has 0
        rec.gone_seq = 0


def _prune(s: ev.JobState) -> None:
    """Drop the oldest gone node records once there are PRUNE_SLACK more than kept."""
    if s.gone_nodes <= KEEP_GONE_NODES + PRUNE_SLACK:
        return
    keep = {*s.world.node_ids, *s.suspects, *s.bad_nodes, *s.incident_world.node_ids}
    gone = sorted((r.gone_seq, n) for n, r in s.nodes.items() if r.state in _GONE and n not in keep)
    for _, n in gone[: s.gone_nodes - KEEP_GONE_NODES]:
        del s.nodes[n]
        s.gone_nodes -= 1
        s.pruned_nodes += 1


def _apply_in_place(s: ev.JobState, e: ev.Event) -> None:
    kind = e.WhichOneof("payload")
    assert kind is not None, "an event without payload reached the fold"
    assert e.seq == 0 or e.seq > s.last_seq, f"event {e.seq} folded after {s.last_seq}"
    if e.seq:
        s.last_seq = e.seq
    s.event_counts[kind] += 1
    if kind in CAUSE_KINDS:
        s.goodput.last_fault = kind
    handler = _HANDLERS.get(kind)
    if handler is not None:
        handler(s, e)


def _incident_began(s: ev.JobState, e: ev.Event) -> None:
    """Goodput: the job left RUNNING at this event's wall time (the first one counts)."""
    g = s.goodput
    if e.wall_time_unix_ns and not g.incident_began_ns:
        g.incident_began_ns = e.wall_time_unix_ns
        g.incident_cause = g.last_fault or "other"


def _incident_ended(s: ev.JobState, e: ev.Event, resumed_at: int | None) -> None:
    """Goodput: training runs again; the downtime goes to the incident's cause, and the
    steps between the newest one reached and the one resumed from are trained again."""
    g = s.goodput
    if not e.wall_time_unix_ns:
        return
    if not g.started_ns:
        g.started_ns = e.wall_time_unix_ns
    if g.incident_began_ns:
        lost = max(0, e.wall_time_unix_ns - g.incident_began_ns) / 1e9
        g.lost_s_by_cause[g.incident_cause or "other"] += lost
        g.incidents += 1
        g.incident_began_ns = 0
        g.incident_cause = ""
    if resumed_at is not None and s.step > resumed_at:
        g.steps_redone += s.step - resumed_at


def _job_started(s: ev.JobState, e: ev.Event) -> None:
    if e.wall_time_unix_ns and not s.goodput.started_ns:
        s.goodput.started_ns = e.wall_time_unix_ns
    p = e.job_started
    s.trainer = p.trainer
    s.world.CopyFrom(p.world)
    s.configured_world.CopyFrom(p.world)
    s.min_nodes, s.max_nodes = p.min_nodes, p.max_nodes


def _node_registered(s: ev.JobState, e: ev.Event) -> None:
    p = e.node_registered
    rec = _node(s, p.node_id)
    # The same agent process (its epoch) registering again while it trains in the world: a
    # reconnect (to a new leader), whatever its --spare flag says. A spare the world took
    # stays in it; turning it back into a spare emptied its place in the world and opened
    # an incident ("left the world") after a driver failover.
    reconnect = (
        rec.epoch == p.epoch and rec.state == ev.NODE_STATE_ACTIVE and p.node_id in s.world.node_ids
    )
    rec.epoch = p.epoch
    rec.hostname, rec.ip, rec.num_workers = p.hostname, p.ip, p.num_workers
    rec.registered_seq = e.seq
    rec.spare = p.spare
    rec.replica_buddy = p.replica_buddy
    if rec.state != ev.NODE_STATE_EVICTED and not reconnect:
        _set_state(s, rec, ev.NODE_STATE_SPARE if p.spare else ev.NODE_STATE_ACTIVE, e.seq)


def _node_lost(s: ev.JobState, e: ev.Event) -> None:
    rec = _node(s, e.node_lost.node_id)
    if e.node_lost.epoch and e.node_lost.epoch < rec.epoch:
        return  # the loss of an agent that has since been replaced by a newer epoch
    if rec.state != ev.NODE_STATE_EVICTED:
        _set_state(s, rec, ev.NODE_STATE_LOST, e.seq)
    rec.failures += 1
    _prune(s)


def _blame(field: str) -> Callable[[ev.JobState, ev.Event], None]:
    def handler(s: ev.JobState, e: ev.Event) -> None:
        _node(s, getattr(e, field).node_id).failures += 1

    return handler


def _diagnosis_verdict(s: ev.JobState, e: ev.Event) -> None:
    s.last_diagnosis_id = e.diagnosis_verdict.diagnosis_id


def _node_evicted(s: ev.JobState, e: ev.Event) -> None:
    _set_state(s, _node(s, e.node_evicted.node_id), ev.NODE_STATE_EVICTED, e.seq)
    _prune(s)


def _spare_assigned(s: ev.JobState, e: ev.Event) -> None:
    p = e.spare_assigned
    spare = _node(s, p.spare_node_id)
    _set_state(s, spare, ev.NODE_STATE_ACTIVE, e.seq)
    spare.spare = False
    ids = list(s.world.node_ids)
    if p.replaces_node_id in ids:
        ids[ids.index(p.replaces_node_id)] = p.spare_node_id
        del s.world.node_ids[:]
        s.world.node_ids.extend(ids)


def _world_resized(s: ev.JobState, e: ev.Event) -> None:
    s.world.CopyFrom(e.world_resized.new_world)
    for node_id in s.world.node_ids:  # spares taken into a resized world now work in it
        rec = _node(s, node_id)
        if rec.state == ev.NODE_STATE_SPARE:
            _set_state(s, rec, ev.NODE_STATE_ACTIVE, e.seq)
            rec.spare = False


def _checkpoint_committed(s: ev.JobState, e: ev.Event) -> None:
    p = e.checkpoint_committed
    if p.persist_s > 0 and math.isfinite(p.persist_s):
        a = PERSIST_COST_ALPHA if s.persist_cost_s else 1.0
        s.persist_cost_s += a * (p.persist_s - s.persist_cost_s)
    s.checkpoints.add(step=p.step, uri=p.uri, bytes=p.bytes, seq=e.seq, world=p.world)
    if len(s.checkpoints) > KEEP_CHECKPOINTS:
        del s.checkpoints[: len(s.checkpoints) - KEEP_CHECKPOINTS]


def _rollback(s: ev.JobState, e: ev.Event) -> None:
    s.skipped_batches += e.rollback.skip_batches
    s.step = e.rollback.to_step
    s.rollback_to = e.rollback.to_step
    s.last_rollback_to = e.rollback.to_step
    s.last_skip_from = e.rollback.skip_from_step
    s.last_skip_batches = e.rollback.skip_batches
    s.rollback_steps.append(e.rollback.from_step)
    if len(s.rollback_steps) > KEEP_ROLLBACKS:
        del s.rollback_steps[: len(s.rollback_steps) - KEEP_ROLLBACKS]


def _restore_started(s: ev.JobState, e: ev.Event) -> None:
    s.phase = ev.PHASE_RESTORING
    s.restore_step = e.restore_started.step
    s.restore_attempts += 1


def _restore_finished(s: ev.JobState, e: ev.Event) -> None:
    """Goodput: an incident whose restore read storage (the memory tier could not serve
    it) counts toward the persistence interval's failure rate."""
    r = e.restore_finished
    if r.ok and r.storage_ranks:
        s.goodput.storage_incidents += 1


def _close_incident(s: ev.JobState) -> None:
    s.incident_id = ""
    s.incident_cause = ""
    del s.suspects[:]
    del s.bad_nodes[:]
    s.needs_diagnosis = False
    s.restore_attempts = 0
    s.ClearField("rollback_to")
    s.ClearField("incident_world")
    s.recovery_mode = ""
    del s.replace_ranks[:]


def _training_paused(s: ev.JobState, e: ev.Event) -> None:
    _incident_began(s, e)
    s.phase = ev.PHASE_PAUSED
    s.step = max(s.step, e.training_paused.at_step)
    s.restore_step = e.training_paused.restore_step


def _training_resumed(s: ev.JobState, e: ev.Event) -> None:
    p = e.training_resumed
    _incident_ended(s, e, p.at_step)
    s.phase = ev.PHASE_RUNNING
    s.step = p.at_step
    if p.HasField("world"):
        s.world.CopyFrom(p.world)
    _close_incident(s)


def _leader_elected(s: ev.JobState, e: ev.Event) -> None:
    s.leader = e.leader_elected.driver_id
    s.leader_term = e.leader_elected.term


def _recovery_transition(s: ev.JobState, e: ev.Event) -> None:
    p = e.recovery_transition
    if p.to_phase == ev.PHASE_RUNNING:
        _incident_ended(s, e, None)
    elif p.to_phase not in (ev.PHASE_FINISHED, ev.PHASE_FAILED):
        _incident_began(s, e)
    s.phase = p.to_phase
    if p.to_phase == ev.PHASE_RUNNING:
        _close_incident(s)
        return
    if p.incident_id and not s.incident_id:  # a new incident: remember the world it hit
        s.incident_world.CopyFrom(s.world)
    if p.incident_id:
        s.incident_id = p.incident_id
    if p.to_phase == ev.PHASE_SUSPECTED and p.reason:
        s.incident_cause = p.reason
    del s.suspects[:]
    s.suspects.extend(p.suspects)
    del s.bad_nodes[:]
    s.bad_nodes.extend(p.bad_nodes)
    s.needs_diagnosis = p.diagnose
    s.recovery_mode = p.mode
    del s.replace_ranks[:]
    s.replace_ranks.extend(p.replace_ranks)


def _job_finished(s: ev.JobState, e: ev.Event) -> None:
    s.phase = ev.PHASE_FINISHED if e.job_finished.ok else ev.PHASE_FAILED
    s.step = e.job_finished.step


# the events whose kind names an incident's cause in the goodput ledger
CAUSE_KINDS = frozenset(
    {
        "node_lost",
        "worker_failed",
        "hang_suspected",
        "straggler_suspected",
        "log_alert",
        "loss_spike",
        "self_check_reported",
        "diagnosis_verdict",
        "operator_action",
        "node_evicted",
        "world_resized",
    }
)

_HANDLERS: dict[str, Callable[[ev.JobState, ev.Event], None]] = {
    "job_started": _job_started,
    "node_registered": _node_registered,
    "node_lost": _node_lost,
    "worker_failed": _blame("worker_failed"),
    "hang_suspected": _blame("hang_suspected"),
    "straggler_suspected": _blame("straggler_suspected"),
    "log_alert": _blame("log_alert"),
    "diagnosis_verdict": _diagnosis_verdict,
    "node_evicted": _node_evicted,
    "spare_assigned": _spare_assigned,
    "world_resized": _world_resized,
    "checkpoint_committed": _checkpoint_committed,
    "rollback": _rollback,
    "restore_started": _restore_started,
    "restore_finished": _restore_finished,
    "training_paused": _training_paused,
    "training_resumed": _training_resumed,
    "leader_elected": _leader_elected,
    "recovery_transition": _recovery_transition,
    "job_finished": _job_finished,
}
