"""The recovery state machine on named scenarios, and exhaustively over small clusters.

Every scenario runs through `Sim` (tests/unit/machine_harness.py), which checks after
each decision that the events fold to the intended phase, that a replay (and a crash after
any prefix of a decision) gives the same pending actions, and the world invariants.
"""

from __future__ import annotations

import argparse
import itertools

import pytest

from tests.unit.machine_harness import (
    Sim,
    alert,
    checkpoint,
    crash,
    feasible,
    hang,
    job,
    lost,
    operator,
    register,
    restored,
    selfcheck,
    spike,
    verdict,
    wrong_matmul,
)
from unbroken.common.config import add_config_flags, config_from_args
from unbroken.driver import machine as m
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def start(policy: m.Policy | None = None, **layout: int) -> Sim:
    sim = Sim(policy or m.Policy())
    sim.append(job(**layout))
    assert sim.state.phase == ev.PHASE_RUNNING
    return sim


def kinds(d: m.Decision) -> list[str]:
    return [str(e.WhichOneof("payload")) for e in d.events]


def only(acts: tuple[m.Action, ...] | list[m.Action], cls: type) -> list:  # type: ignore[type-arg]
    return [a for a in acts if isinstance(a, cls)]


def test_worker_crash_on_healthy_node_restarts_without_diagnosis() -> None:
    sim = start(nodes=4, wpn=2, pp=2)
    sim.training_step = 40
    d = sim.feed(crash("n2"))
    assert d.phase == ev.PHASE_SUSPECTED
    assert [type(a) for a in d.actions] == [m.StopWorkers]  # workers flash-save every step
    d = sim.feed(m.Paused(step=40, restorable_step=40))
    assert m.phases(d.events) == ["PHASE_DIAGNOSED", "PHASE_RESHAPED"]
    assert d.phase == ev.PHASE_RESTORING
    (rs,) = only(d.actions, m.Restore)
    assert rs.step == 40 and not rs.reshard
    assert {src for _, src in rs.sources} == {"memory"}
    assert len(rs.sources) == 8
    (sw,) = only(d.actions, m.StartWorkers)
    assert sw.world.node_ids == ("n0", "n1", "n2", "n3")
    assert sw.rank_base == (("n0", 0), ("n1", 2), ("n2", 4), ("n3", 6))
    d = sim.feed(restored(40))
    assert d.phase == ev.PHASE_RUNNING and d.actions == (m.ResumeAll(40, sw.world.node_ids),)
    assert sim.state.incident_id == "" and not sim.state.suspects


def test_ranks_that_restored_newer_than_planned_resume_the_planned_restore() -> None:
    """The plan counted the copies the heartbeats listed; a replica that reached the buddy
    later is newer, and the ranks restore it. The report still names the planned restore
    (a CI chaos run stalled in RESTORING when the driver put the ranks' step there)."""
    sim = start(nodes=4, wpn=2, pp=2)
    sim.training_step = 40
    sim.feed(crash("n2"))
    sim.feed(m.Paused(step=40, restorable_step=1))
    assert sim.state.restore_step == 1
    assert sim.feed(restored(2)).phase == ev.PHASE_RESTORING  # a report of another restore
    d = sim.feed(restored(1, restored_step=37))
    assert d.phase == ev.PHASE_RUNNING
    # ...and training resumed from what the ranks restored (the goodput ledger charges the
    # steps redone from it, not from the plan's step: tests/unit/test_goodput.py)
    (resumed,) = [e.training_resumed for e in d.events if e.HasField("training_resumed")]
    assert (resumed.at_step, resumed.planned_step) == (37, 1)
    assert sim.state.step == 37


def test_node_lost_is_replaced_by_a_spare_in_its_rank_position() -> None:
    sim = start(nodes=4, spares=1)
    sim.feed(lost("n1"))
    d = sim.feed(m.Paused(step=10, restorable_step=9))
    assert kinds(d).count("spare_assigned") == 1 and sim.state.world.dp == 4
    assert list(sim.state.world.node_ids) == ["n0", "s0", "n2", "n3"]
    assert sim.state.nodes["s0"].state == ev.NODE_STATE_ACTIVE
    (rs,) = only(d.actions, m.Restore)
    assert rs.step == 9 and dict(rs.sources) == {0: "memory", 1: "buddy", 2: "memory", 3: "memory"}
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING


def test_without_spares_dp_shrinks_and_grows_back_when_the_node_returns() -> None:
    sim = start(nodes=4, wpn=1, tp=1, pp=1, extra=0)
    sim.feed(lost("n3"))
    d = sim.feed(m.Paused(step=12))
    assert "world_resized" in kinds(d)
    assert sim.state.world.dp == 3 and list(sim.state.world.node_ids) == ["n0", "n1", "n2"]
    (rs,) = only(d.actions, m.Restore)
    assert rs.reshard and rs.step == 0  # nothing committed and no survey: from the start
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING
    # n3 comes back (a new agent epoch): the job grows back to dp 4
    d = sim.feed(register("n3", 2))
    assert d.phase == ev.PHASE_SUSPECTED and "grow" in sim.state.incident_cause
    sim.drive(set())
    assert sim.state.world.dp == 4 and sorted(sim.state.world.node_ids) == ["n0", "n1", "n2", "n3"]


