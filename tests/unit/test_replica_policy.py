"""The replica policy (driver/replicapolicy.py): the other replicas train on through a fault
confined to one data-parallel replica, and the replica rejoins by a grow-back when released."""

from __future__ import annotations

import pytest

from tests.unit.machine_harness import Sim, crash, hang, job, lost, register, restored
from unbroken.driver import machine as m
from unbroken.driver import replicapolicy as rp
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

KEEP = m.Policy(keep_training=True)


def start(policy: m.Policy = KEEP, **layout: int) -> Sim:
    sim = Sim(policy)
    sim.append(job(**layout))
    return sim


def killed(node: str, local_rank: int = 0) -> ev.Event:
    return ev.Event(
        worker_failed=ev.WorkerFailed(node_id=node, local_rank=local_rank, exit_code=-9)
    )


def ready(*nodes: str) -> ev.Event:
    return ev.Event(replica_ready=ev.ReplicaReady(node_ids=list(nodes), reason="test"))


def only(acts: tuple[m.Action, ...], cls: type) -> list:  # type: ignore[type-arg]
    return [a for a in acts if isinstance(a, cls)]


def world(sim: Sim) -> tuple[int, list[str]]:
    return sim.state.world.dp, list(sim.state.world.node_ids)


def through_incident(sim: Sim, step: int) -> tuple[m.Decision, m.Decision]:
    """Pause at `step` and restore it; the (paused, restored) decisions."""
    paused = sim.feed(m.Paused(step=step, restorable_step=step))
    done = sim.feed(restored(step))
    return paused, done


def test_a_killed_worker_s_replica_sits_out_and_the_others_train_on_with_dp_minus_one() -> None:
    sim = start(nodes=4)
    d = sim.feed(killed("n2"))
    (pause,) = only(d.actions, m.StopWorkers)
    assert pause.in_job and pause.replace == (("n2", 0),), "only the killed rank stops"
    assert list(sim.state.sitting_out) == ["n2"]
    assert "replica policy" in sim.state.incident_cause
    paused, _ = through_incident(sim, 10)
    (sw,) = only(paused.actions, m.StartWorkers)
    assert sw.in_job and sw.world.dp == 3 and "n2" not in sw.world.node_ids
    assert only(paused.actions, m.StopAll) == [m.StopAll(("n2",))], "its node runs nothing"
    assert sim.state.phase == ev.PHASE_RUNNING and world(sim) == (3, ["n0", "n1", "n3"])
    assert list(sim.state.sitting_out) == ["n2"], "no grow-back before the release"


def test_the_release_grows_the_replica_back_in_job() -> None:
    sim = start(nodes=2)
    sim.feed(killed("n1"))
    through_incident(sim, 10)
    assert world(sim) == (1, ["n0"])
    d = sim.feed(ready("n1"))
    assert not sim.state.sitting_out
    assert sim.state.phase == ev.PHASE_SUSPECTED and "grow" in sim.state.incident_cause
    (pause,) = only(d.actions, m.StopWorkers)
    assert pause.in_job and pause.replace == ()
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING and world(sim) == (2, ["n0", "n1"])


def test_a_lost_node_sits_out_even_with_a_spare_and_the_spare_comes_in_at_the_release() -> None:
    sim = start(nodes=2, spares=1)
    sim.feed(lost("n1"))
    assert list(sim.state.sitting_out) == ["n1"]
    through_incident(sim, 7)
    assert world(sim) == (1, ["n0"]), "the spare waits for the grow-back"
    sim.feed(ready("n1"))
    sim.drive(set())
    assert world(sim) == (2, ["n0", "s0"])


def test_a_replica_of_several_nodes_sits_out_whole() -> None:
    sim = start(nodes=4, wpn=1, tp=2)  # dp 2: replica 0 on n0,n1, replica 1 on n2,n3
    d = sim.feed(killed("n3"))
    assert list(sim.state.sitting_out) == ["n2", "n3"]
    (pause,) = only(d.actions, m.StopWorkers)
    assert pause.replace == (("n3", 0),)
    paused, _ = through_incident(sim, 5)
    assert world(sim) == (1, ["n0", "n1"])
    assert only(paused.actions, m.StopAll) == [m.StopAll(("n2", "n3"))]


