"""The pure pieces of live loss spikes: the driver's loss watch, the worker's restore point
and fault file (trainer/run.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from unbroken.common.faults import WorkerFault
from unbroken.driver.detectors import LossWatch
from unbroken.driver.liveview import LiveView, LiveViewConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.recovery.spike import SpikeConfig
from unbroken.trainer.run import FaultFile, RestorePoint

pytestmark = pytest.mark.unit

CFG = SpikeConfig(window=20, min_history=5, factor=6.0)


def _beat(
    view: LiveView,
    node: str,
    step: int,
    loss: float,
    *,
    rank: int,
    restarts: int = 0,
    recent: tuple[float, float, int] = (0.0, 0.0, 0),
) -> None:
    slot = view.slot(node)
    view.mark_alive(slot, 0.0)
    w = dpb.WorkerStatus(
        global_rank=rank, step=step, loss=loss, has_loss=True, restarts=restarts,
        state=dpb.WORKER_STATE_RUNNING, loss_median=recent[0], loss_mad=recent[1],
        loss_window=recent[2],
    )  # fmt: skip
    view.beat(slot, dpb.Heartbeat(workers=[w]), 0.0)


def test_one_loss_per_step_from_the_lowest_rank_and_a_spike_is_an_event() -> None:
    view, watch = LiveView(LiveViewConfig()), LossWatch(CFG)
    world = ["n0", "n1"]
    for step in range(1, 11):
        _beat(view, "n1", step, 99.0, rank=1)  # a higher rank's loss is not the job's
        _beat(view, "n0", step, 3.0 + 0.01 * (step % 3), rank=0)
        assert watch.sweep(view, world) is None
        assert watch.sweep(view, world) is None  # the same step again: not fed twice
    assert len(watch.detector._window) == 10
    _beat(view, "n0", 11, 30.0, rank=0)
    e = watch.sweep(view, world)
    assert e is not None and e.loss_spike.step == 11 and not e.loss_spike.non_finite
    assert e.loss_spike.baseline == pytest.approx(3.01, abs=0.02)
    # a restore goes back to a lower step: the new timeline is fed, the spike is not baseline
    _beat(view, "n0", 9, 3.02, rank=0, restarts=1)
    assert watch.sweep(view, world) is None
    assert 30.0 not in watch.detector._window


def test_a_new_leader_judges_a_spike_against_the_ranks_own_recent_losses() -> None:
    """The watch lives in the leader's memory: after a failover it starts empty. The rank's
    agent reports its recent losses' median and MAD, so a spike in the new leader's first
    heartbeats is an event (bench-recovery: one 0.1-0.4 s after the agents re-registered
    went unseen); without them the first losses only build a baseline."""
    view, watch = LiveView(LiveViewConfig()), LossWatch(CFG)
    _beat(view, "n0", 3852, 1.5, rank=0, recent=(1.48, 0.05, 100))
    assert watch.sweep(view, ["n0"]) is None
    _beat(view, "n0", 3854, 20.9, rank=0, recent=(1.49, 0.05, 100))
    e = watch.sweep(view, ["n0"])
    assert e is not None and e.loss_spike.step == 3854
    assert e.loss_spike.baseline == pytest.approx(1.49)
    blind = LossWatch(CFG)
    _beat(view, "n0", 3855, 1.5, rank=0)
    assert blind.sweep(view, ["n0"]) is None
    _beat(view, "n0", 3856, 20.9, rank=0)
    assert blind.sweep(view, ["n0"]) is None


def test_a_non_finite_loss_is_a_spike_even_without_history() -> None:
    view, watch = LiveView(LiveViewConfig()), LossWatch(CFG)
    _beat(view, "n0", 1, math.nan, rank=0)
    e = watch.sweep(view, ["n0"])
    assert e is not None and e.loss_spike.non_finite


def test_nodes_outside_the_world_and_lost_nodes_are_not_read() -> None:
    view, watch = LiveView(LiveViewConfig()), LossWatch(CFG)
    _beat(view, "spare", 1, math.nan, rank=0)
    assert watch.sweep(view, ["n0"]) is None
    _beat(view, "n0", 1, math.nan, rank=0)
    view.mark_lost(view.slot("n0"))
    assert watch.sweep(view, ["n0"]) is None


def test_restore_point_from_env() -> None:
    assert RestorePoint.from_env({}) == RestorePoint()
    p = RestorePoint.from_env({"UNBROKEN_RESTORE_STEP": "40", "UNBROKEN_SKIP_BATCHES": "42:200"})
    assert (p.step, p.skip_from_step, p.skip_batches) == (40, 42, 200)
    with pytest.raises(ValueError, match="UNBROKEN_SKIP_BATCHES"):
        RestorePoint.from_env({"UNBROKEN_SKIP_BATCHES": "200"})
    with pytest.raises(ValueError, match="UNBROKEN_RESTORE_STEP"):
        RestorePoint.from_env({"UNBROKEN_RESTORE_STEP": "-1"})


def test_fault_parse_names_what_is_wrong() -> None:
    assert WorkerFault.parse('{"kind": "nan", "step": 3, "id": "x"}') == WorkerFault("nan", 3, "x")
    for text, what in (
        ("nope", "not JSON"),
        ('{"kind": "melt", "step": 1, "id": "x"}', "kind"),
        ('{"kind": "nan", "step": -2, "id": "x"}', "step"),
        ('{"kind": "nan", "step": 1}', "id"),
    ):
        with pytest.raises(ValueError, match=what):
            WorkerFault.parse(text)


def test_fault_file_applies_each_id_once_also_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "fault.json"
    ff = FaultFile(path=path, rank=0)
    assert ff.due(1) is None  # no file yet
    path.write_text(json.dumps({"kind": "loss-spike", "step": 5, "id": "a"}))
    assert ff.due(4) is None
    f = ff.due(5)
    assert f is not None and f.kind == "loss-spike"
    assert ff.due(6) is None
    assert FaultFile(path=path, rank=0).due(5) is None  # a restarted worker: applied already
    assert FaultFile(path=path, rank=1).due(5) is not None  # another rank applies its own
    path.write_text(json.dumps({"kind": "nan", "step": 0, "id": "b"}))  # step 0: the next
    f = ff.due(9)
    assert f is not None and f.kind == "nan" and f.id == "b"


def test_a_spike_between_heartbeats_is_seen_through_the_peak() -> None:
    """Steps faster than heartbeats: the spiking step is not the newest one any more."""
    view, watch = LiveView(LiveViewConfig()), LossWatch(CFG)
    for step in range(1, 11):
        _beat(view, "n0", step, 3.0 + 0.01 * (step % 3), rank=0)
        assert watch.sweep(view, ["n0"]) is None
    slot = view.slot("n0")
    w = dpb.WorkerStatus(
        global_rank=0, step=14, loss=3.01, has_loss=True, state=dpb.WORKER_STATE_RUNNING,
        has_peak=True, peak_loss=30.0, peak_step=12,
    )  # fmt: skip
    view.beat(slot, dpb.Heartbeat(workers=[w]), 0.0)
    e = watch.sweep(view, ["n0"])
    assert e is not None and e.loss_spike.step == 12 and e.loss_spike.loss == 30.0


def test_a_peak_in_a_heartbeat_overwritten_unseen_arrives_with_the_next_and_counts_once() -> None:
    """Two heartbeats between two sweeps: the first's peak is repeated in the second (the
    agent's PEAK_BEATS), so the spike is still seen; repeats are not fed twice."""
    view, watch = LiveView(LiveViewConfig()), LossWatch(CFG)
    for step in range(1, 11):
        _beat(view, "n0", step, 3.0 + 0.01 * (step % 3), rank=0)
        assert watch.sweep(view, ["n0"]) is None
    slot = view.slot("n0")

    def beat(step: int, peak: tuple[int, float]) -> None:
        w = dpb.WorkerStatus(
            global_rank=0, step=step, loss=3.01, has_loss=True, state=dpb.WORKER_STATE_RUNNING,
            has_peak=True, peak_step=peak[0], peak_loss=peak[1],
        )  # fmt: skip
        view.beat(slot, dpb.Heartbeat(workers=[w]), 0.0)

    beat(12, (11, 3.02))  # never swept: overwritten by the next heartbeat
    beat(14, (11, 3.02))  # a flat window: its peak is the same old one
    assert watch.sweep(view, ["n0"]) is None
    fed = len(watch.detector._window)
    beat(16, (11, 3.02))  # repeated: not fed again
    assert watch.sweep(view, ["n0"]) is None
    assert len(watch.detector._window) == fed + 1  # step 16 only
    beat(18, (17, 30.0))  # overwritten unseen...
    beat(20, (17, 30.0))  # ...but repeated
    e = watch.sweep(view, ["n0"])
    assert e is not None and e.loss_spike.step == 17 and e.loss_spike.loss == 30.0