def test_shrink_keeps_whole_pipeline_replicas() -> None:
    # 4 nodes x 1 worker, pp=2: dp=2. Losing one node leaves 3, dp=1 uses 2 nodes.
    sim = start(nodes=4, pp=2)
    sim.feed(lost("n0"))
    sim.feed(m.Paused(step=5, restorable_step=5))
    w = sim.state.world
    assert (w.dp, w.pp, list(w.node_ids)) == (1, 2, ["n1", "n2"])


def test_below_min_nodes_with_no_wait_the_job_fails_with_a_reason() -> None:
    sim = start(m.Policy(min_nodes=3, await_nodes_s=0), nodes=3)
    sim.feed(lost("n0"))
    d = sim.feed(m.Paused(step=5))
    assert d.phase == ev.PHASE_FAILED
    (fin,) = [e.job_finished for e in d.events if e.WhichOneof("payload") == "job_finished"]
    assert not fin.ok and "min_nodes is 3" in fin.reason and "unbroken resume" in fin.reason
    assert d.actions == (m.StopAll(("n1", "n2")),)
    assert sim.feed(crash("n1")).note.startswith("recorded only")


def _waiting(sim: Sim) -> m.Decision:
    """n0 of a 3-node job with min_nodes 3 is lost: the reshape waits for nodes."""
    sim.feed(lost("n0"))
    d = sim.feed(m.Paused(step=5, restorable_step=5))
    assert d.phase == ev.PHASE_DIAGNOSED and d.actions == ()
    assert "min_nodes is 3" in sim.state.awaiting_nodes
    assert sim.state.awaiting_nodes.endswith("away: ['n0']"), sim.state.awaiting_nodes
    (t,) = [e.recovery_transition for e in d.events if e.HasField("recovery_transition")][-1:]
    assert t.awaiting_nodes == sim.state.awaiting_nodes and "--await-nodes-s" in t.reason
    assert not [e for e in d.events if e.HasField("job_finished")]
    return d


def test_below_min_nodes_the_reshape_waits_and_a_returning_node_ends_the_wait() -> None:
    """A CI host once stalled all three nodes of a job 3-4 s: each was declared lost and the
    job FAILED on the spot, though all three came back a moment later."""
    sim = start(m.Policy(min_nodes=3), nodes=3)
    _waiting(sim)
    # a worker's crash while it waits: stop the workers, then wait again
    assert sim.feed(crash("n1")).phase == ev.PHASE_SUSPECTED
    assert sim.feed(m.Paused(step=5, restorable_step=5)).phase == ev.PHASE_DIAGNOSED
    assert sim.state.awaiting_nodes
    d = sim.feed(register("n0", 2))  # n0's agent is back (a new epoch)
    assert d.phase == ev.PHASE_RESTORING, m.phases(d.events)
    assert not sim.state.awaiting_nodes
    assert [r.step for r in only(d.actions, m.Restore)] == [5]
    assert list(sim.state.world.node_ids) == ["n0", "n1", "n2"]
    sim.feed(restored(5))
    assert sim.state.phase == ev.PHASE_RUNNING and not sim.state.awaiting_nodes


def test_a_new_node_that_joins_ends_the_wait_in_the_lost_nodes_place() -> None:
    sim = start(m.Policy(min_nodes=3), nodes=3)
    _waiting(sim)
    d = sim.feed(register("n9", 1))
    assert d.phase == ev.PHASE_RESTORING, m.phases(d.events)
    assert list(sim.state.world.node_ids) == ["n9", "n1", "n2"]


def test_a_wait_for_nodes_that_runs_out_fails_the_job_and_resume_waits_again() -> None:
    sim = start(m.Policy(min_nodes=3), nodes=3)
    _waiting(sim)
    incident = sim.state.incident_id
    stale = ev.Event(node_wait_expired=ev.NodeWaitExpired(incident_id="i1", waited_s=300))
    assert sim.feed(stale).note.startswith("ignored"), incident
    expired = ev.Event(node_wait_expired=ev.NodeWaitExpired(incident_id=incident, waited_s=300.2))
    d = sim.feed(expired)
    assert d.phase == ev.PHASE_FAILED and not sim.state.awaiting_nodes
    reason = d.events[-1].job_finished.reason
    assert "300 s (--await-nodes-s)" in reason and "min_nodes is 3" in reason, reason
    assert sim.feed(expired).note.startswith("recorded only")  # a second one: nothing
    # `unbroken resume` opens a new incident, which waits again while n0 is away
    sim.feed(operator(m.RESUME))
    assert sim.state.phase in (ev.PHASE_SUSPECTED, ev.PHASE_PAUSED), sim.state.phase
    sim.feed(m.Paused(step=5, restorable_step=5))
    assert sim.state.phase == ev.PHASE_DIAGNOSED and sim.state.awaiting_nodes
    assert sim.state.incident_id != incident


def test_a_leader_without_a_wait_fails_a_job_it_finds_waiting() -> None:
    """A driver restarted with --await-nodes-s 0 runs no timer: the settle after its
    replay fails the job at once instead of leaving it waiting for ever."""
    sim = start(m.Policy(min_nodes=3), nodes=3)
    _waiting(sim)
    d = m.settle(sim.state, m.Policy(min_nodes=3, await_nodes_s=0))
    assert d.phase == ev.PHASE_FAILED, m.phases(d.events)
    assert "min_nodes is 3" in d.events[-1].job_finished.reason


def test_a_fault_while_waiting_for_nodes_reopens_the_incident_and_waits_again() -> None:
    sim = start(m.Policy(min_nodes=3), nodes=3)
    _waiting(sim)
    sim.feed(lost("n1"))
    assert sim.state.phase in (ev.PHASE_SUSPECTED, ev.PHASE_PAUSED, ev.PHASE_DIAGNOSED)
    sim.feed(m.Paused(step=5, restorable_step=5))
    assert sim.state.phase == ev.PHASE_DIAGNOSED and sim.state.awaiting_nodes
    sim.feed(register("n0", 2))
    assert sim.state.phase == ev.PHASE_DIAGNOSED  # two of three: still too few
    d = sim.feed(register("n1", 2))
    assert d.phase == ev.PHASE_RESTORING, m.phases(d.events)


def test_hang_is_diagnosed_then_the_bad_node_is_evicted_and_replaced() -> None:
    sim = start(nodes=4, spares=1)
    sim.feed(hang("n2"))
    d = sim.feed(m.Paused(step=30, restorable_step=30))
    assert d.phase == ev.PHASE_PAUSED
    (run,) = only(d.actions, m.RunDiagnosis)
    assert run.suspects == ("n2",) and set(run.nodes) == {"n0", "n1", "n2", "n3"}
    # the verdict of an older diagnosis is ignored; a replay asks for the same id again
    assert sim.feed(verdict("i1-dffffffff", ["n0"])).note.startswith("ignored: stale")
    assert only(m.pending_actions(sim.state, sim.policy), m.RunDiagnosis) == [run]
    d = sim.feed(verdict(run.diagnosis_id, ["n2"], ("n3",)))
    assert sim.state.nodes["n2"].state == ev.NODE_STATE_EVICTED
    assert sim.state.nodes["n3"].state == ev.NODE_STATE_ACTIVE  # slow, but no spare left
    assert list(sim.state.world.node_ids) == ["n0", "n1", "s0", "n3"]
    assert {a.node_id for a in only(d.actions, m.EvictNode)} == {"n2"}
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING


def test_a_slow_node_of_a_verdict_is_evicted_only_when_a_spare_takes_its_ranks() -> None:
    for spares, evicted in ((2, {"n2", "n3"}), (1, {"n2"}), (0, set())):  # n2: the suspect
        sim = start(nodes=4, spares=spares)
        sim.feed(hang("n2"))
        (run,) = only(sim.feed(m.Paused(step=30, restorable_step=30)).actions, m.RunDiagnosis)
        d = sim.feed(verdict(run.diagnosis_id, [], ("n3", "n2")))
        assert {a.node_id for a in only(d.actions, m.EvictNode)} == evicted, spares
        assert sim.state.world.dp == 4 and len(sim.state.world.node_ids) == 4
        why = [e.recovery_transition.reason for e in d.events if e.HasField("recovery_transition")]
        assert ("no spare to take their ranks" in why[0]) == (len(evicted) < 2), why
        sim.drive(set())
        assert sim.state.phase == ev.PHASE_RUNNING


def test_a_stopped_hang_counts_the_faults_of_the_window_only() -> None:
    def stopped_at(sim: Sim, step: int) -> m.Decision:
        sim.training_step = step
        h = ev.HangSuspected(node_id="n2", stuck_at_step=step, phase="stopped")
        sim.feed(ev.Event(hang_suspected=h))
        return sim.feed(m.Paused(step=step, restorable_step=step))

    sim = start(m.Policy(fault_window_steps=100), nodes=4, spares=1)
    for step in (10, 150, 300, 320):  # at most one earlier fault within 100 steps
        assert not only(stopped_at(sim, step).actions, m.RunDiagnosis), step
        sim.drive(set())
    assert list(sim.state.nodes["n2"].fault_steps) == [10, 150, 300, 320]
    assert only(stopped_at(sim, 340).actions, m.RunDiagnosis)  # 300 and 320: two recent

    sim = start(m.Policy(fault_window_steps=0), nodes=4, spares=1)  # no window: a lifetime
    for step in (10, 150):
        assert not only(stopped_at(sim, step).actions, m.RunDiagnosis)
        sim.drive(set())
    assert only(stopped_at(sim, 3000).actions, m.RunDiagnosis)


def test_a_hang_whose_process_is_stopped_restarts_without_a_diagnosis() -> None:
    sim = start(nodes=4, spares=1)
    sim.feed(hang("n2", phase="train"))  # silent in its step: a waiting peer looks the same
    d = sim.feed(m.Paused(step=30, restorable_step=30))
    assert only(d.actions, m.RunDiagnosis)
    sim = start(nodes=4, spares=1)
    for _ in range(2):  # its process is stopped: the culprit is known, restart, no checks
        sim.feed(hang("n2", phase="stopped"))
        d = sim.feed(m.Paused(step=30, restorable_step=30))
        assert not only(d.actions, m.RunDiagnosis), d.actions
        assert "n2" in sim.state.world.node_ids
        sim.drive(set())
        assert sim.state.phase == ev.PHASE_RUNNING
    # a node that keeps hanging is diagnosed like any unclear fault
    sim.feed(hang("n2", phase="stopped"))
    d = sim.feed(m.Paused(step=30, restorable_step=30))
    (run,) = only(d.actions, m.RunDiagnosis)
    assert run.suspects == ("n2",)


