"""The goodput ledger folded from the log, and the figure computed from it."""

from __future__ import annotations

import pytest

from unbroken.driver import state as statelib
from unbroken.driver.goodput import goodput
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
