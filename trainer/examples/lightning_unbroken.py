"""A PyTorch Lightning `Trainer.fit` with unbroken: a tiny GPT-2 (built from a config) on
random tokens, on CPU with gloo.

Run it with `torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m
unbroken.trainer.examples.lightning_unbroken` on a node whose `unbroken agent` runs; a
worker that dies is restarted by torchrun and both resume at the newest step in the agent's
memory. Started by unbroken's agents (or under torchrun with `--rdzv-backend=unbroken
--rdzv-conf in_job=1`), the fit runs in `hooks.recovery_loop`: when another rank dies, this
process stays, builds its Trainer again in the new world and restores the agreed step from
memory. Rank 0 prints `step N loss X` for every step (also to `--metrics-out` as JSON lines).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import get_linear_schedule_with_warmup

from unbroken.trainer import hooks
from unbroken.trainer.adapters.lightning import ResumableDataLoader, Unbroken
from unbroken.trainer.examples.accelerate_unbroken import tiny_gpt2, token_data
from unbroken.trainer.examples.args import WIDTH, example_parser


class TinyLM(pl.LightningModule):
    def __init__(
        self, steps: int, step_delay_s: float = 0.0, metrics_out: Any = None, width: int = WIDTH
    ) -> None:
        super().__init__()
        self.steps = steps
        self.step_delay_s = step_delay_s
        self.metrics_out = metrics_out  # an open file for rank 0's losses, or None
        self.model = tiny_gpt2(width)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        if self.global_rank == 0:
            print(f"step {self.global_step + 1} loss {loss.item()!r}", flush=True)
            if self.metrics_out is not None:
                line = {"step": self.global_step + 1, "loss": loss.item()}
                self.metrics_out.write(json.dumps(line) + "\n")
                self.metrics_out.flush()
        time.sleep(self.step_delay_s)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = get_linear_schedule_with_warmup(opt, 5, self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train(args: argparse.Namespace) -> None:
    """Build the Trainer in the world the environment names, restore, fit (once per world)."""
    pl.seed_everything(0, verbose=False)
    ub = Unbroken(persist_every_s=args.persist_every_s)
    # the world the launcher made: torchrun --nproc-per-node 2 (one node of 2), or the
    # agents of `unbroken driver --nodes 2` (2 nodes of 1)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    nodes = max(1, int(os.environ.get("WORLD_SIZE", str(devices))) // devices)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy="ddp", max_steps=args.steps,
        callbacks=[ub], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    loader = ResumableDataLoader(
        token_data(batch_size=args.batch_size),
        batch_size=args.batch_size,
        shuffle=True,
        unbroken=ub,
    )
    out = open(args.metrics_out, "a") if args.metrics_out else None
    try:
        trainer.fit(TinyLM(args.steps, args.step_delay_s, out, args.width), loader)
    finally:
        if out is not None:
            out.close()
    # Lightning leaves its process group up, held by the trainer's DDP model in reference
    # cycles: freed only at the interpreter's exit, a group's gloo threads can abort the
    # process there (the Transformers example did, 2 runs in 12). Free them first.
    del trainer, loader, ub
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    args = example_parser(__doc__.split("\n")[0]).parse_args()
    hooks.init(save_budget=args.save_budget, persist_every_s=args.persist_every_s)
    hooks.recovery_loop(lambda: train(args))


if __name__ == "__main__":
    main()
