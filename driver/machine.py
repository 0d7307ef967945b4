"""The recovery state machine: a pure transition function and pure pending actions.

docs/architecture.md#the-decider, "The recovery loop"::

    RUNNING --fault--> SUSPECTED --stop the workers (each flash-saved every step)--> PAUSED
    PAUSED --diagnose (only when the cause is unclear)--> DIAGNOSED
    DIAGNOSED --evict bad nodes; take spares, or shrink dp--> RESHAPED
    RESHAPED --restore every rank, reshard if the world changed--> RESTORING
    RESTORING --all ranks report the restored step--> RUNNING

Two pure functions make the whole loop; the asyncio shell around them only moves bytes:

- `decide(state, observation, policy) -> Decision`: `state` is the folded job state
  *before* the observation. `Decision.events` are appended in order (the observation
  itself first when it is an event, then every transition as a typed event), and
  `Decision.actions` are the commands the shell sends to agents.
- `pending_actions(state, policy)`: what must (still) be done in the current phase,
  derived only from the folded state. Every action is idempotent (re-pausing a paused
  job, re-running a diagnosis with the same id, re-sending StartWorkers / Restore /
  Resume), so a driver that crashed anywhere replays the log, calls `settle` (which
  finishes a half-appended decision: the transient phases PAUSED-without-diagnosis,
  DIAGNOSED and RESHAPED, a lost node still in a RUNNING world, an unapplied rollback,
  a possible grow-back) and sends `pending_actions` again.

Incident rules. A fault on a node of the world opens an incident (RUNNING) or folds into
the open one: suspects and nodes to evict grow, and the machine goes back to SUSPECTED
when the job's state may have changed under it (a node lost, or anything once workers are
being restarted), or stays in PAUSED (more suspects to diagnose). Faults from lost or
evicted nodes, and duplicates, are recorded and ignored; a fault on a spare (or an idle
node outside the world) marks it bad (evicted). A failed self-check that is the node's own
result (`Policy.self_check_evicts`: a wrong matmul, uncorrected ECC errors) marks it to
evict without a diagnosis; an unclear fault of a node already to be evicted asks for no
diagnosis. A loss spike rolls back to the newest committed checkpoint before the spike,
without eviction (`unbroken.recovery.spike`).

Recovery modes. Each incident records its mode in every transition (`RecoveryTransition.mode`)
and in the TrainingResumed that ends it. In-job (`Policy.in_job`, the default): only the faulty
ranks' processes are replaced (`replace_ranks`: a killed or stopped worker's; a lost or evicted
node's go with it) and every other worker is held and rejoins the new world in its process.
Restart: every worker process is replaced. An incident is a restart when its fault is suspect
(a worker's exit other than a kill from outside, `faults.CLEAN_KILLS`; a `SUSPECT_KEYWORDS` log
alert), when it needs a diagnosis, after a failed restore, or when a suspect fault joins it;
it never turns back to in-job.

World rules: each removed node is replaced by a healthy spare in its rank position (same
world); with too few spares dp shrinks to the largest dp with dp x pp x tp <= available
workers (pp x tp fixed, whole nodes), never below `min_nodes`: then the reshape waits
(`JobState.awaiting_nodes`, DIAGNOSED) for lost nodes to come back or nodes to join, and
plans again at each registration; after `Policy.await_nodes_s` (driver/nodewait.py) the job
fails (JobFinished ok=false with the reason); dp grows back, up to the configured world,
when nodes return. The replica policy (`Policy.keep_training`, driver/replicapolicy.py)
sits the faulty replica out instead: the world shrinks at once without it and no spare, and
no grow-back takes nodes until the leader releases it (`ReplicaReady`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from unbroken.driver import replicapolicy
from unbroken.driver import sdc as sdclib
from unbroken.driver import state as statelib

# the actions, re-exported: callers name them machine.X
from unbroken.driver.actions import Action as Action
from unbroken.driver.actions import (
    Decision,
    Layout,
    Observation,
    Paused,
    Phase,
)
from unbroken.driver.actions import EvictNode as EvictNode
from unbroken.driver.actions import Restore as Restore
from unbroken.driver.actions import ResumeAll as ResumeAll
from unbroken.driver.actions import RunDiagnosis as RunDiagnosis
from unbroken.driver.actions import StartWorkers as StartWorkers
from unbroken.driver.actions import StopAll as StopAll
from unbroken.driver.actions import StopWorkers as StopWorkers
from unbroken.driver.eventkinds import STALE_KINDS
from unbroken.driver.faults import CLEAR, EVICT, LOST, UNCLEAR, classify, fault_ranks
from unbroken.driver.faults import SYMPTOM_KEYWORDS as SYMPTOM_KEYWORDS
from unbroken.driver.faults import suspect_exit as suspect_exit
from unbroken.driver.policy import IN_JOB, RESTART, Policy
from unbroken.driver.policy import Reshape as Reshape
from unbroken.driver.worldplan import (
    _inactive,
    _pool,
    _state_of,
    diagnosis_id,
    few,
    plan_world,
    restore_sources,
    restore_started,
)
from unbroken.driver.worldplan import pending_actions as pending_actions
from unbroken.driver.worldplan import replace_slots as replace_slots
from unbroken.driver.worldplan import restore_source as restore_source
from unbroken.proto import events_pb2 as ev
from unbroken.recovery import spike as spikelib

MAX_SETTLE = 16  # automatic transitions per decision (the loop needs at most 4)


# ---------------------------------------------------------------- the fold as we go
class _Draft:
    """Events being decided, with the state they lead to (folded as they are added): the
    first event copies the state given, the others fold into that copy in place (a copy
    per event was 2-3 MB at 10,240 nodes), so read `before` for what an event changes."""

    def __init__(self, state: ev.JobState, cause: str) -> None:
        self.state = state
        self.events: list[ev.Event] = []
        self.cause = cause
        self._own = False  # whether `state` is the draft's own copy yet

    def add(self, event: ev.Event, *, record: bool = False) -> None:
        if not record and not event.cause:
            event.cause = self.cause
        self.events.append(event)
        if not self._own:  # (a fold of no events is a copy)
            self.state, self._own = statelib.fold((), self.state), True
        statelib.apply_in_place(self.state, event)

    def transition(
        self,
        to: Phase,
        reason: str,
        *,
        incident_id: str | None = None,
        suspects: Iterable[str] | None = None,
        bad: Iterable[str] | None = None,
        diagnose: bool | None = None,
        by_operator: bool = False,
        rearm: bool = False,
        mode: str | None = None,
        replace: Iterable[int] | None = None,
        sit_out: Iterable[str] = (),
        awaiting: str = "",
    ) -> None:
        s = self.state
        self.add(
            ev.Event(
                recovery_transition=ev.RecoveryTransition(
                    from_phase=s.phase,
                    to_phase=to,
                    incident_id=s.incident_id if incident_id is None else incident_id,
                    reason=reason,
                    suspects=sorted(set(s.suspects if suspects is None else suspects)),
                    bad_nodes=sorted(set(s.bad_nodes if bad is None else bad)),
                    diagnose=s.needs_diagnosis if diagnose is None else diagnose,
                    by_operator=by_operator,
                    rearm=rearm,
                    mode=s.recovery_mode if mode is None else mode,
                    replace_ranks=sorted(set(s.replace_ranks if replace is None else replace)),
                    sit_out=list(sit_out),
                    awaiting_nodes=awaiting,
                )
            )
        )


# ---------------------------------------------------------------- the transition function
_JOINING = (ev.PHASE_STARTING, 0)  # phases where a registration is recorded only


def decide(state: ev.JobState, observation: Observation, policy: Policy) -> Decision:
    """The events and actions for `observation`, given the state before it. Pure.

    Args:
        state: the folded job state before the observation.
        observation: a fault or progress event (recorded as the decision's first event),
            or a `Paused` progress report.
        policy: the recovery policy.

    Returns:
        The decision: `fold(decision.events, state)` is the new state, whose phase is
        `decision.phase` and whose `pending_actions` are `decision.actions`.
    """
    if (
        isinstance(observation, ev.Event)
        and state.phase in _JOINING
        and observation.WhichOneof("payload") == "node_registered"
    ):
        # a node joining a job not started yet: recorded only, nothing to settle and no
        # actions (the fold keeps the phase), so no draft, a copy of the whole state (a
        # 10,000-node join paid one per registration)
        note = f"recorded only: the job is {ev.Phase.Name(state.phase)}"
        return Decision(events=(observation,), actions=(), phase=state.phase, note=note)
    cause = observation.event_id if isinstance(observation, ev.Event) else "paused"
    draft = _Draft(state, cause or "observation")
    if isinstance(observation, ev.Event):
        draft.add(observation, record=True)
    note = _react(state, draft, observation, policy)
    _settle(draft, policy)
    return Decision(
        events=tuple(draft.events),
        actions=tuple(pending_actions(draft.state, policy)),
        phase=draft.state.phase,
        note=note,
    )


def reconnect(state: ev.JobState, e: ev.Event) -> bool:
    """Whether `e` is a NodeRegistered of a node's current agent (same epoch) that leaves
    its state as it is: an active node registering as a worker, or a spare as a spare.

    Such an event decides nothing (`decide` records it and its actions are the state's
    pending ones, unchanged), so a caller may record it without deciding. O(1): no look
    at the world (an active node is active whether in the world or not)."""
    if e.WhichOneof("payload") != "node_registered":
        return False
    p = e.node_registered
    rec = state.nodes.get(p.node_id)
    if rec is None or rec.epoch != p.epoch or not p.epoch:
        return False
    if p.spare:
        return rec.state == ev.NODE_STATE_SPARE
    return rec.state == ev.NODE_STATE_ACTIVE


def settle(state: ev.JobState, policy: Policy) -> Decision:
    """The automatic transitions due in `state` (after a replay, or a half-appended decision)."""
    draft = _Draft(state, "settle")
    _settle(draft, policy)
    return Decision(
        events=tuple(draft.events),
        actions=tuple(pending_actions(draft.state, policy)),
        phase=draft.state.phase,
    )


RESUME = "resume"  # OperatorAction.action of `unbroken resume`


def _react(before: ev.JobState, d: _Draft, obs: Observation, policy: Policy) -> str:
    """Append the reaction to `obs`; return a note when it is ignored."""
    phase = before.phase
    if isinstance(obs, ev.Event) and obs.WhichOneof("payload") == "operator_action":
        if obs.operator_action.action == RESUME:
            return _on_resume(before, d, obs.operator_action)
    if phase in (ev.PHASE_FINISHED, ev.PHASE_FAILED, ev.PHASE_STARTING, 0):
        return f"recorded only: the job is {ev.Phase.Name(phase)}"
    if isinstance(obs, Paused):
        return _on_paused(before, d, obs)
    kind = obs.WhichOneof("payload")
    if kind == "diagnosis_verdict":
        return _on_verdict(before, d, obs.diagnosis_verdict, policy)
    if kind == "restore_finished":
        return _on_restored(before, d, obs.restore_finished)
    if kind == "replica_ready":
        return ""  # the sat-out nodes are free again: the settle grows back if it can
    if kind == "node_wait_expired":
        return _on_wait_expired(before, d, obs.node_wait_expired)
    if kind == "loss_spike":
        return _on_spike(before, d, obs.loss_spike, policy)
    if kind == "sdc_suspected":
        return _on_sdc(before, d, obs.sdc_suspected, policy)
    if kind == "node_registered":
        p = obs.node_registered
        rec = before.nodes.get(p.node_id)
        restarted = (
            rec is not None
            and rec.state == ev.NODE_STATE_ACTIVE
            and p.node_id in before.world.node_ids
            and p.epoch != rec.epoch
        )
        if restarted:  # its workers and its flash memory went with the old agent
            return _on_fault(
                before, d, CLEAR, [p.node_id], f"agent on {p.node_id} restarted", policy=policy
            )
        return "" if phase == ev.PHASE_RUNNING else "recorded: the reshape will consider it"
    fault = classify(obs, policy, before)
    if fault is None:
        return "recorded only"
    suspect, ranks = fault_ranks(obs, before)
    return _on_fault(
        before,
        d,
        *fault,
        idle_evicts=kind not in STALE_KINDS,
        by_operator=kind == "operator_action",
        policy=policy,
        suspect=suspect,
        ranks=ranks,
    )


def resumable(phase: Phase) -> str:
    """Why a job in `phase` cannot be resumed ('' when it can)."""
    if phase in (ev.PHASE_RUNNING, ev.PHASE_STARTING, ev.PHASE_UNSPECIFIED):
        return f"the job is {ev.Phase.Name(phase)}: there is nothing to resume"
    if phase == ev.PHASE_FINISHED:
        return "the job finished: start a new job (a new --job-id) to train again"
    return ""


def _on_resume(before: ev.JobState, d: _Draft, op: ev.OperatorAction) -> str:
    """An operator's resume: close the incident, open a new one with a fresh budget."""
    why = resumable(before.phase)
    if why:
        return f"ignored: resume ({why})"
    d.transition(
        ev.PHASE_SUSPECTED,
        f"resumed by {op.who or 'operator'} from {ev.Phase.Name(before.phase)}",
        incident_id=_new_incident(d),
        suspects=[],
        bad=[],
        diagnose=False,
        by_operator=True,
        rearm=True,
        mode=RESTART,  # the workers of a failed job are stopped: start every one
        replace=[],
    )
    return ""


def _on_wait_expired(before: ev.JobState, d: _Draft, p: ev.NodeWaitExpired) -> str:
    """The wait for nodes below min_nodes ran out (driver/nodewait.py): the job fails."""
    if not before.awaiting_nodes or p.incident_id != before.incident_id:
        return "ignored: the incident it was for no longer waits for nodes"
    reason = (
        f"incident {before.incident_id}: {before.awaiting_nodes}; no node came back or "
        f"joined in {p.waited_s:.0f} s (--await-nodes-s): add nodes or spares, then "
        "`unbroken resume`"
    )
    d.add(ev.Event(job_finished=ev.JobFinished(step=before.step, ok=False, reason=reason)))
    return ""


def _on_fault(
    before: ev.JobState,
    d: _Draft,
    kind: str,
    nodes: list[str],
    reason: str,
    *,
    idle_evicts: bool = True,
    by_operator: bool = False,
    policy: Policy | None = None,
    suspect: bool = False,
    ranks: Sequence[int] = (),
) -> str:
    phase = before.phase
    world = set(before.world.node_ids)
    accepted: list[str] = []
    for n in nodes:
        st = _state_of(before, n)
        if n not in world:
            healthy = st in (ev.NODE_STATE_SPARE, ev.NODE_STATE_ACTIVE)
            if healthy and kind != LOST and idle_evicts:
                d.add(ev.Event(node_evicted=ev.NodeEvicted(node_id=n, reason=f"idle: {reason}")))
            continue
        if st == ev.NODE_STATE_EVICTED:
            continue
        if st == ev.NODE_STATE_LOST and phase != ev.PHASE_RUNNING:
            continue  # already lost and handled by the open incident
        if kind == UNCLEAR and n in before.suspects and before.needs_diagnosis:
            continue
        if kind in (EVICT, UNCLEAR) and n in before.bad_nodes:
            continue  # already to be evicted: a diagnosis of it would only delay that
        accepted.append(n)
    if not accepted:
        return f"ignored: {reason} (gone, duplicate, or not in the world)"
    turns_suspect = suspect and before.recovery_mode == IN_JOB  # now every process restarts
    if kind == CLEAR and phase in (ev.PHASE_SUSPECTED, ev.PHASE_PAUSED) and not turns_suspect:
        return f"ignored: {reason} (the job is being paused; workers restart anyway)"
    suspects = set(before.suspects) | (set(accepted) if kind == UNCLEAR else set())
    bad = set(before.bad_nodes) | (set(accepted) if kind == EVICT else set())
    diagnose = before.needs_diagnosis or kind == UNCLEAR
    in_job = policy is not None and policy.in_job and not suspect and not diagnose
    if phase != ev.PHASE_RUNNING and before.recovery_mode != IN_JOB:
        in_job = False  # a restart already under way (or a replayed older log) stays one
    mode = IN_JOB if in_job else RESTART
    replace = set(before.replace_ranks) | set(ranks) if phase != ev.PHASE_RUNNING else set(ranks)
    if suspect:
        reason = f"{reason} (suspect: every process restarts)"
    if phase == ev.PHASE_RUNNING:
        sit: tuple[str, ...] = ()
        if policy is not None and policy.keep_training and in_job and kind in (CLEAR, LOST):
            sit = replicapolicy.sits_out(before.world, accepted, ranks, policy.min_nodes)
        if sit:
            reason = f"{reason} (replica policy: {sit} sit out, the other replicas train on)"
        d.transition(
            ev.PHASE_SUSPECTED,
            reason,
            incident_id=_new_incident(d),
            suspects=suspects,
            bad=bad,
            diagnose=diagnose,
            by_operator=by_operator,
            mode=mode,
            replace=replace,
            sit_out=sit,
        )
        return ""
    to = ev.PHASE_SUSPECTED
    if phase == ev.PHASE_PAUSED and kind != LOST:
        to = ev.PHASE_PAUSED  # workers are paused and their saved state is intact
    d.transition(
        to,
        reason,
        suspects=suspects,
        bad=bad,
        diagnose=diagnose,
        by_operator=by_operator,
        mode=mode,
        replace=replace,
    )
    return ""


def _on_paused(before: ev.JobState, d: _Draft, obs: Paused) -> str:
    if before.phase != ev.PHASE_SUSPECTED:
        return f"ignored: paused report in {ev.Phase.Name(before.phase)}"
    if obs.restorable_step is not None:
        restore = min(obs.restorable_step, obs.step)
    else:
        committed = [c.step for c in before.checkpoints if c.step <= obs.step]
        restore = max(committed, default=0)
    if before.HasField("rollback_to"):
        # the target itself when some copy of it is left (a memory target may have been
        # overwritten by the steps trained before the stop), else the newest one before it
        target = before.rollback_to
        have = {c.step for c in before.checkpoints} | set(obs.memory_steps)
        restore = max((x for x in have if x <= target), default=min(restore, target))
    d.add(
        ev.Event(
            training_paused=ev.TrainingPaused(
                reason=before.incident_cause, at_step=obs.step, restore_step=restore
            )
        )
    )
    return ""


def _on_verdict(before: ev.JobState, d: _Draft, v: ev.DiagnosisVerdict, policy: Policy) -> str:
    if before.phase != ev.PHASE_PAUSED or not before.needs_diagnosis:
        return f"ignored: verdict {v.diagnosis_id} arrived in {ev.Phase.Name(before.phase)}"
    if v.diagnosis_id != diagnosis_id(before):
        return f"ignored: stale verdict {v.diagnosis_id} (waiting for {diagnosis_id(before)})"
    bad = set(before.bad_nodes) | {n for n in v.bad_nodes if n in before.nodes}
    slow, kept = _slow_evicted(before, v, bad) if policy.evict_slow else ([], [])
    d.transition(
        ev.PHASE_DIAGNOSED,
        f"diagnosis {v.diagnosis_id}: bad {few(sorted(v.bad_nodes))}, "
        f"slow {few(sorted(v.slow_nodes))}"
        + (f" (kept {few(kept)}: no spare to take their ranks)" if kept else ""),
        bad=bad | set(slow),
        diagnose=False,
    )
    return ""


def _slow_evicted(
    before: ev.JobState, v: ev.DiagnosisVerdict, bad: set[str]
) -> tuple[list[str], list[str]]:
    """(evicted, kept): the slow nodes of a verdict (its suspects first) that a healthy spare
    or returned node can replace, once the bad nodes have taken theirs; the rest stay, as
    with a straggler: a slow node beats a smaller world (and one diagnosis's timings on a
    busy host are noisy)."""
    world = set(before.world.node_ids)
    named = [n for n in v.slow_nodes if n in before.nodes and n not in bad]
    slow = sorted(named, key=lambda n: (n not in before.suspects, n))  # the suspects first
    free = len(_pool(before, sorted(world | set(slow) | bad), with_spares=True))
    room = max(0, free - len(bad & world))  # the bad ones take their places first
    outside = [n for n in slow if n not in world]  # idle: nothing to replace
    inside = [n for n in slow if n in world]
    return outside + inside[:room], inside[room:]


def _on_restored(before: ev.JobState, d: _Draft, r: ev.RestoreFinished) -> str:
    if before.phase != ev.PHASE_RESTORING:
        return f"ignored: restore report in {ev.Phase.Name(before.phase)}"
    if not r.ok:
        # the fallback: whatever mode failed, the next attempt replaces every process
        was = " in-job" if before.recovery_mode == IN_JOB else ""
        d.transition(
            ev.PHASE_SUSPECTED,
            f"{was.strip() + ' ' if was else ''}restore at step {r.step} failed: {r.error}"
            + ("; falling back to a restart of every process" if was else ""),
            mode=RESTART,
        )
        return ""
    if r.step != before.restore_step:
        return f"ignored: restored step {r.step}, expected {before.restore_step}"
    # the step the ranks said they restored (a replica newer than the plan's), else the plan's
    at = r.restored_step or r.step
    d.add(
        ev.Event(
            training_resumed=ev.TrainingResumed(
                at_step=at,
                world=before.world,
                planned_step=r.step,
                mode=before.recovery_mode or RESTART,
            )
        )
    )
    return ""


def _on_spike(before: ev.JobState, d: _Draft, p: ev.LossSpike, policy: Policy) -> str:
    if before.phase != ev.PHASE_RUNNING:
        return "ignored: loss spike during recovery (the restore goes back anyway)"
    spike = spikelib.Spike(p.step, p.loss, p.baseline, p.baseline, p.factor, p.non_finite)
    # Targets: the committed steps and the steps every rank still holds in memory.
    targets = sorted({c.step for c in before.checkpoints} | set(p.memory_steps))
    roll = spikelib.RollbackPolicy(policy.spike, list(before.rollback_steps)).decide(spike, targets)
    what = "non-finite loss" if p.non_finite else f"loss {p.loss:.6g} (baseline {p.baseline:.6g})"
    if roll.halt:  # the policy's own reason ends with why it will not roll back again
        why = roll.reason.rsplit("; ", 1)[-1]
        reason = f"{what} at step {p.step}, and no rollback: {why}; restart from a checkpoint"
        d.add(ev.Event(job_finished=ev.JobFinished(step=p.step, ok=False, reason=reason)))
        return ""
    d.add(
        ev.Event(
            rollback=ev.Rollback(
                from_step=p.step,
                to_step=roll.to_step,
                skip_batches=roll.skip_batches,
                skip_from_step=roll.skip_first if roll.skip_batches else 0,
                reason=f"{what} at step {p.step}",
            )
        )
    )
    _open_rollback(d, policy)
    return ""


def _on_sdc(before: ev.JobState, d: _Draft, p: ev.SdcSuspected, policy: Policy) -> str:
    """Silent data corruption (docs/sdc.md): roll back to the newest verified step before it
    that can be restored. A node named (resolved) a second time is also diagnosed: the
    bisection confirms it before it is evicted; named a third time it is evicted (a lasting
    fault the checks do not see)."""
    if before.phase != ev.PHASE_RUNNING:
        return "recorded only: SDC suspected during recovery (the restore goes back anyway)"
    where = f"ranks {few(p.suspect_ranks)} on {few(sorted(set(p.suspect_nodes)))}"
    what = f"silent data corruption at step {p.step} ({where}"
    what += ")" if p.resolved else ", no majority)"
    named = sorted(set(p.suspect_nodes))
    known = p.resolved and all(n in before.nodes for n in named)
    thrice = [n for n in named if before.sdc_by_node.get(n, 0) >= 2]
    if known and thrice:
        return _on_fault(
            before, d, EVICT, thrice, f"{what}: named a third time, evicted", policy=policy
        )
    again = [n for n in named if before.sdc_by_node.get(n, 0) >= 1] if known else []
    held = {c.step for c in before.checkpoints} | set(p.memory_steps)
    verified = set(before.verified_steps) | {c.step for c in before.checkpoints if c.verified}
    target = sdclib.rollback_target(p.step, verified, held)
    if target is None and again:
        return _on_fault(before, d, EVICT, again, f"{what}: named again, evicted", policy=policy)
    if target is None:
        reason = (
            f"{what}, and no verified step before it is held to roll back to; restart "
            "from a checkpoint written before the corruption (`unbroken checkpoints`)"
        )
        d.add(ev.Event(job_finished=ev.JobFinished(step=p.step, ok=False, reason=reason)))
        return ""
    d.add(
        ev.Event(
            rollback=ev.Rollback(
                from_step=p.step,
                to_step=target,
                reason=f"{what}: to verified step {target}"
                + (f"; {again} named again: diagnosed before an eviction" if again else ""),
                diagnose_nodes=again,
            )
        )
    )
    _open_rollback(d, policy, diagnose=again)
    return ""


def _mode(policy: Policy) -> str:
    """The mode of an incident that no process caused (a rollback, a lost node, a grow)."""
    return IN_JOB if policy.in_job else RESTART


def _open_rollback(d: _Draft, policy: Policy, diagnose: Sequence[str] = ()) -> None:
    """Open the incident of a rollback (no eviction; `diagnose`: nodes the diagnosis's
    bisection checks before the restore, evicted when it finds them bad)."""
    s = d.state
    sdc = bool(s.rollback_steps and s.sdc_suspected and s.last_sdc_step == s.rollback_steps[-1])
    why = "silent data corruption" if sdc else "loss spike"
    d.transition(
        ev.PHASE_SUSPECTED,
        f"{why}: roll back to step {d.state.rollback_to}",
        incident_id=_new_incident(d),
        suspects=list(diagnose),
        bad=[],
        diagnose=bool(diagnose),
        mode=RESTART if diagnose else _mode(policy),
        replace=[],
    )


# ---------------------------------------------------------------- automatic transitions
def _new_incident(d: _Draft) -> str:
    """A fresh incident id: the sequence number the opening transition will get."""
    return f"i{d.state.last_seq + 1 + len(d.events)}"


def _settle(d: _Draft, policy: Policy) -> None:
    for _ in range(MAX_SETTLE):
        if not _settle_once(d, policy):
            return
    raise AssertionError(f"the machine did not settle in {MAX_SETTLE} steps")


def _settle_once(d: _Draft, policy: Policy) -> bool:
    s = d.state
    phase = s.phase
    if phase == ev.PHASE_RUNNING:
        return _settle_running(d, policy)
    if phase == ev.PHASE_PAUSED and not s.needs_diagnosis:
        d.transition(ev.PHASE_DIAGNOSED, "the cause is known: no diagnosis needed")
        return True
    if phase == ev.PHASE_DIAGNOSED:
        if s.awaiting_nodes and policy.await_nodes_s and isinstance(plan_world(s, policy), str):
            return False  # still too few nodes: the wait goes on (driver/nodewait.py ends it)
        # (a leader started with --await-nodes-s 0 fails a job it finds waiting: no timer)
        _reshape(d, policy)
        return True
    if phase == ev.PHASE_RESHAPED:
        if s.failed_restores >= policy.max_restore_attempts:
            reason = (
                f"incident {s.incident_id}: {s.failed_restores} restores failed to bring the "
                f"job back (Policy.max_restore_attempts); last cause: {s.incident_cause}. "
                "`unbroken resume` tries again with a fresh budget"
            )
            d.add(ev.Event(job_finished=ev.JobFinished(step=s.step, ok=False, reason=reason)))
            return True
        sources, reshard = restore_sources(s)
        d.add(  # RESHAPED -> RESTORING (the fold moves the phase)
            ev.Event(restore_started=restore_started(s.restore_step, dict(sources), reshard))
        )
        return True
    return False


def _settle_running(d: _Draft, policy: Policy) -> bool:
    """A RUNNING state that must not stay so (what a lost reaction left behind)."""
    s = d.state
    gone = _inactive(s, s.world.node_ids)
    if gone:
        d.transition(
            ev.PHASE_SUSPECTED,
            f"nodes {few(gone)} left the world",
            incident_id=_new_incident(d),
            suspects=[],
            bad=[],
            diagnose=False,
            mode=_mode(policy),
            replace=[],
        )
        return True
    if s.HasField("rollback_to"):
        _open_rollback(d, policy, diagnose=list(s.rollback_diagnose))
        return True
    if policy.grow_back and not s.sitting_out:  # a replica sitting out holds the grow
        target = plan_world(s, policy)
        if isinstance(target, Layout) and target.dp > s.world.dp:
            d.transition(
                ev.PHASE_SUSPECTED,
                f"grow: dp {s.world.dp} -> {target.dp} with returned nodes",
                incident_id=_new_incident(d),
                suspects=[],
                bad=[],
                diagnose=False,
                mode=_mode(policy),
                replace=[],
            )
            return True
    return False


def _reshape(d: _Draft, policy: Policy) -> None:
    """DIAGNOSED -> RESHAPED: evict, replace or resize (or fail below min_nodes)."""
    s = d.state
    # the verdict of this incident's diagnosis, if one ran (an eviction on the node's own
    # self-check, an operator's or a straggler's names none, not an older incident's)
    did = s.last_diagnosis_id if s.last_diagnosis_id == diagnosis_id(s) else ""
    for n in sorted(s.bad_nodes):
        if _state_of(s, n) != ev.NODE_STATE_EVICTED:
            d.add(
                ev.Event(
                    node_evicted=ev.NodeEvicted(
                        node_id=n,
                        reason=f"incident {s.incident_id}: {s.incident_cause}",
                        diagnosis_id=did,
                    )
                )
            )
    s = d.state
    target = plan_world(s, policy)
    if isinstance(target, str):
        if policy.await_nodes_s > 0:  # lost nodes may come back, new ones may join
            away = [n for n in _inactive(s, s.world.node_ids) if n not in s.bad_nodes]
            why = f"{target}; away: {few(away)}" if away else target
            d.transition(
                ev.PHASE_DIAGNOSED,
                f"waiting up to {policy.await_nodes_s:g} s (--await-nodes-s) for nodes: {why}",
                awaiting=why,
            )
            return
        why = f"{target}: add nodes or spares, then `unbroken resume`"
        d.add(ev.Event(job_finished=ev.JobFinished(step=s.step, ok=False, reason=why)))
        return
    old = Layout.of(s.world)
    if target != old or _inactive(s, target.node_ids):
        # One event moves the whole world, so a crash never leaves half a reshape whose
        # completion would be planned differently; SpareAssigned records who replaced whom.
        same = target.dp == old.dp and len(target.node_ids) == len(old.node_ids)
        swaps = [
            (was, now) for was, now in zip(old.node_ids, target.node_ids, strict=False) if same
        ]
        why = (
            f"replace {[w for w, n in swaps if w != n]}" if same else f"dp {old.dp} -> {target.dp}"
        )
        d.add(
            ev.Event(
                world_resized=ev.WorldResized(
                    old_world=s.world, new_world=target.to_proto(), reason=why
                )
            )
        )
        for was, now in swaps:
            if was != now:
                d.add(
                    ev.Event(
                        spare_assigned=ev.SpareAssigned(spare_node_id=now, replaces_node_id=was)
                    )
                )
    d.transition(ev.PHASE_RESHAPED, f"world: dp={target.dp} on {few(target.node_ids)}")


def phases(events: Sequence[ev.Event]) -> list[str]:
    """The phase names the transitions in `events` lead to (for logs and tests)."""
    out = []
    for e in events:
        if e.WhichOneof("payload") == "recovery_transition":
            out.append(ev.Phase.Name(e.recovery_transition.to_phase))
    return out
