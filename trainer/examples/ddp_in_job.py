"""A DDP script whose healthy ranks survive a peer's death: `ddp_unbroken` in `recovery_loop`.

Run it as the agents' worker command (`unbroken driver --worker-cmd "python -m
unbroken.trainer.examples.ddp_in_job"`). When another rank's process dies, this rank's
collective fails; `hooks.recovery_loop` keeps the process, waits for the agent's new world
and runs `train` again in it, which restores the agreed step from the agent's memory: the
pid, the imports and the interpreter stay. Outside an agent it trains like `ddp_plain`.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from unbroken.trainer import hooks

WIDTH = 64


def batch(step: int, rank: int, size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: a function of both alone, so a rerun sees it again."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(size, WIDTH, generator=g)
    return x, (x[:, :8].sum(dim=1, keepdim=True) / 3).sin()


def train(steps: int, metrics_out: str) -> float:
    """Join the world the environment names, restore, train; the final loss (rank 0)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "opt": opt}
    start = hooks.restore(state) or 0
    out = open(metrics_out, "a") if metrics_out and rank == 0 else None
    try:
        for step in range(start, steps):
            x, y = batch(step, rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hooks.report(step + 1, loss.item())
            hooks.save(step + 1, state, force=step + 1 == steps)
            if out is not None:
                out.write(json.dumps({"step": step + 1, "loss": loss.item()}) + "\n")
                out.flush()
            if hooks.should_stop():  # raises inside recovery_loop when the agent says hold
                break
        x, y = batch(-1, 0, size=256)
        with torch.no_grad():
            final = torch.nn.functional.mse_loss(model(x), y).item()
        hooks.flush()
        dist.barrier()
    finally:
        if out is not None:
            out.close()
    dist.destroy_process_group()
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--metrics-out", default="", help="rank 0's step losses (JSON lines)")
    args = parser.parse_args()
    final = hooks.recovery_loop(lambda: train(args.steps, args.metrics_out))
    print(f"final loss {final!r}", flush=True)


if __name__ == "__main__":
    main()
