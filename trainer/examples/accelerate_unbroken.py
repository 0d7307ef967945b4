"""An Accelerate training loop with unbroken: a tiny GPT-2 (built from a config) on random
tokens, on CPU with gloo.

Run it with `torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m
unbroken.trainer.examples.accelerate_unbroken` on a node whose `unbroken agent` runs; a
worker that dies is restarted by torchrun and both resume at the newest step in the agent's
memory. Started by unbroken's agents (`unbroken driver --worker-cmd "python -m
unbroken.trainer.examples.accelerate_unbroken"`), or under torchrun with `--rdzv-backend=unbroken
--rdzv-conf in_job=1`, the loop runs in the adapter's `recovery_loop`: when another rank
dies, this process stays, joins the new world and restores the agreed step from memory.
Rank 0 prints `step N loss X` for every step (and writes it to `--metrics-out` as JSON lines).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from unbroken.trainer import hooks
from unbroken.trainer.adapters.accelerate import Unbroken, recovery_loop
from unbroken.trainer.examples.args import BATCH_SIZE, WIDTH, example_parser


def tiny_gpt2(width: int = WIDTH) -> GPT2LMHeadModel:
    """A two-layer GPT-2 of width `width` (32) over 64 tokens (no download)."""
    config = GPT2Config(
        n_layer=2, n_embd=width, n_head=2, vocab_size=64, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def token_data(n: int = 256, length: int = 16, *, batch_size: int = BATCH_SIZE) -> TensorDataset:
    """`n` random rows of `length` tokens, or 64 batches' worth when `batch_size` asks more."""
    n = max(n, 64 * batch_size)
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randint(0, 64, (n, length), generator=g))


def train(args: argparse.Namespace) -> None:
    """Join the world the environment names, restore, train (once per world)."""
    # a seedable sampler: each epoch's order is a function of the seed and the epoch, so
    # the batches after a restore mid-epoch are the ones the first run saw
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    set_seed(0)
    model = tiny_gpt2(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 5, args.steps)
    loader = DataLoader(
        token_data(batch_size=args.batch_size), batch_size=args.batch_size, shuffle=True
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    ub = Unbroken(
        accelerator,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        persist_every_s=args.persist_every_s,
    )
    ub.restore()
    out = open(args.metrics_out, "a") if args.metrics_out and accelerator.is_main_process else None
    try:
        for step, (tokens,) in ub.batches(loader, args.steps):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.is_main_process:
                print(f"step {step} loss {loss.item()!r}", flush=True)
            if out is not None:
                out.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                out.flush()
            time.sleep(args.step_delay_s)
            if ub.step_end(step, loss):  # raises inside recovery_loop when the agent says hold
                break
    finally:
        if out is not None:
            out.close()
    ub.close()
    # Free what holds the process group (the DDP model, also in the accelerator's lists)
    # before the group goes: left to the interpreter's exit, a group's gloo threads can abort
    # the process there (the Transformers example did, 2 runs in 12).
    del model, optimizer, loader, scheduler, ub
    accelerator.free_memory()  # its references, then a collection
    accelerator.end_training()


def main() -> None:
    args = example_parser(__doc__.split("\n")[0]).parse_args()
    hooks.init(save_budget=args.save_budget, persist_every_s=args.persist_every_s)
    recovery_loop(lambda: train(args))


if __name__ == "__main__":
    main()
