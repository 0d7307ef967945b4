"""A plain DDP script: 2 ranks on gloo, a small MLP, deterministic data, a few hundred steps.

Run it with `torchrun --standalone --nproc-per-node 2 -m unbroken.trainer.examples.ddp_plain`.
`ddp_unbroken` is this script plus fewer than 10 lines of the hooks SDK (diff the two
files): then a killed worker, restarted by torchrun, resumes from the node agent's memory.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before any group: see the end
from torch.nn.parallel import DistributedDataParallel as DDP

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
    start = 0
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
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