def test_a_stopped_rank_s_hang_sits_out_its_replica() -> None:
    sim = start(nodes=3)
    sim.feed(hang("n0", phase="stopped"))
    assert list(sim.state.sitting_out) == ["n0"]
    through_incident(sim, 4)
    assert world(sim) == (2, ["n1", "n2"])


@pytest.mark.parametrize(
    ("policy", "layout", "fault"),
    [
        (m.Policy(), {"nodes": 2}, killed("n1")),  # off by default
        (KEEP, {"nodes": 2, "tp": 2}, killed("n1")),  # dp 1: no other replica
        (KEEP, {"nodes": 2}, crash("n1", code=-11)),  # suspect: every process restarts
        (KEEP, {"nodes": 2}, hang("n1")),  # unclear: a diagnosis first
        (KEEP, {"nodes": 1, "wpn": 2}, killed("n0", 1)),  # replicas share a node
        (m.Policy(keep_training=True, min_nodes=2), {"nodes": 2}, killed("n1")),
        (m.Policy(keep_training=True, in_job=False), {"nodes": 2}, killed("n1")),
    ],
)
def test_where_the_policy_does_not_apply_the_incident_is_as_before(
    policy: m.Policy, layout: dict[str, int], fault: ev.Event
) -> None:
    sim = start(policy, **layout)
    sim.feed(fault)
    assert not sim.state.sitting_out
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING
    assert len(sim.state.world.node_ids) == layout["nodes"]


def test_a_second_fault_during_the_shrink_folds_in_and_the_job_still_runs() -> None:
    sim = start(nodes=3)
    sim.feed(killed("n1"))
    sim.feed(lost("n2"))  # another replica is lost before the pause is over
    assert list(sim.state.sitting_out) == ["n1"]
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING and world(sim) == (1, ["n0"])
    sim.feed(ready("n1"))
    sim.drive(set())
    assert world(sim) == (2, ["n0", "n1"]), "n1 back; n2 is gone"


def test_a_node_that_returns_meanwhile_waits_for_the_release_too() -> None:
    sim = start(nodes=2, extra=1)
    sim.feed(killed("n1"))
    through_incident(sim, 3)
    d = sim.feed(register("n2", 1))  # a new node joins while n1 sits out
    assert sim.state.phase == ev.PHASE_RUNNING and world(sim) == (1, ["n0"]), d.note
    sim.feed(ready("n1"))
    sim.drive(set())
    assert world(sim) == (2, ["n0", "n1"])


def test_replica_helpers_on_layouts() -> None:
    w = ev.WorldLayout(dp=2, pp=2, tp=1, node_ids=["a", "b", "c", "d"], workers_per_node=1)
    assert rp.replica_of_rank(w, 3) == 1 and rp.replica_nodes(w, 1) == ("c", "d")
    assert rp.sits_out(w, ["c"], [], 1) == ("c", "d")
    assert rp.sits_out(w, ["a", "c"], [], 1) == (), "two replicas hit"
    assert rp.sits_out(w, ["x"], [], 1) == (), "not in the world"
    two = ev.WorldLayout(dp=4, pp=1, tp=1, node_ids=["a", "b"], workers_per_node=2)
    assert rp.sits_out(two, ["a"], [1], 1) == (), "replicas 0 and 1 share node a"
    assert rp.sits_out(w, ["c"], [], 3) == (), "below min_nodes"


def test_policy_checks_its_delay() -> None:
    with pytest.raises(ValueError, match="replica_rejoin_s"):
        m.Policy(replica_rejoin_s=float("nan"))
    with pytest.raises(ValueError, match="replica_rejoin_s"):
        m.Policy(replica_rejoin_s=-1)
