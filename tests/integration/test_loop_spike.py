"""A loss spike from live losses is rolled back end to end by the driver's recovery loop.

`unbroken driver --nodes 2 --dp 2` runs the tiny trainer on two `unbroken agent --no-start`
processes (tests/integration/test_recovery_loop.py's `Job`). Once the loss curve has
settled, `InjectFault loss-spike` (the operator RPC) makes each agent write its workers'
fault file for one step: that step's batch targets are poisoned, the loss really spikes and
the bad update is applied (`nan`, a slow variant: the forward turns non-finite, the model
is spoiled). Nothing else is sent by the test:

- the driver's loss watch (detectors.LossWatch over the heartbeats) appends LossSpike;
- the machine appends Rollback to the newest committed step before the spike, pauses,
  and restarts the world with a RestorePoint (UNBROKEN_RESTORE_STEP / _SKIP_BATCHES);
- every worker restores exactly that step (from storage or flash memory), discards the
  dead timeline, skips the poisoned batches and trains on; the fault is not applied twice.

Persistence runs at every step and the driver keeps only 2 committed steps, so by the time
the workers stop, 3 or more steps after the rollback target are committed: the target
survives because retention is the driver's, decided from the log (it never deletes the
rollback target). The losses after the rollback equal, exactly, those of a reference run
that never saw the skipped batches (two plain processes with UNBROKEN_SKIP_BATCHES).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from statistics import median

import psutil
import pytest

from tests.integration.trainenv import plain_worker_env
from tests.jobs import TRAIN, Job, inject
from unbroken.cli.cluster import until
from unbroken.diagnostics.check import free_port
from unbroken.recovery.persist import list_persisted

pytestmark = pytest.mark.integration

# steps before the spike: the baseline needs the early descent behind it. At 30 the window
# still held the descent's first dozen losses (5.5 to 4.1), which put its median near 3.5
# and its spread high: the instant-spike bar (2.5x that median) moved between 8.3 and 9.1
# with the steps the heartbeats sampled, against a poisoned batch's 9.11 at step 35, and a
# CI run once saw no spike. At 60 the spike is 3.5x the median.
SETTLED = 60
# steps between the injection and the poisoned step: both nodes must see their fault file
# before it, or each poisons its half of the batch at its own step and neither half-spike
# (1.7x) is a spike. Under a CPU hog, 4 steps (0.3 s) were once too few for the second node.
LEAD = 15
JOB_STEPS = 100_000  # the job's --steps (its cosine schedule spans them)
KEEP = 2  # committed steps the driver keeps: fewer than are committed after the target
# agents: persist every copy after calibrating; a ring of 2 copies, so the rollback target is
# a committed step read back from storage (tests/unit/test_machine.py covers memory targets)
EVERY_STEP = ("--persist-every-s", "0.001", "--flash-copies", "2")


def timeline(metrics: Path) -> list[tuple[int, float]]:
    """Rank 0's (step, loss) lines in the order they were written (both timelines)."""
    out = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        out.append((int(m["step"]), float(m["loss"])))
    return out


