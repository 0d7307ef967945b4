"""The torchtitan adapter end to end: a killed worker resumes from the agent's memory.

`unbroken.trainer.examples.torchtitan_unbroken` (torchtitan's own `Trainer` and train loop,
a tiny Llama 3 from a config, FSDP2 over 2 processes on CPU with gloo, random tokens,
unbroken plugged in as its checkpoint manager) runs under torchrun without an agent (the
reference) and with a real agent while local rank 1 is SIGKILLed mid-training: both
restarted ranks restore the newest common step from memory (the FSDP2 shards, AdamW's
state, the scheduler, each rank's data loader, the trainer's step), and every step after it
has the reference's loss bit for bit (CPU, one thread, gloo: deterministic).

The newest step the agent persisted is a DCP checkpoint in torchtitan's own layout: its
model names are the ones torchtitan's own (last-step) checkpoint of the same run holds, and
it loads with plain `dcp.load` into an unsharded model (both FSDP2 shards of every tensor).
A slow test then has torchtitan's own `CheckpointManager`, with no unbroken in the loop,
resume the whole training state from such a step (step, scheduler, optimizer, each rank's
data position).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from tests.integration import adapterrun
from tests.jobs import Job

pytestmark = pytest.mark.integration

MODULE = "unbroken.trainer.examples.torchtitan_unbroken"


@pytest.mark.timeout(900)
def test_killed_worker_resumes_bitwise(tmp_path: Path) -> None:
    ref = adapterrun.reference(MODULE, adapterrun.STEPS, tmp_path)
    with adapterrun.agent(tmp_path) as ag:
        killed = adapterrun.run_killed(
            MODULE, adapterrun.STEPS, adapterrun.KILL_AFTER, ag, tmp_path
        )
        adapterrun.check_resumed(killed, ref, adapterrun.STEPS)
        check_persisted_torchtitan_layout(ag.persist, tmp_path / "outputs")


# Slow (CI's subset leaves it out): two more torchrun starts of torchtitan. The kill test
# above already checks the persisted step's names and loads it with `dcp.load`.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchtitan_resumes_from_a_persisted_step(tmp_path: Path) -> None:
    steps = 20
    with adapterrun.agent(tmp_path) as ag:
        out = subprocess.run(
            adapterrun.torchrun(MODULE, steps),
            env=adapterrun.env(ag.sock),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=adapterrun.RUN_DEADLINE_S,
            check=False,
        )
        assert out.returncode == 0, out.stdout.decode(errors="replace")[-3000:]
        step_dir = check_persisted_torchtitan_layout(ag.persist, tmp_path / "outputs")
    check_torchtitan_resumes_from(step_dir, tmp_path)


def check_persisted_torchtitan_layout(persist: Path, outputs: Path) -> Path:
    """The newest whole persisted step has torchtitan's names and loads with `dcp.load`;
    returns its directory."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from unbroken.trainer.examples.torchtitan_unbroken import tiny_llama

    end = time.monotonic() + 60  # the agent persists in the background
    while not (whole := sorted(p.parent for p in persist.glob("step-*/.metadata"))):
        assert time.monotonic() < end, sorted(str(p) for p in persist.rglob("*"))[:50]
        time.sleep(0.2)
    ours = set(FileSystemReader(str(whole[-1])).read_metadata().state_dict_metadata)
    # torchtitan's own last-step checkpoint (model only) of each run: the same model names
    theirs = sorted(outputs.glob("*/checkpoint/step-*"))
    assert theirs, sorted(str(p) for p in outputs.rglob("*"))[:20]
    for ckpt in theirs:
        names = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
        assert names and names <= ours, sorted(names - ours)[:10]
    for key in ("optimizer", "lr_scheduler", "dataloader", "train_state"):
        assert any(k.startswith(key + ".") for k in ours), (key, sorted(ours)[:20])

    model = tiny_llama().model.build()
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(whole[-1]), no_dist=True)
    for name, t in state.items():  # FSDP2 shards dim 0 over the 2 ranks: both halves came
        half = max(1, t.shape[0] // 2) if t.dim() else 0
        parts = (t[:half], t[half:]) if t.dim() and t.shape[0] > 1 else (t,)
        assert all(p.abs().sum() > 0 for p in parts), name
    model.load_state_dict(state)
    return whole[-1]


def check_torchtitan_resumes_from(step_dir: Path, tmp: Path) -> None:
    """torchtitan's own manager (`initial_load_path`) restores the step's whole state."""
    import torch

    from unbroken.trainer.examples.torchtitan_unbroken import SEQ_LEN, VOCAB

    step = int(step_dir.name.removeprefix("step-"))
    script = Path(__file__).with_name("torchtitan_load.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(script), str(step_dir)]  # fmt: skip
    out = subprocess.run(
        cmd,
        env=adapterrun.env(tmp / "no-agent.sock"),
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=adapterrun.RUN_DEADLINE_S,
        check=False,
    )
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-3000:]
    # the ranks share torchrun's output: a line may run into another's
    loaded = [json.loads(m) for m in re.findall(r"LOADED (\{[^{}]*\})", text)]
    assert sorted(d["rank"] for d in loaded) == [0, 1], text[-3000:]
    batch = 4  # the example's local batch size: a step takes one batch of each rank
    for d in loaded:
        assert d["step"] == step and d["lr_epoch"] == step, (d, step)
        assert d["optimizer_tensors"] > 0, d
        # the next batch is the one after the step's: RandomTokens' sequence step * batch
        g = torch.Generator().manual_seed(1_000_003 * d["rank"] + step * batch)
        first = int(torch.randint(0, VOCAB, (SEQ_LEN + 1,), generator=g)[0])
        assert d["next_batch_first_token"] == first, (d, first)


@pytest.mark.slow  # CI runs the Accelerate adapter's; make test-all this
@pytest.mark.timeout(900)
def test_in_job_the_healthy_rank_keeps_its_process(job: Job) -> None:
    # the agents' workers and the reference each write torchtitan's folder of their own
    adapterrun.in_job_keeps_the_healthy_rank(
        job,
        MODULE,
        extra=("--dump-folder", str(job.tmp / "outputs-job")),
        reference_extra=("--dump-folder", str(job.tmp / "outputs-reference")),
    )
