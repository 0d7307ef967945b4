"""A fault-tolerant DDP script: `ddp_plain` plus fewer than 10 lines of the hooks SDK.

Run it with `torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m
unbroken.trainer.examples.ddp_unbroken` on a node whose `unbroken agent` runs (its socket
in UNBROKEN_AGENT_SOCKET, or the default one). Every step is flash-saved into the agent's
memory; when a worker dies, torchrun restarts both and they resume at the newest saved step.
Without an agent it warns once and trains exactly like `ddp_plain`.

With torch 2.13's own c10d rendezvous (`--standalone`, `--rdzv-backend=c10d`) also set
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: otherwise restarted workers can read the dead ones'
addresses from the shared store and hang in init_process_group (pytorch#135712).
`--rdzv-backend=unbroken` needs no such switch (a fresh store every round).
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before any group: see the end
from torch.nn.parallel import DistributedDataParallel as DDP

from unbroken.trainer import hooks

WIDTH = 64


def batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: a function of both alone, so a rerun sees it again."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(size, WIDTH, generator=g)
    return x, (x[:, :8].sum(dim=1, keepdim=True) / 3).sin()


def main() -> None:
    """Train, then print the loss on a held-out batch (rank 0)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "opt": opt}
    start = hooks.restore(state) or 0
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hooks.report(step + 1, loss.item())
        hooks.save(step + 1, state)
        if hooks.should_stop():
            break
        if rank == 0 and (step + 1) % 50 == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
    x, y = batch(-1, 0, size=256)
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), y).item()
    if rank == 0:
        print(f"final loss {final!r}", flush=True)
    dist.barrier()  # every rank done with its last collective before the teardown


if __name__ == "__main__":
    main()
    # Free the model before its group, and the group before the interpreter ends. Under load
    # a gloo worker thread can still be releasing its last collective at exit; it then wants
    # the GIL while Python shuts down and the process aborts ("terminate called without an
    # active exception", exit -6; CI saw it, a core under stress-ng showed that thread). DDP's
    # reducer holds the group (freed here with main's frame, a cycle needs the collector), and
    # torch.distributed.nn.functional, imported by DDP, would keep the first world's group as
    # its functions' default argument (imported above, before any group, it keeps None). With
    # neither holding it, destroy_process_group frees the group and joins those threads.
    gc.collect()
    dist.destroy_process_group()