def test_second_node_lost_while_restoring_goes_back_to_suspected() -> None:
    sim = start(nodes=4, spares=2)
    sim.feed(lost("n0"))
    sim.feed(m.Paused(step=8, restorable_step=8))
    assert sim.state.phase == ev.PHASE_RESTORING
    d = sim.feed(lost("n3"))
    assert d.phase == ev.PHASE_SUSPECTED and sim.state.incident_id
    incident = sim.state.incident_id
    assert sim.feed(lost("n3")).note.startswith("ignored")  # duplicate
    assert sim.feed(lost("n0")).note.startswith("ignored")  # already handled
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING
    assert list(sim.state.world.node_ids) == ["s0", "n1", "n2", "s1"]
    assert sum(1 for e in sim.log if e.recovery_transition.incident_id == incident) >= 4


def test_unclear_fault_while_paused_grows_the_diagnosis() -> None:
    sim = start(nodes=4)
    sim.feed(alert("n1"))
    sim.feed(m.Paused(step=3, restorable_step=3))
    first = only(m.pending_actions(sim.state, sim.policy), m.RunDiagnosis)[0]
    d = sim.feed(selfcheck("n3"))
    assert d.phase == ev.PHASE_PAUSED
    second = only(d.actions, m.RunDiagnosis)[0]
    assert second.suspects == ("n1", "n3") and second.diagnosis_id != first.diagnosis_id
    assert sim.feed(verdict(first.diagnosis_id, ["n1"])).note.startswith("ignored: stale")
    sim.drive({"n3"})
    assert list(sim.state.world.node_ids) == ["n0", "n1", "n2"]


def evictions(sim: Sim) -> dict[str, ev.NodeEvicted]:
    return {e.node_evicted.node_id: e.node_evicted for e in sim.log if e.HasField("node_evicted")}


def test_a_wrong_matmul_self_check_evicts_the_node_without_a_diagnosis() -> None:
    """Its device computed a wrong exact checksum: the check is the proof, a diagnosis
    could only confirm it (Policy.self_check_evicts)."""
    sim = start(nodes=4, spares=2)
    sim.feed(hang("n1"))  # an earlier incident that was diagnosed
    sim.drive({"n1"})
    earlier = sim.state.last_diagnosis_id
    assert earlier and sim.state.phase == ev.PHASE_RUNNING
    before = len(sim.log)
    sim.training_step = 30
    d = sim.feed(wrong_matmul("n2"))
    assert d.phase == ev.PHASE_SUSPECTED
    assert list(sim.state.bad_nodes) == ["n2"] and not sim.state.suspects
    assert not sim.state.needs_diagnosis
    # in-job: the healthy nodes' workers are held, the bad node's stopped at once (they
    # never rejoin; held, one caught in a collective waited out the hold's limit)
    (stop,) = only(d.actions, m.StopWorkers)
    wpn = sim.state.world.workers_per_node
    assert stop.in_job and stop.replace == tuple(("n2", lr) for lr in range(wpn))
    assert "evicted without a diagnosis" in sim.state.incident_cause
    d = sim.feed(m.Paused(step=30, restorable_step=30))
    assert not only(d.actions, m.RunDiagnosis)
    # (the transient DIAGNOSED every incident passes; here: its cause is known)
    diagnosed = next(e.recovery_transition for e in d.events if e.HasField("recovery_transition"))
    assert diagnosed.to_phase == ev.PHASE_DIAGNOSED and "no diagnosis needed" in diagnosed.reason
    assert [a.node_id for a in only(d.actions, m.EvictNode)] == ["n2"]
    assert list(sim.state.world.node_ids) == ["n0", "s0", "s1", "n3"]  # s1 in n2's rank
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING
    new = sim.log[before:]
    assert not [e for e in new if e.HasField("diagnosis_verdict")]
    runs = {a.diagnosis_id for dd in sim.decisions for a in only(dd.actions, m.RunDiagnosis)}
    assert runs == {earlier}  # only the earlier incident's diagnosis ran
    assert [(e.spare_assigned.spare_node_id, e.spare_assigned.replaces_node_id) for e in new if
            e.HasField("spare_assigned")] == [("s1", "n2")]  # fmt: skip
    evicted = evictions(sim)["n2"]
    assert evicted.diagnosis_id == "", (evicted, earlier)  # not the earlier incident's
    assert "without a diagnosis" in evicted.reason and "wrong matmul" in evicted.reason
    assert evictions(sim)["n1"].diagnosis_id == earlier  # the diagnosis that named it


def test_uncorrected_ecc_errors_evict_without_a_diagnosis() -> None:
    sim = start(nodes=3, spares=1)
    failures = ("disk: 2.0 GB free at / (need 10)", "ecc[0]: 3 uncorrected ECC errors, "
                "retirement pending: False")  # fmt: skip
    sim.feed(selfcheck("n1", *failures))
    assert list(sim.state.bad_nodes) == ["n1"] and not sim.state.needs_diagnosis
    d = sim.feed(m.Paused(step=5, restorable_step=5))
    assert not only(d.actions, m.RunDiagnosis)
    assert list(sim.state.world.node_ids) == ["n0", "s0", "n2"]
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING
    assert sim.state.nodes["n1"].state == ev.NODE_STATE_EVICTED


