"""Command-line flags of the trainer, generated from `TrainConfig` (no torch import).

Shared by `python -m unbroken.trainer.run` (the worker entry point for torchrun and the node
agent) and `unbroken train` (the CLI subcommand), so both accept the same flags; each flag's
default and help live on its field in config.py (common/config.py generates the flags).

The agent passes the driver's layout in UNBROKEN_DP/PP/TP; where it differs from the flags
it wins, and the trainer says so in its log (`layout from the environment`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any

import structlog

from unbroken.common import workerenv
from unbroken.common.config import add_config_flags, flag_fields
from unbroken.common.config import config_from_args as build
from unbroken.common.workerenv import WorkerEnv
from unbroken.trainer.config import (
    OUTPUT,
    PRESETS,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    preset,
)

log = structlog.get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the training flags to `parser`."""
    groups = add_config_flags(parser, TrainConfig)
    groups["model"].add_argument(
        "--preset", default="tiny", choices=sorted(PRESETS), help="model size (default: tiny)"
    )
    g = groups[OUTPUT]
    g.add_argument("--resume-from", default=None, help="DCP checkpoint folder to load first")
    g.add_argument("--save-to", default=None, help="DCP checkpoint folder written at the end")
    g.add_argument("--metrics-out", default=None, help="JSON-lines file of rank 0's metrics")


def layout_from_env(args: argparse.Namespace, env: dict[str, str] | None = None) -> dict[str, int]:
    """The driver's layout: UNBROKEN_DP/PP/TP (set by the agent) win over the flags.

    After an elastic shrink or grow the driver restarts the same worker command on a
    world of another size; the agent passes the new degrees in these variables. The driver
    knows dp × pp × tp only: context parallelism is a split of its data-parallel ranks, so
    its dp is dp × cp here. Expert parallelism borrows ranks from dp; when a shrink leaves a
    dp that ep no longer divides, ep drops to gcd(ep, dp) and the experts reshard through
    DCP (their layout is in the checkpoint) instead of the job failing its config check.
    Each value that differs from its flag is logged (a warning naming both).

    Returns:
        The degrees to use: dp, pp, tp and ep.

    Raises:
        ValueError: a variable is malformed (the message names it).
    """
    given = WorkerEnv.from_env(os.environ if env is None else env)
    out = {"dp": args.dp, "pp": args.pp, "tp": args.tp, "ep": args.ep}
    for name, value in (("dp", given.dp), ("pp", given.pp), ("tp", given.tp)):
        var = workerenv.VARIABLES[name]
        if value is None:
            continue
        if name == "dp" and args.cp > 1:
            if value % args.cp:
                raise ValueError(
                    f"{workerenv.DP}={value} (the driver's dp, which counts cp ranks) is not "
                    f"divisible by --cp {args.cp}; this world cannot keep context parallelism"
                )
            value //= args.cp
        if value != out[name]:
            log.warning(
                "layout from the environment overrides a flag",
                variable=var,
                env_value=value,
                flag=f"--{name}",
                flag_value=out[name],
            )
        out[name] = value
    if out["ep"] > 1 and out["dp"] % out["ep"]:
        ep = math.gcd(out["ep"], out["dp"])
        log.warning("--ep lowered to divide the driver's dp", flag_value=out["ep"], ep=ep)
        out["ep"] = ep
    return out


def to_config(args: argparse.Namespace) -> TrainConfig:
    """Build and validate the config from parsed flags.

    Raises:
        ValueError: a flag combination is invalid (the message names the field).
    """
    layout = layout_from_env(args)
    overrides: dict[str, Any] = {
        ff.field.name: getattr(args, ff.dest)
        for ff in flag_fields(ModelConfig)
        if ff.dest is not None and getattr(args, ff.dest, None) is not None
    }
    model = preset(args.preset, **overrides)
    if args.seq_len > model.max_seq_len and "max_seq_len" not in overrides:
        model = dataclasses.replace(model, max_seq_len=args.seq_len)
    return build(
        TrainConfig,
        args,
        model=model,
        parallel=build(
            ParallelConfig, args, microbatches=args.microbatches or layout["pp"], **layout
        ),
        optim=build(
            OptimConfig, args, min_lr=min(args.min_lr, args.lr), decay_steps=max(1, args.steps)
        ),
        data=build(DataConfig, args),
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
