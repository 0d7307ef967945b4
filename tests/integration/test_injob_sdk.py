"""In-job recovery of a plain DDP script through the hooks SDK's `recovery_loop`.

The agents' worker command is `unbroken.trainer.examples.ddp_in_job` (DDP on gloo, the SDK's
save/restore, its body in `hooks.recovery_loop`), started by `unbroken driver --nodes 2` on
two `unbroken agent --no-start` processes (real etcd, real processes). n1's worker is
SIGKILLed: n0's worker keeps its pid, rejoins the new world in place, restores the agreed
step from its agent's memory and trains to the end; every step's loss equals an
uninterrupted run's.
"""

from __future__ import annotations

import sys

import pytest

from tests.jobs import Job, reference
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

STEPS = 400
SCRIPT = ["-m", "unbroken.trainer.examples.ddp_in_job"]


def test_a_ddp_script_in_the_recovery_loop_survives_a_peers_sigkill(job: Job) -> None:
    cmd = " ".join(
        [sys.executable, *SCRIPT, "--steps", str(STEPS), "--metrics-out", str(job.metrics)]
    )
    job.start_driver("--worker-cmd", cmd, "--trainer", "ddp-script")
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= 20, 180, "training to start", job)

    job.kill_peer_keep_survivor(past=20)
    resumed = [e.training_resumed for e in job.events() if e.HasField("training_resumed")]
    assert resumed[-1].mode == "in_job", resumed

    until(lambda: job.max_step() >= STEPS, 600, "training to its last step", job)
    got = job.steps()
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    ref = reference(job.tmp / "reference", STEPS, train=SCRIPT, total_steps=STEPS)
    for step, values in got.items():
        for v in values:
            assert v == ref[step], (step, v, ref[step])