@pytest.mark.parametrize(
    "failure",
    [
        "matmul: check crashed: CUDA error: out of memory",  # no result: not a proof
        "disk: 2.0 GB free at / (need 10)",
        "gpu_memory[1]: 41% of device memory in use (limit 30%)",
        "gpu: check crashed: NVML error",
        "selfcheck: timed out after 90 s",
        "selfcheck: exited with -9 and no report ()",
        "gpu0",  # not "name: detail"
    ],
)
def test_other_failed_self_checks_are_still_diagnosed(failure: str) -> None:
    sim = start(nodes=3, spares=1)
    sim.feed(selfcheck("n1", failure))
    assert list(sim.state.suspects) == ["n1"] and not sim.state.bad_nodes
    d = sim.feed(m.Paused(step=5, restorable_step=5))
    (run,) = only(d.actions, m.RunDiagnosis)
    assert run.suspects == ("n1",)


def test_an_empty_self_check_evicts_diagnoses_a_wrong_matmul() -> None:
    sim = start(m.Policy(self_check_evicts=frozenset()), nodes=3, spares=1)
    sim.feed(wrong_matmul("n1"))
    assert list(sim.state.suspects) == ["n1"] and not sim.state.bad_nodes
    d = sim.feed(m.Paused(step=5, restorable_step=5))
    (run,) = only(d.actions, m.RunDiagnosis)
    d = sim.feed(verdict(run.diagnosis_id, ["n1"]))
    assert evictions(sim)["n1"].diagnosis_id == run.diagnosis_id
    sim.drive(set())
    assert list(sim.state.world.node_ids) == ["n0", "s0", "n2"]


def test_a_wrong_matmul_evicts_even_when_self_checks_are_not_diagnosed() -> None:
    """Without "self_check_reported" in diagnose_kinds a failed self-check only restarts the
    workers; a definitive one still evicts the node."""
    policy = m.Policy(diagnose_kinds=frozenset({"hang_suspected"}))
    sim = start(policy, nodes=3, spares=1)
    sim.feed(selfcheck("n1", "disk: 2.0 GB free at / (need 10)"))
    sim.drive(set())
    assert "n1" in sim.state.world.node_ids and not evictions(sim)
    sim.feed(wrong_matmul("n1"))
    sim.drive(set())
    assert list(sim.state.world.node_ids) == ["n0", "s0", "n2"] and "n1" in evictions(sim)


def test_a_wrong_matmul_during_a_diagnosis_joins_the_eviction_without_a_new_one() -> None:
    sim = start(nodes=4, spares=1)
    sim.feed(hang("n1"))
    sim.feed(m.Paused(step=9, restorable_step=9))
    (run,) = only(m.pending_actions(sim.state, sim.policy), m.RunDiagnosis)
    d = sim.feed(wrong_matmul("n3"))
    assert d.phase == ev.PHASE_PAUSED and list(sim.state.bad_nodes) == ["n3"]
    (again,) = only(d.actions, m.RunDiagnosis)
    assert again.diagnosis_id == run.diagnosis_id  # the same diagnosis goes on
    assert "n3" in run.nodes and "n3" not in again.nodes  # (no partner for a new one)
    # n3 is to be evicted anyway: its later faults do not grow the diagnosis
    assert sim.feed(alert("n3")).note.startswith("ignored")
    assert sim.feed(wrong_matmul("n3")).note.startswith("ignored")
    sim.feed(verdict(run.diagnosis_id, ["n1"]))
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING
    assert {"n1", "n3"} <= set(evictions(sim)) and not {"n1", "n3"} & set(sim.state.world.node_ids)


def test_fault_on_a_spare_only_marks_it_bad() -> None:
    sim = start(nodes=2, spares=1)
    d = sim.feed(alert("s0"))
    assert d.phase == ev.PHASE_RUNNING and kinds(d) == ["log_alert", "node_evicted"]
    assert sim.state.nodes["s0"].state == ev.NODE_STATE_EVICTED
    assert sim.feed(lost("s0")).phase == ev.PHASE_RUNNING
    # a spare whose registration self-check computed a wrong matmul, likewise
    sim.feed(register("s1", 1, spare=True))
    d = sim.feed(wrong_matmul("s1"))
    assert d.phase == ev.PHASE_RUNNING and kinds(d) == ["self_check_reported", "node_evicted"]
    assert d.events[1].node_evicted.reason.startswith("idle: self-check failed on s1")
    assert sim.state.nodes["s1"].state == ev.NODE_STATE_EVICTED


def test_a_returning_node_is_not_evicted_for_its_leftover_workers() -> None:
    """A node replaced while silent (SIGSTOPped agent) comes back with the old world's
    workers: their exits and stalls are its cleanup, not its health (docs/detection.md)."""
    sim = start(nodes=2, spares=1)
    sim.feed(lost("n1", epoch=1))
    sim.drive(set())
    assert "n1" not in sim.state.world.node_ids and sim.state.phase == ev.PHASE_RUNNING
    sim.feed(register("n1", 1))  # the same agent (same epoch), resumed
    for obs in (crash("n1"), hang("n1")):
        d = sim.feed(obs)
        assert "node_evicted" not in kinds(d) and d.phase == ev.PHASE_RUNNING, kinds(d)
    assert sim.state.nodes["n1"].state == ev.NODE_STATE_ACTIVE  # idle: the world can take it
    d = sim.feed(alert("n1"))  # its own hardware alert still marks it bad
    assert "node_evicted" in kinds(d)


