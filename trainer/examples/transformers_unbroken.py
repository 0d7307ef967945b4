"""A Hugging Face `Trainer.train` with unbroken: a tiny GPT-2 (built from a config) on
random tokens, on CPU with gloo.

Run it with `torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m
unbroken.trainer.examples.transformers_unbroken` on a node whose `unbroken agent` runs; a
worker that dies is restarted by torchrun and both resume at the newest step in the agent's
memory. Started by unbroken's agents (or under torchrun with `--rdzv-backend=unbroken
--rdzv-conf in_job=1`), the Trainer runs in the Accelerate adapter's `recovery_loop`: when
another rank dies, this process stays, builds its Trainer again in the new world and
restores the agreed step from memory. Rank 0 prints `step N loss X` for every step (from
the loss function, unrounded; also to `--metrics-out` as JSON lines).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from unbroken.trainer import hooks
from unbroken.trainer.adapters.accelerate import recovery_loop
from unbroken.trainer.adapters.transformers import UnbrokenCallback
from unbroken.trainer.examples.accelerate_unbroken import tiny_gpt2, token_data
from unbroken.trainer.examples.args import example_parser


class Tokens(Dataset):  # type: ignore[type-arg]
    def __init__(self, batch_size: int) -> None:
        self.rows = token_data(batch_size=batch_size).tensors[0]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def train(args: argparse.Namespace) -> None:
    """Build the Trainer in the world the environment names, restore, train (once per world)."""
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=1e-3, warmup_steps=5,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, ddp_backend="gloo",
    )  # fmt: skip
    torch.manual_seed(0)
    model = tiny_gpt2(args.width)
    holder: dict[str, Trainer] = {}
    out = open(args.metrics_out, "a") if args.metrics_out else None

    def loss_fn(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        if not dist.is_initialized() or dist.get_rank() == 0:
            step = holder["trainer"].state.global_step + 1
            print(f"step {step} loss {loss.item()!r}", flush=True)
            if out is not None:
                out.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                out.flush()
        time.sleep(args.step_delay_s)
        return loss

    unbroken = UnbrokenCallback(persist_every_s=args.persist_every_s)
    trainer = Trainer(
        model=model, args=training, train_dataset=Tokens(args.batch_size), callbacks=[unbroken],
        compute_loss_func=loss_fn,
    )  # fmt: skip
    holder["trainer"] = trainer
    try:
        trainer.train(resume_from_checkpoint=unbroken.resume(trainer))
    finally:
        if out is not None:
            out.close()
    # The Trainer leaves its process group up, and its DDP wrapper (through the accelerator)
    # holds it: freed only at the interpreter's exit, the group's gloo threads aborted 2 of
    # 12 runs there ("terminate called without an active exception", after training ended).
    # Free them while the interpreter is whole, then the group.
    holder.clear()
    del trainer, unbroken, model
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    args = example_parser(__doc__.split("\n")[0]).parse_args()
    hooks.init(save_budget=args.save_budget, persist_every_s=args.persist_every_s)
    # the Trainer wants an output directory though it saves nothing there (save_strategy
    # "no": the checkpoints are unbroken's); one per process, removed at its end
    with tempfile.TemporaryDirectory(prefix="hf-example-") as scratch:
        args.output_dir = scratch
        recovery_loop(lambda: train(args))


if __name__ == "__main__":
    main()
