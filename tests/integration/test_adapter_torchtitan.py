"""The torchtitan adapter end to end: a killed worker resumes from the agent's memory.

`unbroken.trainer.examples.torchtitan_unbroken` (torchtitan's own `Trainer` and train loop,
a tiny Llama 3 from a config, FSDP2 over 2 processes on CPU with gloo, random tokens,
unbroken plugged in as its checkpoint manager) runs under torchrun without an agent (the
reference) and with a real agent while local rank 1 is SIGKILLed mid-training: both
restarted ranks restore the newest common step from memory (FSDP2 shards, AdamW state,
scheduler, each rank's data loader, the trainer's step), and every step after it has the
reference's loss bit for bit (CPU, one thread, gloo: deterministic). The newest step the
agent persisted loads with plain `dcp.load` into an unsharded model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from tests.integration import adapterrun

pytestmark = pytest.mark.integration

MODULE = "unbroken.trainer.examples.torchtitan_unbroken"


@pytest.mark.timeout(900)
def test_killed_worker_resumes_bitwise(tmp_path: Path) -> None:
    ref = adapterrun.reference(MODULE, adapterrun.STEPS, tmp_path)
    with adapterrun.agent(tmp_path) as ag:
        killed = adapterrun.run_killed(MODULE, adapterrun.STEPS, adapterrun.KILL_AFTER, ag, tmp_path)
        adapterrun.check_resumed(killed, ref, adapterrun.STEPS)