def test_loss_spike_rolls_back_to_the_checkpoint_before_it_without_eviction() -> None:
    sim = start(nodes=2)
    for step in (10, 20, 30):
        sim.feed(checkpoint(step))
    d = sim.feed(spike(30))
    assert kinds(d) == ["loss_spike", "rollback", "recovery_transition"]
    rb = d.events[1].rollback
    assert (rb.from_step, rb.to_step, rb.skip_batches) == (30, 20, 200)
    sim.training_step = 31
    d = sim.feed(m.Paused(step=31, restorable_step=31))
    (rs,) = only(d.actions, m.Restore)
    assert rs.step == 20 and {s for _, s in rs.sources} == {"storage"}
    assert not only(d.actions, m.EvictNode)
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING and sim.state.step == 20
    assert not sim.state.HasField("rollback_to")


def test_loss_spike_rolls_back_from_memory_to_the_step_before_it() -> None:
    """The rings hold steps after the newest commit: the target is the step before the
    spike, restored from memory; if the copy is gone by the pause, the newest commit."""
    for left in (True, False):
        sim = start(nodes=2)
        sim.feed(checkpoint(10))
        e = spike(30)
        e.loss_spike.memory_steps.extend([27, 28, 29])
        d = sim.feed(e)
        rb = d.events[1].rollback
        assert (rb.from_step, rb.to_step) == (30, 29)
        sim.training_step = 33
        held = frozenset({29, 30, 31, 32, 33} if left else {31, 32, 33})
        d = sim.feed(m.Paused(step=33, restorable_step=max(held), memory_steps=held))
        (rs,) = only(d.actions, m.Restore)
        if left:
            assert rs.step == 29 and {s for _, s in rs.sources} == {"memory"}
        else:  # overwritten by the steps trained before the stop: the newest commit
            assert rs.step == 10 and {s for _, s in rs.sources} == {"storage"}
        sim.drive(set())
        assert sim.state.phase == ev.PHASE_RUNNING and sim.state.step == rs.step


def test_loss_spike_without_an_earlier_checkpoint_fails_the_job() -> None:
    sim = start(nodes=2)
    d = sim.feed(spike(5))
    assert d.phase == ev.PHASE_FAILED
    assert "no checkpoint before it" in d.events[-1].job_finished.reason


def test_operator_evict_and_diagnose() -> None:
    sim = start(nodes=4, spares=1)
    d = sim.feed(operator("evict", "n1"))
    assert sim.state.bad_nodes == ["n1"] and d.phase == ev.PHASE_SUSPECTED
    sim.drive(set())
    assert "n1" not in sim.state.world.node_ids
    assert sim.state.nodes["n1"].state == ev.NODE_STATE_EVICTED
    sim.feed(operator("diagnose"))
    sim.feed(m.Paused(step=1))
    (run,) = only(m.pending_actions(sim.state, sim.policy), m.RunDiagnosis)
    assert set(run.suspects) == set(sim.state.world.node_ids)
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING


def test_restore_failures_are_retried_up_to_the_limit() -> None:
    sim = start(m.Policy(max_restore_attempts=2), nodes=2)
    sim.feed(crash("n0"))
    sim.feed(m.Paused(step=4))
    assert only(sim.decisions[-1].actions, m.Restore)[0].attempt == 1
    sim.feed(restored(0, ok=False))
    d = sim.feed(m.Paused(step=4))
    assert only(d.actions, m.Restore)[0].attempt == 2
    sim.feed(restored(0, ok=False))
    d = sim.feed(m.Paused(step=4))
    assert d.phase == ev.PHASE_FAILED and "max_restore_attempts" in d.events[-1].job_finished.reason


def test_shrink_first_keeps_spares_in_reserve() -> None:
    policy = m.Policy(reshape=m.Reshape.SHRINK_FIRST, min_nodes=2)
    sim = start(policy, nodes=3, spares=1)
    sim.feed(lost("n0"))
    sim.drive(set())
    assert list(sim.state.world.node_ids) == ["n1", "n2"]
    assert sim.state.nodes["s0"].state == ev.NODE_STATE_SPARE
    sim.feed(lost("n1"))  # now only a spare keeps the job at min_nodes
    sim.drive(set())
    assert list(sim.state.world.node_ids) == ["s0", "n2"]  # in n1's rank position


def test_agent_restart_of_a_world_node_is_a_fault() -> None:
    sim = start(nodes=2)
    d = sim.feed(register("n1", 7))
    assert d.phase == ev.PHASE_SUSPECTED and "restarted" in sim.state.incident_cause


def test_stale_epoch_loss_is_ignored() -> None:
    sim = start(nodes=2)
    sim.feed(lost("n1", epoch=1))
    sim.drive(set())
    sim.feed(register("n1", 2))  # n1 is back with a new agent
    sim.drive(set())
    d = sim.feed(lost("n1", epoch=1))  # a late report about the old agent
    assert d.phase == ev.PHASE_RUNNING and sim.state.nodes["n1"].state == ev.NODE_STATE_ACTIVE


def test_settle_finishes_a_half_appended_decision() -> None:
    sim = start(nodes=3, spares=1)
    sim.feed(lost("n2"))
    d = m.decide(sim.state, m.Paused(step=6, restorable_step=6), sim.policy)
    sim.append(d.events[:2])  # the driver died after two of its events
    assert sim.state.phase == ev.PHASE_DIAGNOSED
    rest = m.settle(sim.state, sim.policy)
    sim.append(rest.events)
    assert sim.state.phase == d.phase and rest.actions == d.actions
    # and a lost node that never got its reaction opens the incident on replay
    sim.drive(set())
    sim.append([lost("n0")])
    assert m.settle(sim.state, sim.policy).phase == ev.PHASE_SUSPECTED


