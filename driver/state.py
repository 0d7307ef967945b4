"""The job state as a pure fold over the event log: `state = fold(events, initial(job))`.

`apply` never mutates its input and never reads a clock, a file or the network, so a
driver that replays the log (after a crash, or as a new leader) rebuilds exactly the
state the old leader had. Snapshots store the folded `JobState`; folding the tail onto
a snapshot equals folding the whole history (tests/unit/test_state_fold.py).
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Iterable

from unbroken.driver.eventkinds import BLAME_KINDS, CAUSE_KINDS
from unbroken.proto import events_pb2 as ev

KEEP_CHECKPOINTS = 16  # checkpoint records kept in the folded state (newest last)
KEEP_VERIFIED = 16  # verified steps kept (a rollback after an SDC goes to the newest)
KEEP_ROLLBACKS = 16  # rollback spike steps kept (the rollback policy looks at recent ones)
KEEP_FAULT_STEPS = 4  # each node's newest failures' steps (the policy's window counts them)
PERSIST_COST_ALPHA = 0.3  # weight of a commit's persist time in the moving average
#: Records of LOST/EVICTED nodes kept in the state (oldest dropped first, PRUNE_SLACK at a
#: time, so the sort is paid once per PRUNE_SLACK losses; their history stays in the log).
#: A 2,500-registration state measured 1.99 MB unpruned, over etcd's 1.5 MiB request
#: limit, so every snapshot failed.
KEEP_GONE_NODES = 1000
PRUNE_SLACK = KEEP_GONE_NODES // 2
_GONE = (ev.NODE_STATE_LOST, ev.NODE_STATE_EVICTED)
#: The gone records of a state in the order they went, so that a prune costs the gone
#: records and not every node: id(state) -> a heap of (gone_seq, node_id). It lives beside
#: the states, not in them (a snapshot stores nothing twice), for the few states folded
#: lately (the journal's, a replay's); every prune checks it against its state first
#: (`_gone_heap`), so a copy, an undo or a reused id can make it stale but never wrong.
_GONE_HEAPS: collections.OrderedDict[int, list[tuple[int, str]]] = collections.OrderedDict()
_GONE_HEAPS_KEPT = 8


def initial(job_id: str) -> ev.JobState:
    """The state of a job before its first event."""
    return ev.JobState(job_id=job_id, phase=ev.PHASE_STARTING)


def fold(events: Iterable[ev.Event], state: ev.JobState) -> ev.JobState:
    """Apply `events` in order to a copy of `state`."""
    out = ev.JobState()
    out.CopyFrom(state)
    fold_into(out, events)
    return out


def fold_into(s: ev.JobState, events: Iterable[ev.Event]) -> None:
    """Apply `events` in order to `s` itself (a replay's own copy: nothing undoes it).

    The same as `_apply_in_place` per event, with the per-kind counts summed in a dict and
    written once at the end (a protobuf map update per event was a tenth of a replay)."""
    counts: dict[str, int] = {}
    get = counts.get
    body = _apply_body
    try:
        for e in events:
            kind = body(s, e)
            counts[kind] = get(kind, 0) + 1
    finally:
        ec = s.event_counts
        for kind, n in counts.items():
            ec[kind] += n


def apply(state: ev.JobState, event: ev.Event) -> ev.JobState:
    """The state after `event`. Pure: `state` is not modified."""
    return fold((event,), state)


#: Called with a node's id before the fold changes (or creates, or drops) its record; set
#: by driver/fold.py's undo while it folds in place (None: nobody keeps undo records).
_touch: Callable[[str], None] | None = None


def set_touch_hook(hook: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Install the node-touch hook for in-place folds; returns the one it replaces."""
    global _touch
    prev, _touch = _touch, hook
    return prev


def apply_in_place(state: ev.JobState, event: ev.Event) -> None:
    """Fold `event` into `state` itself (driver/fold.py undoes it when asked)."""
    _apply_in_place(state, event)


def _node(s: ev.JobState, node_id: str) -> ev.NodeRecord:
    if _touch is not None:
        _touch(node_id)
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
        heap = _GONE_HEAPS.get(id(s))
        if heap is not None:
            heapq.heappush(heap, (rec.gone_seq, rec.node_id))
            if len(heap) > 2 * (KEEP_GONE_NODES + PRUNE_SLACK) + s.gone_nodes:
                del _GONE_HEAPS[id(s)]  # mostly stale (nodes that came back): rebuilt at need
    elif was_gone and not gone:
        s.gone_nodes = max(0, s.gone_nodes - 1)  # a snapshot older than the count has 0
        rec.gone_seq = 0


def _prune(s: ev.JobState) -> None:
    """Drop the oldest gone node records once there are PRUNE_SLACK more than kept.

    The oldest are those with the lowest (gone_seq, node id) outside the world, the
    incident's world, the suspects and the bad nodes. They come off the state's heap of
    gone records, so a prune costs the gone records (at most KEEP_GONE_NODES +
    PRUNE_SLACK, plus those that came back since the last prune), not a pass over every
    node of the job.

    A prune that cannot get down to KEEP_GONE_NODES (the gone records left are all to be
    kept: a world's nodes lost in a storm) is not tried again until PRUNE_SLACK more are
    gone (`prune_mark`): at 10,240 nodes each of 3,000 losses re-read the world and every
    gone record, 38 % of the leader's time in an incident."""
    if s.gone_nodes <= max(KEEP_GONE_NODES + PRUNE_SLACK, s.prune_mark):
        return
    keep = {*s.world.node_ids, *s.suspects, *s.bad_nodes, *s.incident_world.node_ids}
    keep.update(s.sitting_out)
    heap = _gone_heap(s)
    nodes = s.nodes
    kept = []
    drop = s.gone_nodes - KEEP_GONE_NODES
    while drop > 0 and heap:
        item = heapq.heappop(heap)
        n = item[1]
        if n in keep:
            kept.append(item)
            continue
        if _touch is not None:
            _touch(n)
        del nodes[n]
        s.gone_nodes -= 1
        s.pruned_nodes += 1
        drop -= 1
    for item in kept:
        heapq.heappush(heap, item)
    s.prune_mark = s.gone_nodes + PRUNE_SLACK if s.gone_nodes > KEEP_GONE_NODES else 0


def _gone_heap(s: ev.JobState) -> list[tuple[int, str]]:
    """The heap of `s`'s gone records: exactly one (gone_seq, node id) per record whose
    state is LOST or EVICTED. The heap kept for `s` is used when every record it names
    is still gone since that seq and they are as many as `s.gone_nodes` (then none is
    missing); otherwise one pass over the nodes builds it again."""
    heap = _GONE_HEAPS.pop(id(s), None)
    nodes = s.nodes
    if heap is not None:
        live: dict[str, int] = {}
        get, gone = nodes.get, _GONE
        for seq, n in heap:
            r = get(n)
            if r is not None and r.gone_seq == seq and r.state in gone:
                live[n] = seq
        if len(live) == s.gone_nodes:
            heap = [(seq, n) for n, seq in live.items()]
        else:
            heap = None
    if heap is None:
        heap = []
        for n in nodes:  # keys, then one lookup each: twice as fast as the map's items()
            r = nodes[n]
            if r.state in _GONE:
                heap.append((r.gone_seq, n))
    heapq.heapify(heap)
    _GONE_HEAPS[id(s)] = heap
    while len(_GONE_HEAPS) > _GONE_HEAPS_KEPT:
        _GONE_HEAPS.popitem(last=False)
    return heap


def _apply_in_place(s: ev.JobState, e: ev.Event) -> None:
    s.event_counts[_apply_body(s, e)] += 1


def _apply_body(s: ev.JobState, e: ev.Event) -> str:
    """Fold `e` into `s` but for its kind's count; returns the kind."""
    kind = e.WhichOneof("payload")
    assert kind is not None, "an event without payload reached the fold"
    seq = e.seq
    if seq:
        assert seq > s.last_seq, f"event {seq} folded after {s.last_seq}"
        s.last_seq = seq
    g = s.goodput
    if kind in CAUSE_KINDS:
        g.last_fault = kind
        if not g.incident_began_ns:
            g.pending_detect_s = _silence_s(e, kind)
    handler = _HANDLERS.get(kind)
    if handler is not None:
        handler(s, e)
    if g.incident_began_ns and e.wall_time_unix_ns:
        _segment(s, e)
    return kind


def _silence_s(e: ev.Event, kind: str) -> float:
    """How long the fault went on before this event declared it (0 when it says nothing)."""
    if kind == "node_lost":
        ms = e.node_lost.silent_ms
    elif kind == "hang_suspected":
        ms = e.hang_suspected.silent_ms
    elif kind == "worker_failed":
        ms = e.worker_failed.silent_ms
    else:
        return 0.0
    return ms / 1000.0 if ms > 0 and math.isfinite(ms) else 0.0


def _category(s: ev.JobState) -> str:
    """Goodput: what an open incident's time is spent on, from the phase it is in."""
    if s.phase == ev.PHASE_SUSPECTED:
        return "pause"  # the workers are being stopped at a step
    if s.phase == ev.PHASE_DIAGNOSED or (s.phase == ev.PHASE_PAUSED and s.needs_diagnosis):
        return "diagnosis"
    if s.phase == ev.PHASE_RESTORING:
        return "restore"  # workers (re)started and loading the restored state
    return "restart"  # paused: choosing the new world, replacing nodes, starting them


def _segment(s: ev.JobState, e: ev.Event) -> None:
    """Goodput: the open incident's time so far goes to the category it was spent on."""
    g = s.goodput
    if not g.incident_began_ns or not e.wall_time_unix_ns:
        return
    cat = _category(s)
    if cat == g.segment_category:
        return
    if g.segment_category:
        spent = max(0, e.wall_time_unix_ns - g.segment_began_ns) / 1e9
        g.lost_s_by_category[g.segment_category] += spent
    g.segment_category, g.segment_began_ns = cat, e.wall_time_unix_ns


def _incident_began(s: ev.JobState, e: ev.Event) -> None:
    """Goodput: the job left RUNNING at this event's wall time (the first one counts)."""
    g = s.goodput
    if e.wall_time_unix_ns and not g.incident_began_ns:
        g.incident_began_ns = e.wall_time_unix_ns
        g.incident_cause = g.last_fault or "other"
        g.segment_began_ns, g.segment_category = e.wall_time_unix_ns, ""
        _startup_over(s, e)
        # The fault went on before it was declared (a silent node, a rank without progress):
        # no step was made meanwhile, so that time is lost too, but never more than the
        # time since training last (re)started.
        detect = g.pending_detect_s
        if g.running_since_ns:
            detect = min(detect, max(0, e.wall_time_unix_ns - g.running_since_ns) / 1e9)
        if detect > 0:
            g.lost_s_by_category["detection"] += detect
            g.lost_s_by_cause[g.incident_cause] += detect
        g.pending_detect_s = 0.0


def _startup_over(s: ev.JobState, e: ev.Event, trained_s: float = 0.0) -> None:
    """Goodput: the job's start-up (JobStarted to its first step) is charged once; the
    ranks had trained `trained_s` already when the driver saw them step."""
    g = s.goodput
    if g.startup_open and g.started_ns and "startup" not in g.lost_s_by_category:
        end = max(g.started_ns, e.wall_time_unix_ns - int(trained_s * 1e9))
        spent = (end - g.started_ns) / 1e9
        g.lost_s_by_category["startup"] = spent
        g.lost_s_by_cause["startup"] += spent
        g.running_since_ns = end  # a fault's silence is never charged twice
    g.startup_open = False


def _incident_ended(s: ev.JobState, e: ev.Event, resumed_at: int | None) -> None:
    """Goodput: training runs again; the downtime goes to the incident's cause, and the
    steps between the newest one reached and the one resumed from are trained again."""
    g = s.goodput
    if not e.wall_time_unix_ns:
        return
    if not g.started_ns:
        g.started_ns = e.wall_time_unix_ns
    # the ranks trained already when the driver saw them step (RestoreFinished.trained_s)
    end = e.wall_time_unix_ns - int(g.resumed_before_s * 1e9)
    g.resumed_before_s = 0.0
    if g.incident_began_ns:
        end = max(end, g.segment_began_ns or g.incident_began_ns)
        lost = max(0, end - g.incident_began_ns) / 1e9
        g.lost_s_by_cause[g.incident_cause or "other"] += lost
        if g.segment_category:
            spent = max(0, end - g.segment_began_ns) / 1e9
            g.lost_s_by_category[g.segment_category] += spent
        g.incidents += 1
        g.incident_began_ns = 0
        g.incident_cause = ""
        g.segment_began_ns, g.segment_category = 0, ""
    g.running_since_ns = end
    if resumed_at is not None and s.step > resumed_at:
        g.steps_redone += s.step - resumed_at


def _job_started(s: ev.JobState, e: ev.Event) -> None:
    if e.wall_time_unix_ns and not s.goodput.started_ns:
        s.goodput.started_ns = e.wall_time_unix_ns
        # until every rank stepped (TrainingStepping), when the driver will say so
        s.goodput.startup_open = e.job_started.reports_startup
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
    rec.replica_pubkey = p.replica_pubkey
    if rec.state != ev.NODE_STATE_EVICTED and not reconnect:
        _set_state(s, rec, ev.NODE_STATE_SPARE if p.spare else ev.NODE_STATE_ACTIVE, e.seq)


def _node_lost(s: ev.JobState, e: ev.Event) -> None:
    p = e.node_lost
    rec = _node(s, p.node_id)
    epoch = p.epoch
    if epoch and epoch < rec.epoch:
        return  # the loss of an agent that has since been replaced by a newer epoch
    if rec.state != ev.NODE_STATE_EVICTED:
        _set_state(s, rec, ev.NODE_STATE_LOST, e.seq)
    _failed(rec, s.step)
    if s.gone_nodes > KEEP_GONE_NODES + PRUNE_SLACK:
        _prune(s)


def _failed(rec: ev.NodeRecord, step: int) -> None:
    """One more failure on `rec`, at the job's `step`."""
    rec.failures += 1
    rec.fault_steps.append(step)
    if len(rec.fault_steps) > KEEP_FAULT_STEPS:
        del rec.fault_steps[: len(rec.fault_steps) - KEEP_FAULT_STEPS]


def _blame(field: str) -> Callable[[ev.JobState, ev.Event], None]:
    def handler(s: ev.JobState, e: ev.Event) -> None:
        p = getattr(e, field)
        own = getattr(p, "last_step", 0) or getattr(p, "stuck_at_step", 0)  # where it says
        _failed(_node(s, p.node_id), max(s.step, own))

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


def _world_nodes(s: ev.JobState, e: ev.Event) -> None:
    """More node ids of the layout the event before it set (driver/worldsplit.py)."""
    p = e.world_nodes
    if p.of == "job_started.world":
        s.world.node_ids.extend(p.node_ids)
        s.configured_world.node_ids.extend(p.node_ids)
    elif p.of in ("world_resized.new_world", "training_resumed.world"):
        s.world.node_ids.extend(p.node_ids)
        if p.of == "world_resized.new_world":
            for node_id in p.node_ids:  # as _world_resized does for the head's ids
                rec = _node(s, node_id)
                if rec.state == ev.NODE_STATE_SPARE:
                    _set_state(s, rec, ev.NODE_STATE_ACTIVE, e.seq)
                    rec.spare = False
    elif p.of == "checkpoint_committed.world" and s.checkpoints:
        s.checkpoints[-1].world.node_ids.extend(p.node_ids)


def _checkpoint_committed(s: ev.JobState, e: ev.Event) -> None:
    p = e.checkpoint_committed
    if p.persist_s > 0 and math.isfinite(p.persist_s):
        a = PERSIST_COST_ALPHA if s.persist_cost_s else 1.0
        s.persist_cost_s += a * (p.persist_s - s.persist_cost_s)
    s.checkpoints.add(
        step=p.step,
        uri=p.uri,
        bytes=p.bytes,
        seq=e.seq,
        world=p.world,
        wall_time_unix_ns=e.wall_time_unix_ns,
    )
    if p.step in s.verified_steps:
        s.checkpoints[-1].verified = True
    if len(s.checkpoints) > KEEP_CHECKPOINTS:
        del s.checkpoints[: len(s.checkpoints) - KEEP_CHECKPOINTS]


def _step_verified(s: ev.JobState, e: ev.Event) -> None:
    step = e.step_verified.step
    if step in s.verified_steps:
        return
    s.verified_steps.append(step)
    if len(s.verified_steps) > KEEP_VERIFIED:
        del s.verified_steps[: len(s.verified_steps) - KEEP_VERIFIED]
    for c in s.checkpoints:
        if c.step == step:
            c.verified = True


def _sdc_suspected(s: ev.JobState, e: ev.Event) -> None:
    p = e.sdc_suspected
    s.sdc_suspected += 1
    s.last_sdc_step = p.step
    # a step at or after a disagreement is no rollback target any more
    keep = [v for v in s.verified_steps if v < p.step]
    del s.verified_steps[:]
    s.verified_steps.extend(keep)
    if p.resolved:
        for n in set(p.suspect_nodes):
            s.sdc_by_node[n] = s.sdc_by_node.get(n, 0) + 1


def _training_stepping(s: ev.JobState, e: ev.Event) -> None:
    t = e.training_stepping.trained_s
    if e.wall_time_unix_ns:
        _startup_over(s, e, t if math.isfinite(t) and t > 0 else 0.0)


def _rollback(s: ev.JobState, e: ev.Event) -> None:
    s.skipped_batches += e.rollback.skip_batches
    s.step = e.rollback.to_step
    s.rollback_to = e.rollback.to_step
    s.last_rollback_to = e.rollback.to_step
    del s.rollback_diagnose[:]
    s.rollback_diagnose.extend(e.rollback.diagnose_nodes)
    s.last_skip_from = e.rollback.skip_from_step
    s.last_skip_batches = e.rollback.skip_batches
    s.rollback_steps.append(e.rollback.from_step)
    if len(s.rollback_steps) > KEEP_ROLLBACKS:
        del s.rollback_steps[: len(s.rollback_steps) - KEEP_ROLLBACKS]


def _restore_started(s: ev.JobState, e: ev.Event) -> None:
    s.phase = ev.PHASE_RESTORING
    s.restore_step = e.restore_started.step
    s.restore_attempts += 1
    s.goodput.resumed_before_s = 0.0


def _restore_finished(s: ev.JobState, e: ev.Event) -> None:
    """Goodput: an incident whose restore read storage (the memory tier could not serve
    it) counts toward the persistence interval's failure rate."""
    r = e.restore_finished
    if r.ok and r.storage_ranks:
        s.goodput.storage_incidents += 1
    if r.ok and math.isfinite(r.trained_s):
        s.goodput.resumed_before_s = max(0.0, r.trained_s)


def _close_incident(s: ev.JobState) -> None:
    s.incident_id = ""
    s.incident_cause = ""
    del s.suspects[:]
    del s.bad_nodes[:]
    s.needs_diagnosis = False
    s.restore_attempts = 0
    s.failed_restores = 0
    s.ClearField("rollback_to")
    del s.rollback_diagnose[:]
    s.ClearField("incident_world")
    s.recovery_mode = ""
    del s.replace_ranks[:]
    s.awaiting_nodes = ""


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
    s.leader_scope = e.leader_elected.scope


def _recovery_transition(s: ev.JobState, e: ev.Event) -> None:
    p = e.recovery_transition
    if s.phase == ev.PHASE_RESTORING and p.to_phase != ev.PHASE_RUNNING and not p.by_operator:
        s.failed_restores += 1  # the restore failed, or a fault cut it short
    if p.rearm:  # an operator's resume: the old incident is over, its budget with it
        _close_incident(s)
        s.finished_reason = ""
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
    s.sitting_out.extend(n for n in p.sit_out if n not in s.sitting_out)
    s.awaiting_nodes = p.awaiting_nodes


def _replica_ready(s: ev.JobState, e: ev.Event) -> None:
    released = set(e.replica_ready.node_ids)
    keep = [n for n in s.sitting_out if n not in released]
    del s.sitting_out[:]
    s.sitting_out.extend(keep)


def _job_finished(s: ev.JobState, e: ev.Event) -> None:
    s.phase = ev.PHASE_FINISHED if e.job_finished.ok else ev.PHASE_FAILED
    s.step = e.job_finished.step
    s.finished_reason = e.job_finished.reason
    s.awaiting_nodes = ""


_HANDLERS: dict[str, Callable[[ev.JobState, ev.Event], None]] = {
    "job_started": _job_started,
    "node_registered": _node_registered,
    "node_lost": _node_lost,
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
    "training_stepping": _training_stepping,
    "world_nodes": _world_nodes,
    "step_verified": _step_verified,
    "sdc_suspected": _sdc_suspected,
    "replica_ready": _replica_ready,
    # a fault that names a node counts one failure on it (its row in driver/eventkinds.py)
    **{kind: _blame(kind) for kind in BLAME_KINDS},
}
