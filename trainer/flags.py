"""Command-line flags of the trainer, mapped one-to-one onto `TrainConfig` (no torch import).

Shared by `python -m unbroken.trainer.run` (the worker entry point for torchrun and the node
agent) and `unbroken train` (the CLI subcommand), so both accept the same flags and there is a
single source of truth for defaults: the dataclasses in config.py.
"""

from __future__ import annotations

import argparse
import math
import os

from unbroken.common import workerenv
from unbroken.common.workerenv import WorkerEnv
from unbroken.trainer.config import (
    AC_MODES,
    DP_MODES,
    INIT_MODES,
    OPTIMIZER_IMPLS,
    PRESETS,
    SCHEDULES,
    DataConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    preset,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the training flags to `parser`."""
    d, p, o = DataConfig(), ParallelConfig(), OptimConfig()
    g = parser.add_argument_group("model")
    g.add_argument("--trainer", default="gpt3d", help="trainer plugin (entry point name)")
    g.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    g.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps to run")
    g.add_argument("--seed", type=int, default=0, help="model init seed")
    g.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"))
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument(
        "--init",
        default=INIT_MODES[0],
        choices=INIT_MODES,
        help="meta: each rank materialises only its own shards; full: the whole model first",
    )
    g = parser.add_argument_group("parallelism")
    g.add_argument("--dp", type=int, default=p.dp, help="data-parallel degree")
    g.add_argument(
        "--cp", type=int, default=p.cp, help="context-parallel degree (splits each sequence)"
    )
    g.add_argument(
        "--ep",
        type=int,
        default=p.ep,
        help="expert-parallel degree for MoE presets (ranks borrowed from dp; must divide it)",
    )
    g.add_argument("--pp", type=int, default=p.pp, help="pipeline-parallel degree")
    g.add_argument("--tp", type=int, default=p.tp, help="tensor-parallel degree")
    g.add_argument("--dp-mode", default=p.dp_mode, choices=DP_MODES, help="ZeRO mode")
    g.add_argument("--dp-replicate", type=int, default=p.dp_replicate, help="HSDP groups")
    g.add_argument("--schedule", default=p.schedule, choices=SCHEDULES)
    g.add_argument("--microbatches", type=int, default=0, help="0: pp (or 1 without pp)")
    g.add_argument("--no-sequence-parallel", action="store_true")
    g.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        default=p.activation_checkpointing,
        choices=AC_MODES,
        help="recompute in backward: full blocks, or op (selective: keep matmul outputs)",
    )
    g.add_argument(
        "--ac-every", type=int, default=p.ac_every, help="with full: every k-th block only"
    )
    g.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload")
    g.add_argument("--compile", action="store_true", help="torch.compile each block")
    g = parser.add_argument_group("data and optimizer")
    g.add_argument("--data", default=None, help="text file or folder (default: Python stdlib)")
    g.add_argument("--seq-len", type=int, default=d.seq_len)
    g.add_argument("--global-batch", type=int, default=d.global_batch)
    g.add_argument("--max-corpus-bytes", type=int, default=d.max_corpus_bytes)
    g.add_argument("--lr", type=float, default=o.lr)
    g.add_argument("--min-lr", type=float, default=o.min_lr)
    g.add_argument("--warmup-steps", type=int, default=o.warmup_steps)
    g.add_argument("--max-grad-norm", type=float, default=o.max_grad_norm)
    g.add_argument(
        "--optimizer-impl", default=o.impl, choices=OPTIMIZER_IMPLS, help="AdamW kernels"
    )
    g = parser.add_argument_group("checkpoint and output")
    g.add_argument("--resume-from", default=None, help="DCP checkpoint folder to load first")
    g.add_argument("--save-to", default=None, help="DCP checkpoint folder written at the end")
    g.add_argument("--metrics-out", default=None, help="JSON-lines file of rank 0's metrics")
    g.add_argument("--log-every", type=int, default=10, help="log metrics every N steps")


def _layout_from_env(args: argparse.Namespace) -> None:
    """Let the driver's layout win: UNBROKEN_DP/PP/TP (set by the agent) override the flags.

    After an elastic shrink or grow the driver restarts the same worker command on a
    world of another size; the agent passes the new degrees in these variables. The driver
    knows dp × pp × tp only: context parallelism is a split of its data-parallel ranks, so
    its dp is dp × cp here. Expert parallelism borrows ranks from dp; when a shrink leaves a
    dp that ep no longer divides, ep drops to gcd(ep, dp) and the experts reshard through
    DCP (their layout is in the checkpoint) instead of the job failing its config check.
    """
    env = WorkerEnv.from_env(os.environ)
    for name, value in (("dp", env.dp), ("pp", env.pp), ("tp", env.tp)):
        if value is None:
            continue
        if name == "dp" and args.cp > 1:
            if value % args.cp:
                raise ValueError(
                    f"{workerenv.DP}={value} (the driver's dp, which counts cp ranks) is not "
                    f"divisible by --cp {args.cp}; this world cannot keep context parallelism"
                )
            value //= args.cp
        setattr(args, name, value)
    if args.ep > 1 and args.dp % args.ep:
        args.ep = math.gcd(args.ep, args.dp)


def to_config(args: argparse.Namespace) -> TrainConfig:
    """Build and validate the config from parsed flags.

    Raises:
        ValueError: a flag combination is invalid (the message names the field).
    """
    _layout_from_env(args)
    overrides = {"n_layers": args.layers} if args.layers else {}
    model = preset(args.preset, **overrides)
    if args.seq_len > model.max_seq_len:
        model = preset(args.preset, **overrides, max_seq_len=args.seq_len)
    microbatches = args.microbatches or args.pp
    return TrainConfig(
        model=model,
        parallel=ParallelConfig(
            dp=args.dp,
            cp=args.cp,
            ep=args.ep,
            pp=args.pp,
            tp=args.tp,
            dp_mode=args.dp_mode,
            dp_replicate=args.dp_replicate,
            schedule=args.schedule,
            microbatches=microbatches,
            sequence_parallel=not args.no_sequence_parallel,
            activation_checkpointing=args.activation_checkpointing,
            ac_every=args.ac_every,
            cpu_offload=args.cpu_offload,
            compile=args.compile,
        ),
        optim=OptimConfig(
            lr=args.lr,
            min_lr=min(args.min_lr, args.lr),
            warmup_steps=args.warmup_steps,
            decay_steps=max(1, args.steps),
            max_grad_norm=args.max_grad_norm,
            impl=args.optimizer_impl,
        ),
        data=DataConfig(
            path=args.data,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            max_corpus_bytes=args.max_corpus_bytes,
        ),
        steps=args.steps,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        init=args.init,
    )


def to_argv(args: argparse.Namespace) -> list[str]:
    """The flags (as `add_arguments` defines them) that reproduce `args`; defaults omitted."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default or not action.option_strings:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv
