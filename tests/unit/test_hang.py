"""The agent's hang rule (agent/hang.py): each rank's own rhythm, its phase, the stacks cap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken.agent import hang
from unbroken.agent.workers import Worker
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit

CFG = hang.HangConfig(floor_ms=1000.0, k=5.0, quantile=0.9, phase_limit_ms=60_000.0)


@pytest.mark.parametrize(
    ("steps", "phase", "want"),
    [
        ([100.0] * 10, "train", 1000.0),  # the floor wins over 5 x 100 ms
        ([100.0] * 10, "", 1000.0),  # no phase report: judged as training
        ([400.0] * 10, "train", 2000.0),  # 5 x p90 wins over the floor
        ([100.0] * 9 + [900.0] * 1, "train", 1000.0),  # one outlier is above p90 of 10
        ([100.0] * 8 + [900.0] * 2, "train", 4500.0),  # two are the p90
        ([100.0] * 10, "collective", 3000.0),  # waiting for a peer: a victim, judged later
        ([100.0] * 10, "restore", 60_000.0),  # a phase the worker announced: its own limit
        ([100.0] * 10, "checkpoint", 60_000.0),
        ([100.0] * 10, "eval", 60_000.0),
        ([100.0] * 2, "train", 60_000.0),  # the first steps after a (re)start: no rhythm yet
        ([], "train", 60_000.0),
    ],
)
def test_threshold_from_rhythm_and_phase(steps: list[float], phase: str, want: float) -> None:
    assert hang.threshold_ms(steps, phase, CFG) == pytest.approx(want)


@given(
    st.lists(st.floats(min_value=0.1, max_value=1e6), min_size=3, max_size=64),
    st.sampled_from(["", "train", "restore", "eval"]),
)
def test_threshold_is_never_below_the_floor_nor_above_the_phase_limit_for_phases(
    steps: list[float], phase: str
) -> None:
    t = hang.threshold_ms(steps, phase, CFG)
    assert t >= CFG.floor_ms
    if phase in ("restore", "eval"):
        assert t == CFG.phase_limit_ms
    elif phase == "collective":
        assert t >= CFG.collective_k * CFG.floor_ms
    else:
        assert t >= CFG.k * hang.quantile(steps, CFG.quantile) - 1e-9


def test_time_starved_of_cpu_is_not_silence() -> None:
    assert hang.is_hung(1500.0, 1000.0)
    assert not hang.is_hung(1500.0, 1000.0, starved_ms=600.0)  # waited 600 ms for a CPU
    assert hang.run_delay_ms(__import__("os").getpid()) >= 0.0
    assert hang.run_delay_ms(2**22 + 12345) == 0.0  # no such process


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="floor_ms"):
        hang.HangConfig(floor_ms=1)
    with pytest.raises(ValueError, match="k must"):
        hang.HangConfig(k=0.5)
    with pytest.raises(ValueError, match="phase_limit_ms"):
        hang.HangConfig(floor_ms=5000, phase_limit_ms=1000)


def test_stacks_are_capped_per_rank_keeping_the_innermost_frames() -> None:
    dumps = {0: "outer\n" + "a" * 10_000 + "\ninnermost", 1: "short"}
    text = hang.cap_stacks(dumps, limit=2000)
    assert len(text) <= 2000
    assert "--- local rank 0 ---" in text and "--- local rank 1 ---" in text
    assert "innermost" in text and "outer" not in text and "...[cut]" in text
    assert hang.cap_stacks({}) == ""
    assert "did not answer" in hang.cap_stacks({3: ""})


def _worker(tmp_path: object) -> Worker:
    w = Worker(1, 3, __import__("pathlib").Path(str(tmp_path)) / "w.log")
    w.state = dpb.WORKER_STATE_RUNNING
    return w


def test_worker_status_flags_a_rank_silent_past_its_rhythm(tmp_path: object) -> None:
    w = _worker(tmp_path)
    for i in range(1, 11):
        w.on_step(i, 1.0, 100.0, now=100.0 + i * 0.1, timings_ms={"compute": 80.0})
    t = 101.0  # the last step at 101.0
    assert not w.status(t + 0.9, CFG).hung
    s = w.status(t + 1.1, CFG)
    assert s.hung and s.hang_threshold_ms == 1000.0 and s.phase == "train"
    assert s.compute_ms == 80.0 and s.window_steps == 10
    w.on_phase("checkpoint", t + 1.2)  # a long phase the worker announced
    s = w.status(t + 5.0, CFG)
    assert not s.hung and s.phase == "checkpoint" and s.hang_threshold_ms == 60_000.0
    w.on_step(11, 1.0, 100.0, now=t + 6.0)  # a step ends the phase
    assert w.status(t + 6.5, CFG).phase == "train"


def test_a_run_queue_reading_that_went_down_is_no_silence(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU-starvation credit only ever shortens a silence: a reading below the one at the
    last progress (the process exited and /proc says 0, or another process took the rank at
    the same step) must not make a short silence a hang."""
    readings = iter([5000.0, 5000.0, 0.0, 0.0, 0.0])
    monkeypatch.setattr(hang, "run_delay_ms", lambda pid: next(readings))
    w = _worker(tmp_path)
    w.proc = SimpleNamespace(pid=2**22 + 12345, returncode=None)  # type: ignore[assignment]
    for i in range(1, 11):
        w.on_step(i, 1.0, 100.0, now=100.0 + i * 0.1, timings_ms={"compute": 80.0})
    t = 101.0  # the last step at 101.0; its rhythm allows 1 s of silence
    assert not w.status(t + 0.2, CFG).hung  # the reading at progress: 5 s of run-queue delay
    assert not w.status(t + 0.4, CFG).hung
    assert not w.status(t + 0.6, CFG).hung  # the reading fell to 0: not 5.6 s of silence
    assert not w.status(t + 0.9, CFG).hung
    assert w.status(t + 1.1, CFG).hung  # the silence itself still counts


