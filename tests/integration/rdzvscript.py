"""The training script the torchrun tests run under `--rdzv-backend=unbroken`.

`train.py OUT STEPS`: gloo, a tiny all-reduce per step, rank 0's checkpoint in OUT
(`ckpt.json`, the step every rank resumes from), one log line per step in `OUT/log-$NODE_TAG`
(`restart step world pid`), `OUT/stop` makes every rank stop at the same step.
"""

from __future__ import annotations

TRAIN = """
import json, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

out, steps = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
tag = os.environ["NODE_TAG"]
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
(out / f"pid-{tag}").write_text(str(os.getpid()))
ckpt = out / "ckpt.json"
start = torch.tensor([json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0])
dist.broadcast(start, 0)  # everyone resumes from rank 0's checkpoint
for step in range(int(start) + 1, steps + 1):
    x = torch.tensor([1.0, float((out / "stop").exists())])
    dist.all_reduce(x)
    assert int(x[0]) == world
    if x[1] > 0:  # an operator asked to stop: every rank agrees at the same step
        break
    if rank == 0:
        tmp = out / "ckpt.tmp"
        tmp.write_text(json.dumps({"step": step, "world": world}))
        os.replace(tmp, ckpt)
    with open(out / f"log-{tag}", "a") as f:
        f.write(f"{restart} {step} {world} {os.getpid()}\\n")
    time.sleep(float(os.environ.get("STEP_S", "0.2")))
dist.destroy_process_group()
"""