def test_self_check_evicts_flag_parses_a_comma_list_and_empty_means_none() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, m.Policy)

    def build(*args: str) -> m.Policy:
        return config_from_args(m.Policy, parser.parse_args(list(args)))  # type: ignore[no-any-return]

    assert build().self_check_evicts == frozenset({"matmul", "ecc"})
    assert build("--self-check-evicts", "").self_check_evicts == frozenset()
    assert build("--self-check-evicts", "mig, ecc").self_check_evicts == {"mig", "ecc"}
    with pytest.raises(ValueError, match="unknown self-check items"):
        build("--self-check-evicts", "matmul,gpu0")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_nodes", 0, "min_nodes"),
        ("max_nodes", -1, "max_nodes"),
        ("diagnose_kinds", frozenset({"node_lost"}), "diagnose_kinds"),
        ("self_check_evicts", frozenset({"gpu"}), "self_check_evicts.*choose from"),
        ("max_restore_attempts", 0, "max_restore_attempts"),
        ("reshape", "spares", "reshape"),
    ],
)
def test_policy_validation_names_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        m.Policy(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_nodes"):
        m.Policy(min_nodes=4, max_nodes=2)


def test_a_world_over_1024_nodes_takes_a_spare_and_a_cap_below_nodes_is_refused() -> None:
    """The default cap is the configured world (it once was 1,024 nodes: a bigger world shrank
    to 1,024 at its first incident instead of taking a spare in)."""
    from unbroken.driver.loop import LoopConfig

    nodes = [f"n{i}" for i in range(1100)]
    layout = m.Layout(dp=1100, pp=1, tp=1, workers_per_node=1, node_ids=tuple(nodes))
    s = ev.JobState(phase=ev.PHASE_RUNNING)
    s.world.CopyFrom(layout.to_proto())
    s.configured_world.CopyFrom(layout.to_proto())
    for i, n in enumerate([*nodes, "spare"]):
        state = ev.NODE_STATE_SPARE if n == "spare" else ev.NODE_STATE_ACTIVE
        s.nodes[n].CopyFrom(ev.NodeRecord(node_id=n, state=state, registered_seq=i + 1))
    s.nodes["n7"].state = ev.NODE_STATE_LOST
    planned = m.plan_world(s, m.Policy())
    assert isinstance(planned, m.Layout), planned
    assert (
        len(planned.node_ids) == 1100
        and "spare" in planned.node_ids
        and "n7" not in planned.node_ids
    )
    with pytest.raises(ValueError, match="--max-nodes"):
        LoopConfig(nodes=8, policy=m.Policy(max_nodes=4))


def test_a_world_past_the_registration_cap_is_refused_at_start():
    """bench-scale at 20,480 nodes: the driver's registration cap (20,000) refused the last
    nodes, which retried for 900 s; the driver now says so before it starts."""
    from unbroken.driver.config import DriverConfig, ServiceConfig
    from unbroken.driver.liveview import LiveViewConfig
    from unbroken.driver.loop import LoopConfig

    loop = LoopConfig(nodes=20_480, policy=m.Policy(max_nodes=20_544))
    with pytest.raises(ValueError, match="--max-registered-nodes above 20544"):
        DriverConfig(loop=loop, archive_url="none")
    big = ServiceConfig(live=LiveViewConfig(max_nodes=21_000))
    assert DriverConfig(loop=loop, service=big, archive_url="none").loop.nodes == 20_480


# ---------------------------------------------------------------- exhaustive small cases
FAULTS = {
    "lost": lost,
    "crash": crash,
    "hang": hang,
    "alert": alert,
    "selfcheck": selfcheck,
    "matmul": wrong_matmul,
    "evict": lambda n: operator("evict", n),
}
WAYPOINTS = (ev.PHASE_SUSPECTED, ev.PHASE_PAUSED, ev.PHASE_RESTORING, ev.PHASE_RUNNING)


def test_exhaustive_two_faults_at_every_phase_of_the_loop() -> None:
    """Every fault x every second fault x every phase it can land in, on 3 nodes + 1 spare.

    The second fault lands when the first incident reaches the given phase; both nodes
    are truly bad when the fault is unclear. The machine must end RUNNING whenever a
    layout can still be built, else FAILED (by the brute-force `feasible`).
    """
    nodes = ["n0", "n1", "n2", "s0"]
    runs = 0
    for (k1, f1), a, (k2, f2), b, when in itertools.product(
        FAULTS.items(), nodes, FAULTS.items(), nodes, WAYPOINTS
    ):
        sim = start(m.Policy(min_nodes=1), nodes=3, spares=1)
        sim.crash_checks = runs % 7 == 0  # the prefix checks on a deterministic sample
        bad = {a, b}
        sim.training_step = 11
        sim.feed(f1(a))
        for _ in range(12):
            if sim.state.phase == when or sim.state.phase == ev.PHASE_FAILED:
                break
            sim.progress(bad)
        sim.feed(f2(b))
        sim.drive(bad)
        runs += 1
        end = sim.state
        if end.phase == ev.PHASE_FAILED:
            assert sim.failed_state is not None and not feasible(sim.failed_state, sim.policy)
        else:
            assert end.phase == ev.PHASE_RUNNING, (k1, a, k2, b, when)
            assert not set(end.world.node_ids) & {
                n for n, r in end.nodes.items() if r.state != ev.NODE_STATE_ACTIVE
            }
    assert runs == len(FAULTS) ** 2 * len(nodes) ** 2 * len(WAYPOINTS)


def test_symptom_log_alerts_are_recorded_and_hardware_ones_open_an_incident() -> None:
    sim = start(nodes=2)
    # A peer died: every survivor prints a Traceback / RuntimeError. Recorded only.
    for keyword in sorted(m.SYMPTOM_KEYWORDS):
        d = sim.feed(ev.Event(log_alert=ev.LogAlert(node_id="n0", keyword=keyword, line="x")))
        assert kinds(d) == ["log_alert"] and d.phase == ev.PHASE_RUNNING, keyword
    assert sim.state.incident_id == ""
    d = sim.feed(alert("n1"))  # "Xid": a hardware fault is a suspect, diagnosed
    assert d.phase == ev.PHASE_SUSPECTED and list(sim.state.suspects) == ["n1"]


def test_a_spare_in_the_world_reconnecting_stays_in_the_world() -> None:
    """After a driver failover the agents register again with the new leader. A spare the
    world took (its agent still started with --spare) registering with the same epoch is a
    reconnect: it stays active in the world and no incident opens. Folded as a spare, it
    had left the world ("nodes ['s0'] left the world") and the job restored a step far back.
    A new epoch of the same node is a restarted agent: an incident, as before."""
    sim = start(nodes=2, spares=1)
    sim.feed(lost("n1"))
    sim.feed(m.Paused(step=10, restorable_step=9))
    sim.drive(set())
    assert list(sim.state.world.node_ids) == ["n0", "s0"] and sim.state.phase == ev.PHASE_RUNNING
    d = sim.feed(register("s0", 1, spare=True))
    assert sim.state.nodes["s0"].state == ev.NODE_STATE_ACTIVE
    assert d.phase == ev.PHASE_RUNNING and kinds(d) == ["node_registered"]
    assert not only(d.actions, m.StopWorkers)
    d = sim.feed(register("s0", 2, spare=True))
    assert d.phase == ev.PHASE_SUSPECTED and only(d.actions, m.StopWorkers)


# ---------------------------------------------------------------- the restore budget and resume
def test_restores_an_operator_cut_short_cost_no_budget() -> None:
    """Evictions landing during restores (an operator at work) never fail the job; a crash
    during a restore does count."""
    sim = start(m.Policy(max_restore_attempts=1), nodes=3, spares=3)
    sim.feed(crash("n0"))
    sim.feed(m.Paused(step=4))
    assert sim.state.phase == ev.PHASE_RESTORING
    for spare in ("s0", "s1"):  # each eviction cuts the restore short; it is not a failure
        sim.feed(operator("evict", spare))
        assert sim.state.failed_restores == 0, sim.state
        sim.feed(m.Paused(step=4))
        assert sim.state.phase == ev.PHASE_RESTORING
    sim.feed(crash("n1"))  # a fault of the job's own: this restore failed
    assert sim.state.failed_restores == 1
    d = sim.feed(m.Paused(step=4))
    assert d.phase == ev.PHASE_FAILED and "unbroken resume" in d.events[-1].job_finished.reason


def test_resume_rearms_a_failed_job_with_a_fresh_budget() -> None:
    sim = start(m.Policy(max_restore_attempts=1), nodes=2)
    d = sim.feed(operator(m.RESUME))
    assert d.phase == ev.PHASE_RUNNING and "nothing to resume" in d.note
    sim.feed(crash("n0"))
    sim.feed(m.Paused(step=4))
    sim.feed(restored(0, ok=False))
    sim.feed(m.Paused(step=4))
    assert sim.state.phase == ev.PHASE_FAILED
    failed_incident = sim.state.incident_id
    d = sim.feed(operator(m.RESUME))
    t = d.events[-1].recovery_transition
    assert (t.from_phase, t.to_phase, t.rearm, t.by_operator) == (
        ev.PHASE_FAILED,
        ev.PHASE_SUSPECTED,
        True,
        True,
    )
    assert sim.state.incident_id != failed_incident and sim.state.failed_restores == 0
    assert any(isinstance(a, m.StopWorkers) for a in d.actions)
    d = sim.feed(m.Paused(step=4))
    restore = only(d.actions, m.Restore)[0]
    assert d.phase == ev.PHASE_RESTORING and restore.attempt == 1
    d = sim.feed(restored(restore.step))
    assert d.phase == ev.PHASE_RUNNING


def test_resume_restarts_a_recovery_stuck_waiting_for_a_diagnosis() -> None:
    sim = start(m.Policy(diagnose_kinds=frozenset({"hang_suspected"})), nodes=2)
    sim.feed(hang("n1"))
    d = sim.feed(m.Paused(step=4))
    assert d.phase == ev.PHASE_PAUSED and any(isinstance(a, m.RunDiagnosis) for a in d.actions)
    stuck = sim.state.incident_id  # its verdict never comes
    d = sim.feed(operator(m.RESUME))
    assert d.phase == ev.PHASE_SUSPECTED and sim.state.incident_id != stuck
    assert not sim.state.needs_diagnosis and not sim.state.suspects
    d = sim.feed(m.Paused(step=4))
    assert d.phase == ev.PHASE_RESTORING
    d = sim.feed(restored(sim.state.restore_step))
    assert d.phase == ev.PHASE_RUNNING
    d = sim.feed(operator(m.RESUME))  # nothing to resume now
    assert d.phase == ev.PHASE_RUNNING and "nothing to resume" in d.note
