"""The lines `unbroken up` and `unbroken status` print about checkpoints and persistence."""

from __future__ import annotations

import pytest

from unbroken.cli.status import persistence_line
from unbroken.cli.up import commits_line
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def _commit(step: int) -> ev.Event:
    return ev.Event(checkpoint_committed=ev.CheckpointCommitted(step=step))


def test_commits_line_tells_the_first_save_from_the_interval_ones() -> None:
    events = [
        _commit(1),  # before any incident: the job's first save
        ev.Event(training_paused=ev.TrainingPaused(at_step=20)),
        _commit(150),
        _commit(300),
    ]
    line = commits_line(events, 400)
    assert line.startswith("checkpoints committed: 3 in 400 steps (7.5 per 1,000)"), line
    assert "the job's first save and 2 on the persistence interval (5.0 per 1,000)" in line
    # a job restored from storage at its start commits no "first" save: all count
    assert "first save" not in commits_line([ev.Event(training_paused=ev.TrainingPaused()),
                                            _commit(9)], 100)  # fmt: skip


def test_persistence_line_names_the_interval_and_what_it_comes_from() -> None:
    st = dpb.GetStatusResponse(persist_every_s=93.2, persist_cost_s=0.05, storage_mtbf_s=86400)
    assert persistence_line(st) == (
        "every 93 s (Young/Daly: 0.050 s per checkpoint, storage-served MTBF 24.0 h)"
    )
    assert "--persist-every-s" in persistence_line(dpb.GetStatusResponse())