def test_the_agent_reports_each_heartbeat_s_peak_once() -> None:
    from unbroken.agent.workers import PEAK_BEATS, Worker

    w = Worker(0, 0, Path("/nonexistent/worker-0.log"))
    for step, loss in ((1, 3.0), (2, 9.0), (3, 3.1)):
        w.on_step(step, loss, 10.0, 0.0)
    s = w.status(0.0)
    assert (s.step, s.loss, s.has_peak, s.peak_step, s.peak_loss) == (3, 3.1, True, 2, 9.0)
    # repeated in the next heartbeats (the driver may overwrite one unseen), then dropped
    for _ in range(PEAK_BEATS - 1):
        s = w.status(0.0)
        assert (s.has_peak, s.peak_step) == (True, 2)
    assert not w.status(0.0).has_peak
    w.on_step(4, math.nan, 10.0, 0.0)
    w.on_step(5, 3.0, 10.0, 0.0)
    s = w.status(0.0)
    assert s.peak_step == 4 and math.isnan(s.peak_loss)  # a non-finite loss wins
    w.on_step(6, 50.0, 10.0, 0.0)
    s = w.status(0.0)
    assert s.peak_step == 4 and math.isnan(s.peak_loss)  # still, within PEAK_BEATS


def test_a_report_standing_for_several_steps_brings_their_peak() -> None:
    from unbroken.agent.workers import Worker

    w = Worker(0, 0, Path("/nonexistent/worker-0.log"))
    w.on_step(10, 3.0, 1.0, 0.0, peak=(9.0, 7))  # the SDK's coalesced report of steps 6-10
    s = w.status(0.0)
    assert (s.step, s.loss, s.peak_step, s.peak_loss) == (10, 3.0, 7, 9.0)
    w.on_step(11, 3.0, 1.0, 0.0, peak=(3.0, 11))
    w.on_step(12, 2.0, 1.0, 0.0, peak=(math.inf, 12))
    s = w.status(0.0)
    assert s.peak_step == 12 and math.isinf(s.peak_loss)


