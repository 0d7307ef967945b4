"""A pure simulation harness for the recovery machine (driver/machine.py); no tests here.

`Sim` plays the driver's shell: it passes observations to `decide`, appends the events to
a log (numbering them as the event log would), and checks after every decision that
(1) every event folds and the folded phase is the one `decide` announced, (2) a replay of
the serialized log gives the same state and the same pending actions, and a driver that
crashed after any prefix of the decision's reaction carries on (`settle`) to the same
phase and actions, (3) the world invariants hold. `drive` answers the pending actions
like agents that always succeed (the liveness oracle).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest

from unbroken.driver import machine as m
from unbroken.driver import state as statelib
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

HEALTHY = (ev.NODE_STATE_ACTIVE, ev.NODE_STATE_SPARE)


def job(
    *, nodes: int, wpn: int = 1, pp: int = 1, tp: int = 1, spares: int = 0, extra: int = 0
) -> list[ev.Event]:
    """The opening events of a job: started, world registered, spares registered, running.

    `extra` nodes are known ids that register later (returning nodes / late spares).
    """
    ids = [f"n{i}" for i in range(nodes)]
    dp = nodes * wpn // (pp * tp)
    assert dp * pp * tp == nodes * wpn, "a test layout must fill whole nodes"
    world = ev.WorldLayout(dp=dp, pp=pp, tp=tp, node_ids=ids, workers_per_node=wpn)
    out = [ev.Event(job_started=ev.JobStarted(trainer="gpt3d", world=world, min_nodes=1))]
    out += [register(n, 1, wpn) for n in ids]
    out += [register(f"s{i}", 1, wpn, spare=True) for i in range(spares)]
    out.append(ev.Event(training_resumed=ev.TrainingResumed(at_step=0, world=world)))
    return out


def register(node: str, epoch: int, wpn: int = 1, *, spare: bool = False) -> ev.Event:
    """A NodeRegistered event."""
    return ev.Event(
        node_registered=ev.NodeRegistered(node_id=node, epoch=epoch, num_workers=wpn, spare=spare)
    )


def lost(node: str, epoch: int = 0) -> ev.Event:
    """A NodeLost event."""
    return ev.Event(node_lost=ev.NodeLost(node_id=node, epoch=epoch, reason="heartbeat timeout"))


def crash(node: str, code: int = 1) -> ev.Event:
    """A WorkerFailed event."""
    return ev.Event(worker_failed=ev.WorkerFailed(node_id=node, exit_code=code))


def hang(node: str, phase: str = "collective") -> ev.Event:
    """A HangSuspected event (by default a rank stuck waiting in a collective: unclear)."""
    return ev.Event(hang_suspected=ev.HangSuspected(node_id=node, stuck_at_step=3, phase=phase))


def alert(node: str) -> ev.Event:
    """A LogAlert event."""
    return ev.Event(log_alert=ev.LogAlert(node_id=node, keyword="Xid", line="Xid 79"))


def selfcheck(node: str, *failures: str) -> ev.Event:
    """A failed SelfCheckReported event (by default a failure no policy evicts on: unclear)."""
    return ev.Event(
        self_check_reported=ev.SelfCheckReported(
            node_id=node, ok=False, failures=list(failures or ["gpu0"])
        )
    )


def wrong_matmul(node: str) -> ev.Event:
    """A failed SelfCheckReported: the node's device computed a wrong matmul (definitive)."""
    return selfcheck(node, "matmul: wrong matmul result on ['cpu']")


def operator(action: str, target: str = "") -> ev.Event:
    """An OperatorAction event."""
    return ev.Event(operator_action=ev.OperatorAction(action=action, target=target, who="ops"))


def spike(step: int, non_finite: bool = False) -> ev.Event:
    """A LossSpike event."""
    return ev.Event(
        loss_spike=ev.LossSpike(step=step, loss=9.0, baseline=2.0, factor=6, non_finite=non_finite)
    )


def checkpoint(step: int) -> ev.Event:
    """A CheckpointCommitted event."""
    return ev.Event(
        checkpoint_committed=ev.CheckpointCommitted(step=step, uri=f"file:///ckpt/{step}")
    )


def verdict(diagnosis_id: str, bad: list[str], slow: tuple[str, ...] = ()) -> ev.Event:
    """A DiagnosisVerdict event."""
    return ev.Event(
        diagnosis_verdict=ev.DiagnosisVerdict(
            diagnosis_id=diagnosis_id, bad_nodes=bad, slow_nodes=list(slow)
        )
    )


def restored(step: int, ok: bool = True, restored_step: int = 0) -> ev.Event:
    """A RestoreFinished event (`restored_step`: what the ranks said they restored)."""
    return ev.Event(
        restore_finished=ev.RestoreFinished(
            step=step, ok=ok, error="" if ok else "x", restored_step=restored_step
        )
    )


