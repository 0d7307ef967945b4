"""A warm standby's dry run: the embedded engine's first calls, made before the standby
has a rank.

A fresh worker process pays for many first calls on its resume path: FSDP's wrapping and
its DTensor dispatch, the first `state_dict` and `load_state_dict` through torch's
distributed state-dict API, the first forward, backward and optimizer step. On a loaded
2-core host the first load of a restore took 1.2 s, against 0.14 s once the same calls had
run in the process before (a 1-rank world each time).

The standby (agent/warm.py) therefore calls `__unbroken_warm__` after importing this
module. That function runs one step of the tiny preset in a private 1-rank gloo world,
with FSDP wrapping forced as dp >= 2 would apply it. It round-trips the trainer's state,
and then drops the world, so the worker starts as if nothing had run: no process group
and no trainer. What it leaves is the caches of the calls it made, and its seeded global
RNG state, which every worker's set-up seeds again. Its log lines are discarded.
"""

from __future__ import annotations

import contextlib
import io


def __unbroken_warm__() -> None:
    """One dry step of the embedded engine in a private 1-rank world (see the module)."""
    import argparse

    import torch.distributed as dist

    from unbroken.trainer import parallel
    from unbroken.trainer.flags import add_arguments, to_config
    from unbroken.trainer.gpt3d import GPT3DTrainer

    if dist.is_initialized():
        return
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = to_config(parser.parse_args(["--preset", "tiny", "--device", "cpu"]))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            trainer = GPT3DTrainer()
            trainer.setup(config)
            for part in trainer.parts:  # as dp >= 2 wraps them
                parallel.apply_fsdp(part, trainer.topo, config.parallel, None)
            trainer.optimizers = [trainer._optimizer(p, config.optim) for p in trainer.parts]
            trainer.train_step()
            trainer.load_state_dict(trainer.state_dict())
            trainer.close()
        finally:
            dist.destroy_process_group()
