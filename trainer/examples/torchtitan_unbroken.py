"""torchtitan's own Trainer with unbroken: a tiny Llama 3 (built from a config) on random
tokens, FSDP2 over the ranks, on CPU with gloo.

Run it with `torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m
unbroken.trainer.examples.torchtitan_unbroken` on a node whose `unbroken agent` runs; a
worker that dies is restarted by torchrun and both resume at the newest step in the agent's
memory. Started by unbroken's agents (or under torchrun with `--rdzv-backend=unbroken
--rdzv-conf in_job=1`), the Trainer runs in `hooks.recovery_loop`: when another rank dies,
this process stays, builds its Trainer (process groups, mesh, FSDP2 model) again in the new
world and restores the agreed step from memory. Rank 0 prints `step N loss X` for every
step (also to `--metrics-out` as JSON lines).

The one unbroken line is `config.checkpoint = Unbroken.Config(...)`. The rest is what a
torchtitan job on CPU needs: `use_cpu()` (torchtitan 0.3.0 picks CUDA without an
accelerator), SDPA attention (FlexAttention has no backward on CPU), the "partial_dtensor"
SPMD backend (the default "spmd_types" one's FSDP wants every parameter a DTensor over the
full mesh, which this torch's `fully_shard` refuses), FSDP2 reductions gloo has
(`gloo_parallelize`), and a data loader and tokenizer that need no download.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import TrainingConfig
from torchtitan.config.configs import DebugConfig, ParallelismConfig
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.llama3 import Llama3Model, parallelize_llama
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer

from unbroken.trainer import hooks
from unbroken.trainer.adapters.torchtitan import Unbroken, gloo_parallelize, use_cpu
from unbroken.trainer.examples.args import BATCH_SIZE, WIDTH, example_parser

VOCAB = 64
SEQ_LEN = 16


def tiny_llama(dim: int = WIDTH, n_layers: int = 2, n_heads: int = 2) -> ModelSpec:
    """A two-layer Llama 3 of width `dim` (32) over 64 tokens, SDPA attention (no download)."""
    linear = {
        "weight": partial(torch.nn.init.trunc_normal_, std=0.02),
        "bias": torch.nn.init.zeros_,
    }
    ones = {"weight": torch.nn.init.ones_}
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                wqkv_param_init=linear,
                wo_param_init=linear,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True,
                rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=SEQ_LEN, theta=10000),
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=4 * dim, w1_param_init=linear, w2w3_param_init=linear
            ),
        )
        for _ in range(n_layers)
    ]
    model = Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB,
            embedding_dim=dim,
            param_init={"weight": partial(torch.nn.init.normal_, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=linear),
        layers=layers,
    )
    return ModelSpec(
        name="llama3",
        flavor="unbroken-tiny",
        model=model,
        parallelize_fn=gloo_parallelize(parallelize_llama),
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )


class NoTokenizer(BaseTokenizer):
    """The data is token ids already: nothing to encode."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("the example's data is token ids")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("the example's data is token ids")

    def get_vocab_size(self) -> int:
        return VOCAB


class RandomTokens(IterableDataset[Any], Stateful):
    """Endless random sequences, the i-th of a data-parallel rank a function of (rank, i);
    its state is i (saved with the loader's)."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.i = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(1_000_003 * self.dp_rank + self.i)
            x = torch.randint(0, VOCAB, (SEQ_LEN + 1,), generator=g)
            self.i += 1
            yield {"input": x[:-1], "positions": torch.arange(SEQ_LEN)}, x[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.i = int(state_dict["i"])


class RandomTokenLoader(ParallelAwareDataloader):
    """torchtitan's data loader (a `StatefulDataLoader`) over `RandomTokens`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        pass

    def __init__(
        self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any,
        seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(
            RandomTokens(dp_rank), dp_rank=dp_rank, dp_world_size=dp_world_size,
            batch_size=local_batch_size,
        )  # fmt: skip


class DemoTrainer(Trainer):
    """torchtitan's Trainer that prints each step's loss on rank 0 and may sleep a while."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        step_delay_s: float = 0.0
        metrics_out: str = ""  # rank 0's step losses (JSON lines)

    config: Config

    def train_step(self, data_iterator: Any) -> None:
        super().train_step(data_iterator)
        if torch.distributed.get_rank() == 0:
            loss = getattr(self.checkpointer, "last_loss", None)
            print(f"step {self.step} loss {loss!r}", flush=True)
            if self.config.metrics_out:
                with open(self.config.metrics_out, "a") as f:
                    f.write(json.dumps({"step": self.step, "loss": loss}) + "\n")
        time.sleep(self.config.step_delay_s)


def job_config(
    steps: int,
    step_delay_s: float,
    persist_every_s: float,
    metrics_out: str = "",
    dump_folder: str = "",
    batch_size: int = BATCH_SIZE,
    width: int = WIDTH,
) -> DemoTrainer.Config:
    spec = tiny_llama(width)
    return DemoTrainer.Config(
        model_spec=spec,
        hf_assets_path="",
        # one folder per torchrun run (its restarts share it): torchtitan's own
        # checkpoints of an earlier run are not this run's start
        dump_folder=dump_folder
        or os.path.join("outputs", os.environ.get("TORCHELASTIC_RUN_ID", "run")),
        tokenizer=NoTokenizer.Config(),
        dataloader=RandomTokenLoader.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=5, decay_type="linear"),
        training=TrainingConfig(
            local_batch_size=batch_size,
            seq_len=SEQ_LEN,
            steps=steps,
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=None,  # a tiny model: nothing to recompute
        metrics=MetricsProcessor.Config(log_freq=1),
        debug=DebugConfig(seed=0),
        # the unbroken line: torchtitan's checkpoint manager with flash saves, restore,
        # reports and rollback skips; its own DCP saves stay at `interval`
        checkpoint=Unbroken.Config(interval=100_000, persist_every_s=persist_every_s),
        step_delay_s=step_delay_s,
        metrics_out=metrics_out,
    )


def train(args: argparse.Namespace) -> None:
    """Build the Trainer in the world the environment names, restore, train (once per world)."""
    config = job_config(
        args.steps,
        args.step_delay_s,
        args.persist_every_s,
        args.metrics_out,
        args.dump_folder,
        args.batch_size,
        args.width,
    )
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = example_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--dump-folder",
        default="",
        help="torchtitan's output folder (default: outputs/<torchrun's run id> in the cwd)",
    )
    args = parser.parse_args()
    hooks.init(save_budget=args.save_budget, persist_every_s=args.persist_every_s)
    init_logger()
    use_cpu()
    hooks.recovery_loop(lambda: train(args))


if __name__ == "__main__":
    main()