@dataclass
class Sim:
    """The shell around the pure machine, with every check after every decision."""

    policy: m.Policy
    crash_checks: bool = True  # also replay the log and try every crash point (slower)
    log: list[ev.Event] = field(default_factory=list)
    state: ev.JobState = field(default_factory=lambda: statelib.initial("job"))
    decisions: list[m.Decision] = field(default_factory=list)
    failed_state: ev.JobState | None = None  # the state at the first JobFinished(ok=false)
    training_step: int = 0

    def append(self, events: list[ev.Event] | tuple[ev.Event, ...]) -> None:
        """Append events as the log would (dense seq, unique id) and fold them."""
        for e in events:
            e = ev.Event.FromString(e.SerializeToString())
            e.seq = len(self.log) + 1
            e.event_id = e.event_id or uuid.uuid4().hex
            self.log.append(e)
            self.state = statelib.apply(self.state, e)

    def feed(self, obs: m.Observation) -> m.Decision:
        """Decide `obs`, check the decision, append it."""
        before = self.state
        d = m.decide(before, obs, self.policy)
        self.check(before, obs, d)
        self.append(d.events)
        self.decisions.append(d)
        if self.state.phase == ev.PHASE_FAILED and self.failed_state is None:
            self.failed_state = self.state
        check_world(self.state, self.policy)
        if not self.crash_checks:
            return d
        replay = statelib.fold(
            [ev.Event.FromString(e.SerializeToString()) for e in self.log],
            statelib.initial("job"),
        )
        assert replay == self.state, "replaying the log must rebuild the live state"
        assert tuple(m.pending_actions(replay, self.policy)) == d.actions
        assert m.settle(replay, self.policy).events == (), "a settled state needs no more"
        return d

    def check(self, before: ev.JobState, obs: m.Observation, d: m.Decision) -> None:
        """(1) each event folds and transitions start where the state is; (2) crash points."""
        s = before
        for e in d.events:
            e2 = ev.Event.FromString(e.SerializeToString())
            assert e2.WhichOneof("payload") is not None
            if e2.WhichOneof("payload") == "recovery_transition":
                assert e2.recovery_transition.from_phase == s.phase
            s = statelib.apply(s, e2)
        assert s.phase == d.phase, "the folded phase must be the one decide() intended"
        assert tuple(m.pending_actions(s, self.policy)) == d.actions
        if not self.crash_checks:
            return
        # A crash after the first reaction event: a new leader replays and settles.
        first = 2 if isinstance(obs, ev.Event) else 1
        for k in range(first, len(d.events)):
            mid = statelib.fold(d.events[:k], before)
            rest = m.settle(mid, self.policy)
            end = statelib.fold(rest.events, mid)
            assert end.phase == d.phase, f"crash after event {k}: {end.phase} != {d.phase}"
            assert rest.actions == d.actions, f"crash after event {k}: other actions"
            assert end.world == s.world

    def drive(self, bad: set[str], max_steps: int = 60) -> None:
        """Answer pending actions like agents that succeed, until RUNNING or the end."""
        for _ in range(max_steps):
            if self.state.phase in (ev.PHASE_RUNNING, ev.PHASE_FAILED, ev.PHASE_FINISHED):
                return
            self.progress(bad)
        raise AssertionError(f"no progress: stuck in {ev.Phase.Name(self.state.phase)}")

    def progress(self, bad: set[str], restorable: int | None = None) -> None:
        """Answer the current phase's actions once (as healthy agents would)."""
        s = self.state
        acts = m.pending_actions(s, self.policy)
        if s.phase == ev.PHASE_SUSPECTED:
            self.feed(m.Paused(step=self.training_step, restorable_step=restorable))
        elif s.phase == ev.PHASE_PAUSED:
            run = [a for a in acts if isinstance(a, m.RunDiagnosis)]
            assert len(run) == 1, acts
            found = sorted(set(run[0].suspects) & bad)
            self.feed(verdict(run[0].diagnosis_id, found, ()))
        elif s.phase == ev.PHASE_RESTORING:
            rest = [a for a in acts if isinstance(a, m.Restore)]
            assert len(rest) == 1, acts
            self.training_step = rest[0].step
            self.feed(restored(rest[0].step))
        elif s.phase == ev.PHASE_RUNNING:
            self.training_step += 7
        elif s.phase == ev.PHASE_DIAGNOSED and s.awaiting_nodes:  # too few nodes: nobody comes
            assert not acts and not feasible(s, self.policy), acts
            wait = ev.NodeWaitExpired(incident_id=s.incident_id, waited_s=300.0)
            self.feed(ev.Event(node_wait_expired=wait))


def check_world(s: ev.JobState, policy: m.Policy) -> None:
    """(3) The world is a valid layout; once reshaped it holds healthy nodes only."""
    w = s.world
    assert len(set(w.node_ids)) == len(w.node_ids), f"a node twice in {list(w.node_ids)}"
    assert w.dp * w.pp * w.tp == len(w.node_ids) * w.workers_per_node, w
    if s.phase in (ev.PHASE_RUNNING, ev.PHASE_RESTORING):
        for n in w.node_ids:
            assert s.nodes[n].state == ev.NODE_STATE_ACTIVE, (n, s.nodes[n])
        assert policy.min_nodes <= len(w.node_ids) <= (policy.max_nodes or len(w.node_ids))
        assert w.dp <= s.configured_world.dp


def feasible(s: ev.JobState, policy: m.Policy) -> bool:
    """Brute force: could any layout be built from the healthy nodes of `s`?"""
    w = s.world
    healthy = sum(
        1 for r in s.nodes.values() if r.state in HEALTHY and r.node_id not in s.bad_nodes
    )
    for dp in range(1, s.configured_world.dp + 1):
        ranks = dp * w.pp * w.tp
        if ranks % w.workers_per_node == 0:
            need = ranks // w.workers_per_node
            if policy.min_nodes <= need <= min(healthy, policy.max_nodes or healthy):
                return True
    return False
