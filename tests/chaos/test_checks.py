"""The chaos pass criteria catch what they claim to (pure, milliseconds).

Each criterion passes on a consistent history and names the defect on a broken one: a
hole, a duplicate, a lost or overwritten acknowledged append, a loop state that drifted
from the fold, a misreported status, a wrong or missing loss.
"""

from __future__ import annotations

import pytest

from tests.chaos import checks
from unbroken.driver import state as statelib
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.chaos

JOB = "j"


def history() -> list[ev.Event]:
    world = ev.WorldLayout(dp=2, pp=1, tp=1, node_ids=["n0", "n1"], workers_per_node=1)
    payloads = [
        ev.Event(leader_elected=ev.LeaderElected(driver_id="a1", term=1)),
        ev.Event(node_registered=ev.NodeRegistered(node_id="n0", num_workers=1)),
        ev.Event(node_registered=ev.NodeRegistered(node_id="n1", num_workers=1)),
        ev.Event(job_started=ev.JobStarted(trainer="gpt3d", world=world)),
        ev.Event(training_resumed=ev.TrainingResumed(world=world)),
        ev.Event(worker_failed=ev.WorkerFailed(node_id="n1")),
    ]
    for i, e in enumerate(payloads, start=1):
        e.seq, e.event_id, e.writer = i, f"id{i}", "a1"
    return payloads


def acks(events: list[ev.Event]) -> list[tuple[int, str, str]]:
    return [(e.seq, e.event_id, e.writer) for e in events]


def test_check_log_accepts_a_consistent_history_and_names_each_defect() -> None:
    events = history()
    assert checks.check_log(events, acks(events)) == []
    assert "not dense" in checks.check_log(events[:2] + events[3:], [])[0]
    dup = history()
    dup[4].event_id = "id2"
    assert any("id2 at seq 2 and 5" in p for p in checks.check_log(dup, []))
    lost = checks.check_log(events[:4], acks(events))
    assert any("seq 5" in p and "not in the log" in p for p in lost)
    over = checks.check_log(events, [(3, "other", "b2")])
    assert any("acknowledged to b2 as other" in p for p in over)


def test_check_loop_states_requires_the_fold_from_seq_one() -> None:
    events = history()
    good = [statelib.fold(events[:n], statelib.initial(JOB)).SerializeToString() for n in (2, 6)]
    assert checks.check_loop_states(JOB, events, good) == []
    drift = statelib.fold(events[:5], statelib.initial(JOB))
    drift.step = 99
    problems = checks.check_loop_states(JOB, events, [drift.SerializeToString()])
    assert len(problems) == 1 and "step: fold=0 live=99" in problems[0]


def test_check_status_compares_the_report_at_its_seq() -> None:
    events = history()
    s = statelib.fold(events, statelib.initial(JOB))
    status = dpb.GetStatusResponse(
        phase=s.phase, step=s.step, last_seq=s.last_seq, leader_term=s.leader_term
    )
    nodes = dpb.ListNodesResponse(
        nodes=[
            dpb.NodeInfo(node_id=k, state=r.state, spare=r.spare, failures=r.failures)
            for k, r in s.nodes.items()
        ]
    )
    assert checks.check_status(JOB, events, status, nodes) == []
    status.phase = ev.PHASE_PAUSED
    del nodes.nodes[0]
    problems = checks.check_status(JOB, events, status, nodes)
    assert any("GetStatus phase" in p for p in problems)
    assert any("ListNodes lacks" in p for p in problems)


def test_check_losses_wants_every_step_with_the_reference_loss() -> None:
    ref = {1: [3.0], 2: [2.5], 3: [2.0], 4: [1.5]}
    assert checks.check_losses({1: [3.0], 2: [2.5, 2.5], 3: [2.0]}, ref, []) == ([], 4)
    problems, _ = checks.check_losses({1: [3.0], 3: [2.0, 2.1]}, ref, [])
    assert any("never trained: [2]" in p for p in problems)
    assert any("step 3: loss 2.1" in p for p in problems)
    rollback = ev.Event(rollback=ev.Rollback(from_step=3, to_step=2))
    assert checks.check_losses({1: [3.0], 2: [2.5], 3: [9.0]}, ref, [rollback]) == ([], 2)
    assert checks.check_losses({}, ref, [])[0] == ["the chaos run logged no step"]


def test_a_shrunk_world_is_compared_with_a_tolerance_only() -> None:
    ref = {1: [3.0], 2: [2.5]}
    got = {1: [3.0], 2: [2.5000001]}
    assert checks.check_losses(got, ref, history())[0] != []  # dp never changed: exact
    shrink = ev.Event(
        world_resized=ev.WorldResized(new_world=ev.WorldLayout(dp=1, pp=1, tp=1, node_ids=["n0"]))
    )
    assert checks.resharded([*history(), shrink])
    assert checks.check_losses(got, ref, [*history(), shrink]) == ([], 2)
    assert checks.check_losses({1: [3.0], 2: [2.6]}, ref, [*history(), shrink])[0] != []