def test_worker_status_says_the_step_restored_and_its_source(tmp_path: object) -> None:
    w = _worker(tmp_path)
    assert not w.status(100.0, CFG).HasField("restored_step")
    w.on_phase("train", 100.0, step=37, source="storage")
    w.on_phase("train", 101.0, step=40, source="memory")  # only the first says what it restored
    s = w.status(101.5, CFG)
    assert s.restored_step == 37 and s.restored_from == "storage"
    odd = _worker(tmp_path)
    odd.on_phase("train", 100.0, step=5, source="x" * 10_000)  # not a source: not passed on
    s = odd.status(100.5, CFG)
    assert s.restored_step == 5 and s.restored_from == ""


def test_worker_status_carries_its_recent_losses_median_and_mad(tmp_path: object) -> None:
    """A new leader's spike baseline: one finite loss per step of this process (a step
    reported twice counts once, NaN not at all), their median and MAD."""
    w = _worker(tmp_path)
    assert w.status(100.0, CFG).loss_window == 0
    for step, loss in [(1, 3.0), (2, 2.0), (2, 2.0), (3, float("nan")), (4, 4.0), (5, 2.5)]:
        w.on_step(step, loss, 50.0, 100.0 + step)
    s = w.status(106.0, CFG)
    # 2, 2.5, 3, 4: the upper median 3; deviations 0, 0.5, 1, 1
    assert (s.loss_window, s.loss_median, s.loss_mad) == (4, 3.0, 0.75)


def test_a_script_without_step_reports_is_never_judged(tmp_path: object) -> None:
    w = _worker(tmp_path)
    assert not w.status(w.last_progress + 1e6, CFG).hung


FRAMES = '  File "/venv/torch/nn/module.py", line 1 in _call_impl\n' * 200
DUMP = """--- local rank 0 ---
Current thread 0x00007fdac9011b80 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/worker.py", line 16 in <module>
--- local rank 1 ---
(process stopped: SIGSTOP)
Current thread 0x00007fdac9011b81 (most recent call first):
  File "/tmp/worker.py", line 13 in <module>"""


def test_events_cli_abbreviates_the_stacks_to_each_ranks_innermost_frame() -> None:
    from unbroken.cli.events import summary
    from unbroken.proto import events_pb2 as ev

    e = ev.Event(
        hang_suspected=ev.HangSuspected(
            node_id="n0",
            local_rank=1,
            stack_dump=DUMP.replace("--- local rank 1", FRAMES + "--- local rank 1"),
        )
    )
    line = summary(e)
    assert "r0 all_reduce (distributed_c10d.py:3252) | r1 stopped <module> (worker.py:13)" in line
    assert "--json for all" in line and "c10d_logger" not in line and len(line) < 400
