"""A hung worker (SIGSTOP) is recovered by the driver's recovery loop without a person.

`unbroken driver --nodes 2 --dp 2` runs the tiny trainer on two
`unbroken agent --no-start` processes. `InjectFault hang` SIGSTOPs one worker: its peer
blocks in the next all-reduce, no rank makes progress, and the hang detector appends
HangSuspected naming the stopped rank (its process is stopped: the culprit, so no
diagnosis). The loop stops every worker (the stopped one is killed after the grace
period), restarts the world, the workers restore from flash memory, and training goes on.
"""

from __future__ import annotations

import psutil
import pytest

from tests.jobs import Job, inject
from unbroken.agent.hang import STOPPED_AFTER_MS
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration


@pytest.mark.slow  # ~2 min on 2 loaded cores; `make run`'s drill covers a hang too
def test_sigstopped_worker_is_detected_and_the_job_resumes(job: Job) -> None:
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= 5, 180, "training to start", job)

    inject(job.address, "n1", "hang", rank=0)

    # the agent's children include warm standbys: the victim is the one it stopped
    def stopped() -> list[psutil.Process]:
        kids = psutil.Process(job.procs["n1"].pid).children(recursive=True)
        return [k for k in kids if k.status() == psutil.STATUS_STOPPED]

    until(stopped, 30, "the worker to stop (SIGSTOP is delivered asynchronously)", job)
    (victim,) = stopped()
    hung_at = job.max_step()

    def resumed_after_hang() -> bool:
        kinds = [e.WhichOneof("payload") for e in job.events()]
        return (
            "hang_suspected" in kinds
            and "training_resumed" in kinds[kinds.index("hang_suspected") :]
        )

    until(resumed_after_hang, 120, "the hang's recovery", job)
    until(lambda: job.max_step() >= hung_at + 3, 120, "training past the hang", job)

    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
    events = job.events()
    hang = next(e.hang_suspected for e in events if e.HasField("hang_suspected"))
    # a stopped process needs no rhythm: it is hung STOPPED_AFTER_MS after its last step,
    # whatever the floor (its peers, waiting for it, would pass the floor later)
    assert hang.stuck_at_step >= 1 and hang.silent_ms >= hang.threshold_ms == STOPPED_AFTER_MS
    i = next(i for i, e in enumerate(events) if e.HasField("hang_suspected"))
    kinds = [e.WhichOneof("payload") for e in events[i:]]
    for k in ("recovery_transition", "training_paused", "restore_started", "training_resumed"):
        assert k in kinds, kinds
    assert "job_finished" not in kinds, kinds
    # the stopped rank is the culprit: named as such, and restarted without a diagnosis
    assert (hang.node_id, hang.phase) == ("n1", "stopped"), hang
    first = next(e.recovery_transition for e in events[i:] if e.HasField("recovery_transition"))
    assert not first.diagnose and "diagnosis_verdict" not in kinds, first
