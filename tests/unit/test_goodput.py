"""The goodput ledger folded from the log, and the figure computed from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.agent.workers import Worker, in_step_shares
from unbroken.driver import state as statelib
from unbroken.driver.goodput import LiveInputs, goodput
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

S = 1_000_000_000  # ns per second
T0 = 1_700_000_000 * S


def _events() -> list[ev.Event]:
    out = [
        ev.Event(job_started=ev.JobStarted(trainer="gpt3d")),
        ev.Event(training_resumed=ev.TrainingResumed(at_step=0)),
        ev.Event(node_lost=ev.NodeLost(node_id="n1")),  # at 100 s: the incident's cause
        ev.Event(
            recovery_transition=ev.RecoveryTransition(
                from_phase=ev.PHASE_RUNNING, to_phase=ev.PHASE_SUSPECTED, incident_id="i1"
            )
        ),
        ev.Event(training_paused=ev.TrainingPaused(at_step=50, restore_step=45)),
        ev.Event(training_resumed=ev.TrainingResumed(at_step=45)),  # at 130 s: 30 s down
        ev.Event(worker_failed=ev.WorkerFailed(node_id="n2")),  # at 200 s, still open
        ev.Event(
            recovery_transition=ev.RecoveryTransition(
                from_phase=ev.PHASE_RUNNING, to_phase=ev.PHASE_SUSPECTED, incident_id="i2"
            )
        ),
    ]
    walls = [0, 0, 100, 100, 105, 130, 200, 200]
    for i, (e, w) in enumerate(zip(out, walls, strict=True), 1):
        e.seq = i
        e.wall_time_unix_ns = T0 + w * S
    return out


def test_the_ledger_charges_each_incident_to_its_cause() -> None:
    s = statelib.fold(_events(), statelib.initial("j"))
    g = s.goodput
    assert g.started_ns == T0
    assert dict(g.lost_s_by_cause) == {"node_lost": 30.0}
    assert g.steps_redone == 5 and g.incidents == 1
    assert g.incident_began_ns == T0 + 200 * S and g.incident_cause == "worker_failed"


def test_goodput_adds_the_open_incident_and_prices_redone_steps() -> None:
    s = statelib.fold(_events(), statelib.initial("j"))
    gp = goodput(s, T0 + 250 * S, step_s=2.0)
    assert gp.wall_s == 250.0
    assert gp.lost_s_by_cause == {"node_lost": 30.0, "worker_failed": 50.0, "steps_redone": 10.0}
    assert abs(gp.ratio - (250 - 90) / 250) < 1e-9


def test_a_replay_folds_the_same_ledger_and_no_start_means_no_figure() -> None:
    events = _events()
    once = statelib.fold(events, statelib.initial("j"))
    twice = statelib.fold(events[4:], statelib.fold(events[:4], statelib.initial("j")))
    assert once.goodput == twice.goodput
    assert goodput(statelib.initial("j"), T0, 1.0).ratio == -1.0


def test_only_restores_that_read_storage_count_as_storage_incidents() -> None:
    """The persistence interval's failure count (recovery/lifecycle.py): an incident the
    rings and buddies served does not count, one whose ranks read storage does, once."""
    finished = [
        ev.RestoreFinished(step=45, ok=True, storage_ranks=0),  # from memory and buddies
        ev.RestoreFinished(step=45, ok=False, storage_ranks=2),  # a failed attempt
        ev.RestoreFinished(step=40, ok=True, storage_ranks=2),  # its retry read storage
    ]
    s = statelib.initial("j")
    for i, f in enumerate(finished, 1):
        s = statelib.fold([ev.Event(seq=i, restore_finished=f)], s)
    assert s.goodput.storage_incidents == 1


def _timed(pairs: list[tuple[float, ev.Event]]) -> list[ev.Event]:
    for i, (w, e) in enumerate(pairs, 1):
        e.seq = i
        e.wall_time_unix_ns = T0 + int(w * S)
    return [e for _, e in pairs]


def _to(phase: int, **kw: object) -> ev.Event:
    return ev.Event(recovery_transition=ev.RecoveryTransition(to_phase=phase, **kw))  # type: ignore[arg-type]


def _hang_incident() -> list[ev.Event]:
    """Start-up 10 s; a hang declared at 100 s after 2 s without progress; stopping 1 s,
    a diagnosis 4 s, choosing the world 1 s, restoring 3 s; the ranks restored step 90
    while the plan said 80."""
    return _timed(
        [
            (0, ev.Event(job_started=ev.JobStarted(trainer="gpt3d", reports_startup=True))),
            (0, ev.Event(training_resumed=ev.TrainingResumed(at_step=0))),
            (10, ev.Event(training_stepping=ev.TrainingStepping(step=1))),
            (100, ev.Event(hang_suspected=ev.HangSuspected(node_id="n1", silent_ms=2000))),
            (100, _to(ev.PHASE_SUSPECTED, incident_id="i1", diagnose=True)),
            (101, ev.Event(training_paused=ev.TrainingPaused(at_step=95, restore_step=80))),
            (105, _to(ev.PHASE_DIAGNOSED)),
            (105, _to(ev.PHASE_RESHAPED)),
            (106, ev.Event(restore_started=ev.RestoreStarted(step=80))),
            (109, ev.Event(training_resumed=ev.TrainingResumed(at_step=90, planned_step=80))),
        ]
    )


def test_badput_categories_split_the_same_lost_time_as_the_causes() -> None:
    s = statelib.fold(_hang_incident(), statelib.initial("j"))
    g = s.goodput
    assert dict(g.lost_s_by_category) == {
        "startup": 10.0,
        "detection": 2.0,  # the hang's own silence before it was declared
        "pause": 1.0,
        "diagnosis": 4.0,
        "restart": 1.0,
        "restore": 3.0,
    }
    assert dict(g.lost_s_by_cause) == {"startup": 10.0, "hang_suspected": 11.0}
    assert g.steps_redone == 5  # from the step restored (90), not the plan's (80)
    gp = goodput(s, T0 + 200 * S, step_s=0.5)
    assert gp.lost_s_by_category["steps_redone"] == 2.5
    assert abs(sum(gp.lost_s_by_category.values()) - gp.lost_s) < 1e-9
    assert abs(gp.ratio - (200 - 23.5) / 200) < 1e-9


def test_checkpoint_save_and_data_loading_are_charged_from_the_time_that_trained() -> None:
    s = statelib.fold(_hang_incident(), statelib.initial("j"))
    live = LiveInputs(step_s=0.5, save_share=0.1, data_share=0.05)
    gp = goodput(s, T0 + 200 * S, 0.5, live)
    trained = 200 - 23.5  # the wall time less the incident, the start-up and the redone steps
    assert abs(gp.lost_s_by_category["checkpoint_save"] - 0.1 * trained) < 1e-9
    assert abs(gp.lost_s_by_category["data_loading"] - 0.05 * trained) < 1e-9
    assert gp.lost_s_by_cause["checkpoint_save"] == gp.lost_s_by_category["checkpoint_save"]
    assert abs(sum(gp.lost_s_by_category.values()) - gp.lost_s) < 1e-9
    assert abs(sum(gp.lost_s_by_cause.values()) - gp.lost_s) < 1e-9
    assert abs(gp.ratio - trained * 0.85 / 200) < 1e-9
    # without shares (a trainer that reports neither) nothing is charged for them
    assert "checkpoint_save" not in goodput(s, T0 + 200 * S, 0.5).lost_s_by_category


def test_the_agent_s_in_loop_shares_are_of_the_window_s_wall_time() -> None:
    # (wall ms since the report before, save ms, data ms): coalesced reports carry totals
    window = [(100.0, 10.0, 2.0), (200.0, 10.0, 6.0), (100.0, 0.0, 4.0)]
    save, data = in_step_shares(window)
    assert abs(save - 20 / 400) < 1e-12 and abs(data - 12 / 400) < 1e-12
    assert in_step_shares([]) == (0.0, 0.0)


def test_the_agent_reports_the_in_loop_shares_of_its_rank_s_reports(tmp_path: Path) -> None:
    w = Worker(0, 0, tmp_path / "worker-0.log")
    w.on_step(10, 1.0, 90.0, 100.0, timings_ms={"checkpoint_save": 8.0, "data_loading": 2.0})
    # two steps in one report (the SDK's coalescing): their means, 0.2 s after the first
    w.on_step(12, 1.0, 90.0, 100.2, timings_ms={"checkpoint_save": 5.0}, steps=2)
    w.on_step(13, 1.0, 90.0, 100.3, timings_ms={"data_loading": 4.0})
    s = w.status(100.3)
    assert abs(s.checkpoint_save_share - 10.0 / 300.0) < 1e-9  # the first report has no span
    assert abs(s.data_loading_share - 4.0 / 300.0) < 1e-9
    w.on_step(5, 1.0, 90.0, 101.0, timings_ms={"checkpoint_save": 500.0})  # restored back
    assert w.status(101.0).checkpoint_save_share == s.checkpoint_save_share


def test_an_open_start_up_and_an_open_incident_count_by_category_so_far() -> None:
    events = _hang_incident()
    starting = statelib.fold(events[:2], statelib.initial("j"))
    gp = goodput(starting, T0 + 4 * S, step_s=1.0)
    assert gp.lost_s_by_category == {"startup": 4.0} and gp.ratio == 0.0
    diagnosing = statelib.fold(events[:6], statelib.initial("j"))
    gp = goodput(diagnosing, T0 + 103 * S, step_s=1.0)
    assert gp.lost_s_by_category == {
        "startup": 10.0,
        "detection": 2.0,
        "pause": 1.0,
        "diagnosis": 2.0,
    }
    assert abs(sum(gp.lost_s_by_category.values()) - gp.lost_s) < 1e-9


def test_detection_is_bounded_by_the_time_since_training_restarted() -> None:
    """A rank silent for 300 s (a phase limit) right after a resume 5 s ago lost 5 s, not 300."""
    events = _timed(
        [
            (0, ev.Event(job_started=ev.JobStarted(trainer="gpt3d"))),
            (0, ev.Event(training_resumed=ev.TrainingResumed(at_step=0))),
            (50, ev.Event(worker_failed=ev.WorkerFailed(node_id="n1"))),
            (50, _to(ev.PHASE_SUSPECTED, incident_id="i1")),
            (60, ev.Event(training_resumed=ev.TrainingResumed(at_step=10))),
            (65, ev.Event(hang_suspected=ev.HangSuspected(node_id="n1", silent_ms=300_000))),
            (65, _to(ev.PHASE_SUSPECTED, incident_id="i2")),
        ]
    )
    g = statelib.fold(events, statelib.initial("j")).goodput
    assert g.lost_s_by_category["detection"] == 5.0
    assert "startup" not in g.lost_s_by_category  # no driver said it would report one


def test_a_crashed_worker_s_silence_is_detection_bounded_by_the_start_up() -> None:
    """A worker killed mid-step, its exit reported 1.2 s after its last step: that step in
    flight and the report's way are lost (detection), as a hang's silence is; a crash 3 s
    after the first step with a silence of 8 s (it began in start-up) is charged the 3 s,
    start-up keeps the rest."""

    def crash(at: float, silent_ms: float) -> list[tuple[float, ev.Event]]:
        """Start-up 10 s (its first step at 10 s), then a worker's exit at `at`."""
        return [
            (0, ev.Event(job_started=ev.JobStarted(trainer="gpt3d", reports_startup=True))),
            (0, ev.Event(training_resumed=ev.TrainingResumed(at_step=0))),
            (10, ev.Event(training_stepping=ev.TrainingStepping(step=1))),
            (at, ev.Event(worker_failed=ev.WorkerFailed(node_id="n1", silent_ms=silent_ms))),
            (at, _to(ev.PHASE_SUSPECTED, incident_id="i1")),
        ]

    events = _timed(
        [*crash(50, 1200), (53, ev.Event(training_resumed=ev.TrainingResumed(at_step=40)))]
    )
    g = statelib.fold(events, statelib.initial("j")).goodput
    assert g.lost_s_by_category["detection"] == pytest.approx(1.2)
    assert g.lost_s_by_cause["worker_failed"] == pytest.approx(4.2)
    early = _timed(crash(13, 8000))
    g = statelib.fold(early, statelib.initial("j")).goodput
    assert g.lost_s_by_category["detection"] == pytest.approx(3.0)
    assert g.lost_s_by_category["startup"] == 10.0
