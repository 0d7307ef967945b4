"""Run under torchrun (2 processes): torchtitan's own `CheckpointManager` (no unbroken in the
loop) loads a checkpoint directory as its `initial_load_path`, the whole training state,
into the example's trainer; each rank prints what it restored as one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.tools.logging import init_logger

from unbroken.trainer.adapters.torchtitan import torch_compat, use_cpu
from unbroken.trainer.examples import torchtitan_unbroken as example


def main() -> None:
    init_logger()
    use_cpu()
    torch_compat()
    config = example.job_config(steps=1000, step_delay_s=0.0, persist_every_s=30.0)
    config.checkpoint = CheckpointManager.Config(
        enable=True,
        folder="torchtitan-load",
        initial_load_path=sys.argv[1],
        initial_load_model_only=False,
        interval=100_000,
    )
    trainer = config.build()
    assert trainer.checkpointer.load(), "torchtitan loaded nothing"
    first = next(iter(trainer.dataloader))[0]["input"]
    out = {
        "rank": int(os.environ["RANK"]),
        "step": trainer.step,
        "lr_epoch": trainer.lr_schedulers.schedulers[0].last_epoch,
        "next_batch_first_token": int(first[0, 0]),
        "optimizer_tensors": sum(
            1 for v in trainer.optimizers.state_dict().values() if isinstance(v, torch.Tensor)
        ),
    }
    print("LOADED " + json.dumps(out), flush=True)
    trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
