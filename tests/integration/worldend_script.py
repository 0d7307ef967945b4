"""A DDP script in `hooks.recovery_loop` whose world ends while a collective still finishes.

Run as the agents' worker command by tests/integration/test_world_end.py. It imports
`torch.distributed.nn` before its world exists (as a script using torch's differentiable
collectives does), trains a few steps with the SDK's save and restore, then ends its
world: rank 1 joins a last all-reduce 2 s late, while rank 0 has already destroyed its
world and returned; that all-reduce's callback (Python) runs on gloo's worker thread and
needs the GIL. Rank 0 writes `--out` once `recovery_loop` returned: how long its world's
end took and whether the callback ran.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before the world, as such scripts do
from torch.nn.parallel import DistributedDataParallel as DDP

from unbroken.trainer import hooks

LATE_S = 2.0
ran: list[str] = []


def train(steps: int) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "opt": opt}
    start = hooks.restore(state) or 0
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hooks.report(step + 1, loss.item())
        hooks.save(step + 1, state, force=step + 1 == steps)
    hooks.flush()
    dist.barrier()
    t = torch.ones(1)
    if rank == 1:
        time.sleep(LATE_S)
        dist.all_reduce(t)
    else:
        work = dist.all_reduce(t, async_op=True)
        work.get_future().then(lambda _: ran.append("callback"))
        del t, work
    dist.destroy_process_group()
    return rank  # the frame's teardown frees the DDP model and its Reducer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t0 = time.monotonic()
    rank = hooks.recovery_loop(lambda: train(args.steps))
    if rank == 0:
        took = time.monotonic() - t0
        with open(args.out, "w") as f:
            json.dump({"ran": ran, "returned_after_s": took}, f)
    print(f"rank {rank} returned", flush=True)


if __name__ == "__main__":
    main()
