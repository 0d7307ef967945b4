"""The lines `unbroken up` and `unbroken status` print about checkpoints and persistence."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest
from rich.console import Console

from unbroken.cli.drill import FaultRecord, fault_table, judge_load, rank0_restores
from unbroken.cli.events import line
from unbroken.cli.status import persistence_line
from unbroken.cli.up import _render, commits_line, drill_verdict, trained_step
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


# ---------------------------------------------------------------- the drill's terminal output
def _drilled() -> list[FaultRecord]:
    done = FaultRecord(
        "worker SIGKILL", "node-1 rank 3", 0.0, "worker_failed", recovers=True,
        detected_s=0.41, resumed_s=9.87, steps_lost=2, event_seq=120, events_written=14,
        loss_before=3.21, loss_after=3.19, resumed_step=40, note="restored from memory",
    )  # fmt: skip
    skipped = FaultRecord(
        "straggler 1.05x", "node-0", 0.0, "straggler_suspected", skipped=True,
        note="this host is too busy to judge a 5 % slowdown (load 5.2 on 2 cores)",
    )  # fmt: skip
    return [done, skipped]


def test_the_drill_table_fits_80_columns_and_keeps_every_fault() -> None:
    console = Console(width=80, record=True, force_terminal=False)
    console.print(fault_table(_drilled(), 80))
    text = console.export_text()
    assert max(len(x) for x in text.splitlines()) <= 80, text
    for phrase in ("worker SIGKILL", "straggler", "0.41 s", "9.87 s", "skipped"):
        assert phrase in text, (phrase, text)
    wide = Console(width=160, record=True)
    wide.print(fault_table(_drilled(), 160))
    assert "loss continued" in wide.export_text()


def test_a_drill_without_notes_gives_its_width_to_the_other_columns() -> None:
    (done, _) = _drilled()
    done.note = ""
    console = Console(width=160, record=True, force_terminal=False)
    console.print(fault_table([done], 160))
    text = console.export_text()
    assert "note" not in text and "worker_failed (120)" in text, text


def _header(table: str) -> str:
    return next(x for x in table.splitlines() if "fault" in x and "target" in x)


def test_notes_the_wide_table_has_no_room_for_follow_it_whole() -> None:
    """At 160 columns the wide table's other columns left the notes no width: `make run`'s
    log showed none. They follow the table then, one line per fault."""
    (done, skipped) = _drilled()
    done.fault = "silently bad node (wrong matmul)"  # the drill's widest cells
    done.target, done.expect = "spare-1 pid 2314", "self_check_reported"
    done.note = "rollback to the newest step before it every rank holds (ring, else a commit)"
    console = Console(width=160, record=True, force_terminal=False)
    console.print(fault_table([done, skipped], 160))
    text = console.export_text()
    assert max(len(x) for x in text.splitlines()) <= 160, text
    assert "note" not in _header(text), text  # no column for them
    assert f"silently bad node (wrong matmul): {done.note}" in text, text
    assert "straggler 1.05x: skipped: this host is too busy" in text, text
    wider = Console(width=260, record=True, force_terminal=False)
    wider.print(fault_table([done, skipped], 260))
    assert "note" in _header(wider.export_text())  # room enough: a column again


def test_the_live_view_fits_80_by_24() -> None:
    class Watch:  # what _render reads of a LogWatch
        leader = "driver-a"
        nodes: ClassVar[list[object]] = []
        events: ClassVar[list[ev.Event]] = [
            ev.Event(seq=i, worker_failed=ev.WorkerFailed(node_id="node-1", exit_code=-9))
            for i in range(1, 40)
        ]

    console = Console(width=80, height=24, record=True)
    console.print(_render(Watch(), _drilled(), 12.0, 80, 24))  # type: ignore[arg-type]
    text = console.export_text()
    assert len(text.splitlines()) <= 24, text
    assert max(len(x) for x in text.splitlines()) <= 80, text


def test_events_are_short_human_lines() -> None:
    t = ev.Event(
        seq=43,
        recovery_transition=ev.RecoveryTransition(
            from_phase=ev.PHASE_RUNNING, to_phase=ev.PHASE_SUSPECTED, incident_id="i43",
            reason="worker node-1/1 exited with -9 at step 123",
        ),
    )  # fmt: skip
    assert line(t) == "   43 running -> suspected i43: worker node-1/1 exited with -9 at step 123"
    spike = ev.Event(seq=7, loss_spike=ev.LossSpike(step=3, loss=9.3, baseline=2.1, factor=6))
    assert line(spike) == "    7 loss_spike step=3 loss=9.3 baseline=2.1 factor=6"  # no 9.30000019
    long = ev.Event(seq=8, log_alert=ev.LogAlert(node_id="n" * 200))
    assert len(line(long)) == 80 and line(long).endswith("…")


def test_a_fault_given_up_on_an_overloaded_host_is_not_judged_and_the_verdict_says_why() -> None:
    busy = FaultRecord(
        "node lost", "node-1", 0.0, "node_lost", recovers=True, detected_s=0.2,
        given_up=True, load_peak=45.0, note="training did not resume within 120 s",
    )  # fmt: skip
    quiet = FaultRecord(
        "hang", "node-0", 0.0, "hang_suspected", recovers=True, given_up=True,
        load_peak=3.0, note="no hang_suspected within 60 s",
    )  # fmt: skip
    judge_load(busy, cores=2, load=1.0)  # its peak, while it was open, counts
    judge_load(quiet, cores=2, load=1.0)
    assert busy.unjudged and busy.note.startswith("not judged: load 45 on 2 cores")
    assert not quiet.unjudged  # a quiet host's miss is a failure
    verdict = drill_verdict([busy, quiet], 1, 480.0, 130.0, 0.0)
    assert "1 fault(s) not detected or not recovered" in verdict
    assert "1 not judged: this host's load average reached 45 on " in verdict
    assert "first step after 130 s" in verdict
    console = Console(width=80, record=True, force_terminal=False)
    console.print(fault_table([busy, quiet], 80))
    text = console.export_text()
    assert "not judged" in text and max(len(x) for x in text.splitlines()) <= 80


def test_rank0_restores_are_ordered_by_their_own_time_not_their_files(tmp_path: Path) -> None:
    """node-1 was rank 0 (restored step 10), left, and came back as ranks 2-3: its
    worker-0.log is written to last, yet its rank-0 line is the oldest. Ordering by file
    mtime made the drill say 50 steps were lost where the log said 0."""
    line = "{t} [info     ] flash.restored  broadcast_from=None rank={r} read=True step={s}\n"
    a = tmp_path / "workers" / "spare-0"
    b = tmp_path / "workers" / "node-1"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (a / "worker-0.log").write_text(
        line.format(t="2026-11-29 16:13:50", r=0, s=19)
        + line.format(t="2026-11-29 16:14:34", r=0, s=60)
    )
    (b / "worker-0.log").write_text(
        line.format(t="2026-11-29 16:13:32", r=0, s=10)
        + line.format(t="2026-11-29 16:14:34", r=2, s=60)
    )
    assert rank0_restores(tmp_path) == [10, 19, 60]


def test_the_trained_step_is_the_jobs_end_when_the_live_view_missed_the_last_report() -> None:
    done = ev.Event(seq=12, job_finished=ev.JobFinished(step=30, ok=True))
    assert trained_step(29, [ev.Event(seq=1), done]) == 30
    assert trained_step(29, [ev.Event(seq=1)]) == 29
    assert trained_step(0, []) == 0


def test_a_workers_lines_carry_microseconds_and_the_drill_reads_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Workers log structlog's default lines with the time to the microsecond (whole seconds
    could not order a recovery's worker lines against its agent's); the drill still finds
    rank 0's restores in them."""
    import structlog

    from unbroken.cli.drill import RESTORED
    from unbroken.common.logsetup import setup_worker_logging

    try:
        setup_worker_logging()
        structlog.get_logger("w").info("flash.restored", rank=0, read=True, step=7)
        structlog.get_logger("w").debug("flash.saved", step=8)  # below INFO: not shown
    finally:
        structlog.reset_defaults()
    out = capsys.readouterr().out
    (line,) = out.splitlines()
    m = RESTORED.search(line)
    assert m is not None and m.group(2) == "7", line
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}Z", m.group(1)), line
