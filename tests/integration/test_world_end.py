"""A world's end in `hooks.recovery_loop` never deadlocks on its process groups' destructors.

The worker script (tests/integration/worldend_script.py) imports torch's differentiable
collectives before its world, so no default argument holds the world's group, trains under
two real agents, and ends its world with an all-reduce still finishing on rank 0 (its peer
joins 2 s late, after rank 0 returned). Before trainer/worldpin.py, DDP's Reducer was the
group's last holder there: the group's destructor joined gloo's worker thread with the GIL
held, while that thread waited for the GIL to run the all-reduce's callback, and rank 0
never returned (checked against the code without it: the job never finished).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.jobs import Job
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("worldend_script.py")


def test_a_world_ending_with_a_collective_in_flight_returns(job: Job) -> None:
    out = job.tmp / "rank0.json"
    cmd = f"{sys.executable} {SCRIPT} --steps 20 --out {out}"
    job.start_driver("--worker-cmd", cmd, "--trainer", "ddp-script", "--exit-when-finished")
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    driver = job.procs["driver"]
    until(lambda: driver.poll() is not None, 180, "the job to finish and its driver to exit", job)
    assert driver.returncode == 0, job.logs()
    got = json.loads(out.read_text())
    assert got["ran"] == ["callback"], got
    finished = [e.job_finished for e in job.events() if e.HasField("job_finished")]
    assert len(finished) == 1 and finished[0].ok, finished
