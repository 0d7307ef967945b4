"""The Transformers adapter end to end: a killed worker resumes from the agent's memory.

`unbroken.trainer.examples.transformers_unbroken` (`Trainer.train` of a tiny GPT-2 from a
config on random tokens, DDP on CPU with gloo, 2 processes) runs under torchrun without an
agent (the reference) and with a real agent while local rank 1 is SIGKILLed mid-training:
both restarted ranks restore the newest common step from memory, the Trainer's own resume
skips the batches already trained on, and every step after it has the reference's loss bit
for bit (CPU, one thread, gloo: deterministic). The persisted steps load with plain
`dcp.load` (the weights under `model`). Started by unbroken's agents, the example's Trainer
runs in the Accelerate adapter's `recovery_loop`: a peer's death leaves the healthy rank's
process running (in-job recovery).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.integration import adapterrun
from tests.jobs import Job

pytestmark = pytest.mark.integration

MODULE = "unbroken.trainer.examples.transformers_unbroken"


@pytest.mark.timeout(900)
def test_killed_worker_resumes_bitwise(tmp_path: Path) -> None:
    adapterrun.killed_worker_resumes_bitwise(MODULE, tmp_path, "model")


@pytest.mark.slow  # CI runs the Accelerate adapter's (the same recovery_loop); make test-all this
@pytest.mark.timeout(900)
def test_in_job_the_healthy_rank_keeps_its_process(job: Job) -> None:
    adapterrun.in_job_keeps_the_healthy_rank(job, MODULE)