@pytest.mark.parametrize("rejoined", [False, True])
def test_a_restore_far_back_in_the_same_process_starts_a_new_baseline_on_both_sides(
    tmp_path: Path, rejoined: bool
) -> None:
    """An in-job restore far back (an older commit) keeps the worker's process, so its
    agent kept the loss window of the later training, and the driver, which learns the curve
    again after such a restore, took it as the baseline: every restored loss was a spike,
    restore after restore (bench-recovery, the replica mode: step 1 restored, 5.4 against
    2.3). The agent's window now starts again too, also when the in-job rejoin had set the
    worker's step to 0 (agent/injob.py; a side-by-side CI run, 2026-12-05: an SDC rollback
    from step 96 to 5, then step 6 called a spike against 2.92 and 200 batches skipped)."""
    from unbroken.agent.workers import Worker

    w = Worker(0, 0, tmp_path / "w.log")
    view, watch = LiveView(LiveViewConfig()), LossWatch(CFG)
    for step in range(1, 101):
        w.on_step(step, 2.3 + 0.01 * (step % 3), 50.0, now=float(step))
        _beat(
            view,
            "n0",
            step,
            w.loss,
            rank=0,
            recent=(w.status(float(step)).loss_median, 0.01, len(w.losses)),
        )
        assert watch.sweep(view, ["n0"]) is None
    if rejoined:
        w.step = 0  # what the agent's in-job rejoin does (the process is kept)
    for i, step in enumerate(range(2, 12)):  # restored step 1: the fresh model's losses
        w.on_step(step, 5.4 - 0.01 * i, 50.0, now=200.0 + i)
        st = w.status(200.0 + i)
        assert st.loss_window == i + 1  # the later training's losses are gone
        _beat(
            view, "n0", step, st.loss, rank=0, recent=(st.loss_median, st.loss_mad, st.loss_window)
        )
        assert watch.sweep(view, ["n0"]) is None, step


def test_fault_marks_follow_the_local_rank_not_the_global_one(tmp_path: Path) -> None:
    """A world that shrank gives the node's worker another global rank: the fault it applied
    as global rank 1 stays applied for it as global rank 0 (same LOCAL_RANK, same node)."""
    path = tmp_path / "fault.json"
    path.write_text(json.dumps({"kind": "loss-spike", "step": 5, "id": "a"}))
    env = {"UNBROKEN_FAULT_FILE": str(path), "LOCAL_RANK": "0"}
    before = FaultFile.from_env(1, env)
    assert before is not None and before.due(5) is not None
    after = FaultFile.from_env(0, env)  # restarted into a smaller world as global rank 0
    assert after is not None and after.due(3174) is None


def test_the_watched_nodes_heartbeat_wakes_the_watch() -> None:
    """The driver sweeps the loss curve when the node it reads heartbeats (an agent beats
    at once on a loss that stands out), not up to a whole interval later."""
    import asyncio

    async def run() -> None:
        view = LiveView(LiveViewConfig())
        watch = LossWatch(CFG)
        _beat(view, "n1", 1, 4.0, rank=1)
        _beat(view, "n0", 1, 4.0, rank=0)
        watch.sweep(view, ["n0", "n1"])
        assert watch.node == "n0"  # the lowest rank's node
        view.loss_node, view.loss_beat = watch.node, asyncio.Event()
        _beat(view, "n1", 2, 4.0, rank=1)
        assert not view.loss_beat.is_set()
        _beat(view, "n0", 2, 4.0, rank=0)
        assert view.loss_beat.is_set()

    asyncio.run(run())


def test_a_heartbeat_ends_a_wait_for_the_next_one() -> None:
    """`LiveView.next_beat` returns at the next heartbeat of any node (a restore's end is
    seen when its last rank's first step lands, not at a poll), else at its limit."""
    import asyncio
    import time

    async def run() -> None:
        view = LiveView(LiveViewConfig())
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: _beat(view, "n0", 1, 4.0, rank=0))
        t0 = time.monotonic()
        await view.next_beat(60.0)
        assert time.monotonic() - t0 < 30.0  # the beat woke it, the limit did not
        assert view.nodes["n0"].hb.workers[0].step == 1
        t0 = time.monotonic()
        await view.next_beat(0.05)  # nothing beats
        assert time.monotonic() - t0 >= 0.04

    asyncio.run(run())
