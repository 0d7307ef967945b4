"""Worker entry point: `python -m unbroken.trainer.run --preset tiny --dp 2 --tp 2 --steps 50`.

Usable by torchrun and by the node agent alike: it reads RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT from the environment (a single process needs none of them),
joins the process group, loads the trainer plugin named by `--trainer` from the
`unbroken.trainers` entry points, optionally resumes from a DCP checkpoint, trains, reports
every step to the local agent when one is listening (trainer/hooks.py), and always closes.
Under an agent that owns a flash store (trainer/flashckpt.py) it first restores the newest
step every rank can obtain (memory, buddy replica, storage) and resumes at the next step,
and flash-saves its full sharded state every `--flash-every` steps (default 1 there),
overlapped with the next step (its optimizer step waits for the copy, nothing else does).
Exit codes: 0 done, 1 training failed, 2 bad flags.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import structlog

from unbroken.trainer.config import TrainConfig
from unbroken.trainer.flags import add_arguments, to_config

log = structlog.get_logger(__name__)

PG_TIMEOUT = timedelta(minutes=5)


def init_distributed(config: TrainConfig) -> bool:
    """Join the process group torchrun/the agent described in the environment.

    Returns:
        True when this call created the group (the caller destroys it).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=PG_TIMEOUT)
    return True


def train(
    config: TrainConfig,
    *,
    trainer_name: str = "gpt3d",
    resume_from: str | None = None,
    save_to: str | None = None,
    metrics_out: str | None = None,
    log_every: int = 10,
    flash_every: int | None = None,
) -> list[dict[str, Any]]:
    """Train `config.steps` steps (counting a resumed step) inside an existing process group.

    Args:
        flash_every: flash-save every this many steps; None: 1 under an agent with a flash
            store, else off; 0: off (and no flash restore).

    Returns:
        This rank's metrics, one dict per step run here.
    """
    import torch.distributed as dist

    from unbroken.trainer import checkpoint
    from unbroken.trainer.flashckpt import FlashCheckpointer, FlashEnv
    from unbroken.trainer.plugin import load_trainer

    try:
        from unbroken.trainer import hooks as hooks_mod
    except ImportError:  # the hooks SDK is optional for the engine
        hooks_mod = None  # type: ignore[assignment]
    hooks = hooks_mod.install() if hooks_mod is not None else None
    rank = dist.get_rank()
    trainer = load_trainer(trainer_name)
    history: list[dict[str, Any]] = []
    out = open(metrics_out, "a") if metrics_out and rank == 0 else None
    env = FlashEnv.from_env()
    if flash_every is None:
        flash_every = 1 if env is not None else 0
    if flash_every and env is None:
        raise ValueError("--flash-every needs an agent's flash store (run under `unbroken agent`)")
    flash = FlashCheckpointer(env, rank) if flash_every and env is not None else None
    try:
        trainer.setup(config)
        step = 0
        restored = flash.restore(trainer) if flash is not None else None
        if restored is not None:
            step = restored.step
        elif resume_from:
            checkpoint.load(trainer, resume_from)
            step = int(trainer.state_dict()["step"])
        if flash is not None:
            flash.guard(trainer)  # once: every optimizer step waits for the copy in flight
        while step < config.steps:
            m = trainer.train_step()
            step = int(m["step"])
            if flash is not None and step % flash_every == 0:
                flash.save(trainer, step)
            history.append(m)
            if hooks is not None:
                hooks.step(step, m["loss"], m["step_time_s"] * 1000.0)
            if out is not None:
                out.write(json.dumps(m) + "\n")
                out.flush()
            if rank == 0 and (step % log_every == 0 or step == config.steps):
                log.info("step", **{k: v for k, v in m.items() if v is not None})
        if save_to:
            checkpoint.save(trainer, save_to)
    finally:
        if flash is not None:
            flash.close()
        trainer.close()
        if out is not None:
            out.close()
    return history


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, join the group, train, always clean up. Returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m unbroken.trainer.run", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    parser.add_argument(
        "--flash-every",
        type=int,
        default=None,
        help="flash-save every N steps into the agent's memory (default: 1 under an agent, "
        "else off; 0: off)",
    )
    args = parser.parse_args(argv)
    if not structlog.is_configured():  # per-step debug lines (flash saves) would flood logs
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        config = to_config(args)
        if args.flash_every is not None and args.flash_every < 0:
            raise ValueError(f"--flash-every must be >= 0, got {args.flash_every}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    owns = init_distributed(config)
    try:
        config.check_world(dist.get_world_size())
        train(
            config,
            trainer_name=args.trainer,
            resume_from=args.resume_from,
            save_to=args.save_to,
            metrics_out=args.metrics_out,
            log_every=args.log_every,
            flash_every=args.flash_every,
        )
        dist.barrier()  # every rank done with its last collective before teardown
    except ValueError as e:
        log.error("bad configuration", error=str(e))
        return 2
    finally:
        if owns and dist.is_initialized():
            gc.collect()  # free DDP/FSDP state before the group goes away
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