@pytest.mark.timeout(900)  # the cluster, then a reference run of the same training
@pytest.mark.parametrize(
    "kind", ["loss-spike", pytest.param("nan", marks=pytest.mark.slow, id="nan")]
)
def test_live_loss_spike_rolls_back_restores_the_committed_step_and_skips(
    job: Job, kind: str
) -> None:
    job.start_driver(
        "--keep-checkpoints", str(KEEP), "--persist-floor-s", "0.001", "--persist-ceiling-s",
        "0.001",
    )  # fmt: skip
    job.start_agent("n0", buddy="n1", extra=EVERY_STEP)
    job.start_agent("n1", buddy="n0", extra=EVERY_STEP)
    until(lambda: job.max_step() >= SETTLED, 180, "the loss curve to settle", job)

    at = job.max_step() + LEAD
    for node in ("n0", "n1"):  # both dp ranks' batches: the all-reduced loss spikes
        inject(job.address, node, kind, step=at)

    def resumed_after_rollback() -> bool:
        kinds = [e.WhichOneof("payload") for e in job.events()]
        return "rollback" in kinds and "training_resumed" in kinds[kinds.index("rollback") :]

    until(resumed_after_rollback, 150, "the rollback's resume", job)
    until(lambda: job.max_step() >= at + 6, 120, "training past the spike again", job)

    events = job.events()
    spike = next(e.loss_spike for e in events if e.HasField("loss_spike"))
    rollback = next(e.rollback for e in events if e.HasField("rollback"))
    # The fault hits step `at`, or the first step after the worker saw the file when
    # training had already passed `at` (fast steps), on each node on its own. The driver
    # watches rank 0's loss: it spikes at its own node's step, or (NaN) one step after the
    # other node's, whose NaN gradients the all-reduce spread.
    applied = {}
    for node in ("n0", "n1"):
        steps = [int(m) for m in re.findall(r"fault applied.*?step=(\d+)", job.worker_log(node))]
        assert steps and steps[0] >= at, (node, steps, at)
        applied[node] = steps[0]
    k = next(k for k, e in enumerate(events) if e.HasField("loss_spike"))
    first_node = next(
        getattr(e, e.WhichOneof("payload")).world.node_ids[0]
        for e in reversed(events[:k])
        if e.WhichOneof("payload") in ("job_started", "training_resumed")
    )
    other = "n1" if first_node == "n0" else "n0"
    at = applied[first_node]
    if kind == "nan":
        at = min(at, applied[other] + 1)
    assert spike.step == at and spike.non_finite == (kind == "nan"), (spike, applied, first_node)
    assert kind == "nan" or spike.loss > 1.5 * spike.baseline, spike
    committed = [e.checkpoint_committed.step for e in events if e.HasField("checkpoint_committed")]
    assert rollback.from_step == at
    assert rollback.to_step < at, (rollback, at)
    assert rollback.skip_batches > 0
    i = next(i for i, e in enumerate(events) if e.HasField("rollback"))
    # The target is a committed step or, when the spike came before the newest save's
    # commit (a slow machine), a step every rank held in its ring then.
    assert rollback.to_step in committed or rollback.to_step in spike.memory_steps, (
        rollback, committed, spike,
    )  # fmt: skip
    after = events[i:]
    paused = next(e.training_paused for e in after if e.HasField("training_paused"))
    started = next(e.restore_started for e in after if e.HasField("restore_started"))
    resumed = next(e.training_resumed for e in after if e.HasField("training_resumed"))
    # The pause fixes the step restored: the target itself while some copy of it is left,
    # else the newest committed step before it (the ranks trained on until they stopped,
    # and a ring of two copies has overwritten a memory target).
    j = i + next(k for k, e in enumerate(after) if e.HasField("training_paused"))
    committed_then = {
        e.checkpoint_committed.step for e in events[:j] if e.HasField("checkpoint_committed")
    }
    target = paused.restore_step
    from_storage = target in committed_then
    assert target == rollback.to_step or (from_storage and target < rollback.to_step), (
        paused, rollback, committed,
    )  # fmt: skip
    assert started.step == resumed.at_step == target, (started, resumed, target)
    assert set(started.source_by_rank.values()) == {"storage" if from_storage else "memory"}
    assert [e.loss_spike.step for e in events if e.HasField("loss_spike")] == [at]
    if from_storage:
        # Retention is the driver's, from the log: storage still held the target when the
        # restore read it, although the agents had persisted steps after it (the spike's
        # dead timeline) and retention (KEEP committed steps) has deleted older commits.
        agent_log = (job.tmp / "n0.log").read_text(errors="replace")
        persisted = re.findall(r"persist\.done.*?step=(\d+)", agent_log)
        assert {int(m) for m in persisted if int(m) > target}, agent_log[-3000:]
        stored = sorted(list_persisted(str(job.tmp / "storage")))
        old_commits = [c for c in committed if c < target]
        assert target in stored, stored
        assert len([c for c in old_commits if c in stored]) < len(old_commits), (stored, committed)

    # Every worker restored exactly that step and skipped the batches; the driver's
    # RestoreFinished counts the ranks whose state came from storage, as they said it.
    read_storage = 0
    for node in ("n0", "n1"):
        text = job.worker_log(node)
        restored = [int(m) for m in re.findall(r"flash\.restored.*?step=(\d+)", text)]
        assert restored and restored[-1] == target, (node, restored, text[-3000:])
        source = re.findall(r"flash\.restored.*?source=(\w+)", text)[-1]
        read_storage += source == "storage"
        assert "batches skipped" in text, text[-3000:]
        assert text.count("fault applied") == 1, text[-3000:]  # not again after the restart
    logs = [job.worker_log(n) for n in ("n0", "n1")]
    held = all("held after the spike" in text for text in logs)
    # A rank still short of its boundary when the agent's hold came (its peer reported the
    # spike first, and the driver and agent answered before this rank, on a loaded host,
    # got through its optimizer step and save) cannot tell that from a collective: its guard
    # shuts its gloo world down, and the world is left (in-job recovery) rather than kept.
    severed = any("shut this rank's gloo world down" in text for text in logs)
    if held and not severed:
        # every rank was held at the spiked step, outside any collective: the world was
        # kept (trainer/keepworld.py), no process group or trainer made again
        for node in ("n0", "n1"):
            assert "keeping the world" in job.worker_log(node), job.worker_log(node)[-3000:]

    finished = next(e.restore_finished for e in after if e.HasField("restore_finished"))
    assert finished.ok and finished.storage_ranks == read_storage, (finished, read_storage)

    # The loss curve continues: after the rollback no step spikes, and the losses are in
    # the band of those just before the spike.
    curve = timeline(job.metrics)
    first = next(k for k, (s, _) in enumerate(curve) if s == at)
    # the new timeline: from the first step trained after the restore (the dead one may
    # have gone on a step past the spike before the pause)
    again = next(k for k in range(first + 1, len(curve)) if curve[k][0] == target + 1)
    before = [loss for s, loss in curve[:first] if s > SETTLED - 10]
    resumed_curve = [loss for s, loss in curve[again:] if s > rollback.to_step]
    assert resumed_curve, curve[-10:]
    base = median(before)
    spiked = curve[first][1]
    assert math.isnan(spiked) if kind == "nan" else spiked > 1.5 * base, (curve[first], base)
    assert all(0.5 * base < loss < 1.3 * base for loss in resumed_curve), (base, resumed_curve)

    # Exactly the losses of a run that never saw the skipped batches.
    # (the cluster is stopped first: the reference gets the machine to itself)
    last = min(job.max_step(), rollback.to_step + 8)
    job.close()
    want = reference_with_skip(job.tmp, last, f"{rollback.skip_from_step}:{rollback.skip_batches}")
    got = {s: loss for s, loss in curve[again:] if s > rollback.to_step}
    assert got and all(got[s] == want[s] for s in got if s in want), (got, want)
    assert len([s for s in got if s in want]) >= 5, (got, want)


def reference_with_skip(tmp: Path, steps: int, skip: str) -> dict[int, float]:
    """Rank 0's losses of two plain processes (no agent) that skip `skip` batches, trained
    with the job's own `--steps` (the learning-rate schedule depends on it) until `steps`."""
    out = tmp / "reference"
    out.mkdir()
    metrics = out / "metrics.jsonl"
    port = free_port()
    procs = []
    cmd = [sys.executable, *TRAIN, "--steps", str(JOB_STEPS), "--metrics-out", str(metrics)]
    try:
        for rank in (0, 1):
            env = {**plain_worker_env(rank, 2, port), "UNBROKEN_SKIP_BATCHES": skip}
            with open(out / f"rank{rank}.log", "wb") as log:
                procs.append(psutil.Popen(cmd, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + 600
        while max((s for s, _ in timeline(metrics)), default=0) < steps:
            assert all(p.poll() is None for p in procs), (out / "rank0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the reference run is too slow"
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.is_running():
                p.kill()
                p.wait(10)
    return dict(timeline(metrics))
