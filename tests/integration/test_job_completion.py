"""A job that trains to its last step FINISHES: real driver, etcd, agents and trainers.

The tests' job (tests/jobs.py) trains the tiny model for 12 steps with the driver's
`--exit-when-finished`. When both workers exit 0 the log records JobFinished(ok=true) at the
last step, the phase is FINISHED, and the driver exits 0 on its own (what ends a Slurm batch
job); nothing after it (the agents losing their driver) opens an incident.
"""

from __future__ import annotations

import contextlib
import shlex
import time

import psutil
import pytest

from tests.jobs import Job
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

STEPS = 12


@pytest.mark.slow  # CI: the in-job test below finishes the same way, with these checks too
def test_a_job_whose_workers_all_exit_0_finishes_and_its_driver_exits(job: Job) -> None:
    job.start_driver("--exit-when-finished", steps=STEPS)
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    driver = job.procs["driver"]
    until(lambda: driver.poll() is not None, 200, "the driver to exit after the last step", job)
    assert driver.returncode == 0, job.logs()
    events = job.events()
    finished = [e.job_finished for e in events if e.HasField("job_finished")]
    assert len(finished) == 1 and finished[0].ok, finished
    assert finished[0].step == STEPS, finished
    assert "exited 0" in finished[0].reason, finished[0].reason
    assert job.max_step() == STEPS  # rank 0's losses, to the last step
    kinds = [e.WhichOneof("payload") for e in events]
    assert "worker_failed" not in kinds and "training_paused" not in kinds, kinds
    after = kinds[kinds.index("job_finished") + 1 :]
    assert "recovery_transition" not in after and "node_lost" not in after, after


def _sleeping(p: psutil.Process) -> bool:
    """Whether `p` runs a `sleep` child; False for a process gone since it was listed (the
    other rank's wrapper exits as soon as its training does: a CI run met that race)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return any(c.name() == "sleep" for c in p.children())
    return False


def test_a_worker_killed_after_the_last_step_restores_there_and_the_job_finishes(
    job: Job,
) -> None:
    # the first rank to end its training lingers (a slow exit) and is SIGKILLed there: the
    # restore is at the last step, where the new workers have nothing left to train
    mark = job.tmp / "lingered"
    job.steps_to_train = STEPS
    wrapped = (
        f"{job.worker_cmd(2)}; c=$?; "
        f"if [ $c = 0 ] && mkdir {shlex.quote(str(mark))} 2>/dev/null; then sleep 60; fi; exit $c"
    )
    job.start_driver("--exit-when-finished", "--worker-cmd", f"sh -c {shlex.quote(wrapped)}")
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(mark.exists, 120, "a rank to finish its last step", job)
    time.sleep(0.5)  # its `sleep` started
    lingering = [p for n in ("n0", "n1") for p in job.workers(n) if _sleeping(p)]
    assert len(lingering) == 1, job.logs()
    lingering[0].kill()
    driver = job.procs["driver"]
    until(lambda: driver.poll() is not None, 200, "the driver to exit after the restore", job)
    assert driver.returncode == 0, job.logs()
    events = job.events()
    kinds = [e.WhichOneof("payload") for e in events]
    assert "worker_failed" in kinds and "restore_started" in kinds, kinds
    restored = [e.restore_started.step for e in events if e.HasField("restore_started")]
    assert restored == [STEPS], (restored, job.logs())  # the last step, from memory
    assert kinds.index("training_resumed", kinds.index("restore_started")) > 0, kinds
    finished = [e.job_finished for e in events if e.HasField("job_finished")]
    assert len(finished) == 1 and finished[0].ok and finished[0].step == STEPS, finished


def test_a_job_recovered_in_job_finishes_with_its_survivor_exiting_0(job: Job) -> None:
    """A peer SIGKILLed mid-training is replaced in-job (the survivor keeps its process and
    its trainer across worlds); at the last step both workers exit 0, the survivor too,
    and the job FINISHES: a process that left a world and joined another ends cleanly."""
    steps = 120
    job.start_driver("--exit-when-finished", steps=steps)
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= 5, 180, "training to start", job)
    job.kill_peer_keep_survivor(past=3)  # asserts the survivor kept its pid
    assert "trainer kept across worlds" in job.worker_log("n0"), job.worker_log("n0")[-3000:]
    driver = job.procs["driver"]
    until(lambda: driver.poll() is not None, 300, "the driver to exit after the last step", job)
    assert driver.returncode == 0, job.logs()
    events = job.events()
    resumed = [e.training_resumed for e in events if e.HasField("training_resumed")]
    assert resumed and resumed[-1].mode == "in_job", resumed
    finished = [e.job_finished for e in events if e.HasField("job_finished")]
    assert len(finished) == 1 and finished[0].ok, finished
    assert finished[0].step == steps and "exited 0" in finished[0].reason, finished[0]
    assert job.max_step() == steps
    # n0's worker never failed: the survivor ran to the end and exited 0
    failed = [e.worker_failed for e in events if e.HasField("worker_failed")]
    assert all(f.node_id != "n0" for f in failed), failed
    # nothing after the end (the agents losing their driver) opens an incident
    kinds = [e.WhichOneof("payload") for e in events]
    after = kinds[kinds.index("job_finished") + 1 :]
    assert "recovery_transition" not in after and "node_lost" not in after, after
