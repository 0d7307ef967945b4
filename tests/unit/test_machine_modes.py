"""The machine's choice of recovery mode per incident (in-job or a restart of every process)."""

from __future__ import annotations

import pytest

from tests.unit.machine_harness import Sim, alert, crash, hang, job, lost, restored, spike
from unbroken.driver import machine as m
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def start(policy: m.Policy | None = None, **layout: int) -> Sim:
    sim = Sim(policy or m.Policy())
    sim.append(job(**layout))
    return sim


def only(acts: tuple[m.Action, ...], cls: type) -> list:  # type: ignore[type-arg]
    return [a for a in acts if isinstance(a, cls)]


def killed(node: str, local_rank: int = 0, global_rank: int = -1) -> ev.Event:
    """A worker killed from outside (SIGKILL): its peers are sound."""
    return ev.Event(
        worker_failed=ev.WorkerFailed(
            node_id=node, local_rank=local_rank, global_rank=global_rank, exit_code=-9
        )
    )


def resumed_mode(sim: Sim) -> str:
    return [e.training_resumed.mode for e in sim.log if e.HasField("training_resumed")][-1]


def test_a_killed_worker_is_replaced_in_job_and_only_it_stops() -> None:
    sim = start(nodes=2, wpn=2)
    d = sim.feed(killed("n1", local_rank=1))
    (pause,) = only(d.actions, m.StopWorkers)
    assert pause.in_job and pause.replace == (("n1", 1),), pause
    assert sim.state.recovery_mode == m.IN_JOB and list(sim.state.replace_ranks) == [3]
    d = sim.feed(m.Paused(step=10, restorable_step=10))
    (sw,) = only(d.actions, m.StartWorkers)
    assert sw.in_job
    sim.feed(restored(10))
    assert sim.state.phase == ev.PHASE_RUNNING and resumed_mode(sim) == m.IN_JOB
    assert sim.state.recovery_mode == "" and not sim.state.replace_ranks  # closed


@pytest.mark.parametrize("code", [1, -11, -6, 139, 3])
def test_a_crash_inside_the_process_is_suspect_and_restarts_every_process(code: int) -> None:
    sim = start(nodes=2)
    d = sim.feed(crash("n1", code=code))
    (pause,) = only(d.actions, m.StopWorkers)
    assert not pause.in_job and sim.state.recovery_mode == m.RESTART
    assert "suspect" in sim.state.incident_cause
    sim.drive(set())
    assert resumed_mode(sim) == m.RESTART


def test_a_failed_in_job_restore_falls_back_to_a_restart() -> None:
    sim = start(nodes=2)
    sim.feed(killed("n1"))
    sim.feed(m.Paused(step=10, restorable_step=10))
    assert sim.state.phase == ev.PHASE_RESTORING and sim.state.recovery_mode == m.IN_JOB
    d = sim.feed(restored(10, ok=False))
    assert sim.state.recovery_mode == m.RESTART
    (pause,) = only(d.actions, m.StopWorkers)
    assert not pause.in_job
    sim.drive(set())
    assert resumed_mode(sim) == m.RESTART


def test_a_suspect_fault_during_an_in_job_incident_turns_it_into_a_restart() -> None:
    sim = start(nodes=3)
    sim.feed(killed("n1"))
    assert sim.state.recovery_mode == m.IN_JOB
    sim.feed(crash("n2", code=-11))
    assert sim.state.recovery_mode == m.RESTART
    sim.feed(killed("n0"))  # a clean fault never turns it back
    assert sim.state.recovery_mode == m.RESTART


def test_without_in_job_every_incident_restarts() -> None:
    sim = start(m.Policy(in_job=False), nodes=2)
    d = sim.feed(killed("n1"))
    assert not only(d.actions, m.StopWorkers)[0].in_job
    sim.drive(set())
    assert resumed_mode(sim) == m.RESTART


def test_a_lost_node_and_a_rollback_keep_the_other_processes() -> None:
    sim = start(nodes=2, spares=1)
    d = sim.feed(lost("n1"))
    (pause,) = only(d.actions, m.StopWorkers)
    assert pause.in_job and pause.replace == ()  # its ranks go with it (a spare's start)
    sim.drive(set())
    assert resumed_mode(sim) == m.IN_JOB
    sim.append([ev.Event(checkpoint_committed=ev.CheckpointCommitted(step=5, ranks=2))])
    d = sim.feed(spike(9))
    assert only(d.actions, m.StopWorkers)[0].in_job
    sim.drive(set())
    assert resumed_mode(sim) == m.IN_JOB


def test_a_stopped_process_is_replaced_in_job_and_an_unclear_fault_restarts() -> None:
    sim = start(nodes=2)
    d = sim.feed(hang("n1", phase="stopped"))
    (pause,) = only(d.actions, m.StopWorkers)
    assert pause.in_job and pause.replace == (("n1", 0),)
    sim.drive(set())
    assert resumed_mode(sim) == m.IN_JOB
    sim = start(nodes=2, spares=1)
    sim.feed(hang("n1"))  # unclear: a diagnosis stops every worker anyway
    assert sim.state.recovery_mode == m.RESTART
    sim = start(nodes=2, spares=1)
    sim.feed(alert("n1"))  # a hardware alert: the node's processes may be poisoned
    assert sim.state.recovery_mode == m.RESTART
