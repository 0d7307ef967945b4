"""A warm standby's dry run: the embedded engine's first calls, made before the standby
has a rank.

A fresh worker process pays for many first calls on its resume path: FSDP's wrapping and
its DTensor dispatch, the first `state_dict` and `load_state_dict` through torch's
distributed state-dict API, the first forward, backward and optimizer step. On a loaded
2-core host the first load of a restore took 1.2 s, against 0.14 s once the same calls had
run in the process before.

The standby (agent/warm.py) therefore calls `__unbroken_warm__` after importing this
module. That function runs the restore path of the job's own layout once: it builds the
trainer from the worker's flags (which the agent passes in `UNBROKEN_WARM_ARGV`; the tiny
preset when it does not) in a private world of the job's size on torch's fake process
group (no peers, no traffic: its collectives only pretend), takes the state of the fresh
optimizer (made without a step: trainer/optimstate.py), loads it back, runs one step (not
with pp > 1: a pipeline's step cannot run on the fake group, so there torch's zero step
warms the optimizer's ops instead) and round-trips the state again. Then it drops the
world, so the worker starts as if nothing had run: no
process group, no trainer, and no "[rank0]" prefix on its tracebacks (the group's hook).

The world's size matters: DTensor caches its sharding decisions per mesh, and a mesh of
one rank is not the mesh of two. With a 1-rank world here, a replacement's first
`state_dict` in a dp2 job still took 0.4-0.5 s (the optimizer's zero step, its sharding
propagation not cached); with the job's size it takes 0.01-0.07 s. The caches hold the
dry run's meshes, which carry its rank's coordinate and group names: the worker's start
forgets them where the real world gives it another place (trainer/rejoin.py
`forget_dry_run_caches`).

What it leaves is the caches of the calls it made, its seeded global RNG state, which
every worker's set-up seeds again, and its trainer, kept as a survivor of an in-job
recovery keeps its own (trainer/keeptrainer.py): a worker whose place (rank, world size)
and flags are the dry run's, under a flash store, points it at the real world instead of
building one; its restore then overwrites every tensor the dry run's step touched (or,
when no rank holds a step, it is built again on its meshes: a new trainer's weights).
It always runs on the CPU (a standby claims no accelerator before it has a rank), and a
model of more than `MAX_DRY_RUN_PARAMS` is not built: the default model is, in the job's
world size. Its log lines are discarded.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

from unbroken.common.workerenv import WARM_ARGV

#: The flags the dry run uses when the agent names no worker flags: the bench's and the
#: drill's model.
DEFAULT_ARGV = ("--preset", "tiny")
#: A larger model is not built on the standby's CPU (its memory and a CPU step would cost
#: the host more than the first calls save): the dry run builds the default model instead,
#: in the job's world size.
MAX_DRY_RUN_PARAMS = 20_000_000


def dry_run_argv(env: dict[str, str] | None = None) -> list[str]:
    """The worker's flags the dry run builds its trainer from (`WARM_ARGV`, a JSON list),
    on the CPU; the tiny preset when the variable is unset or unreadable."""
    raw = (os.environ if env is None else env).get(WARM_ARGV, "")
    argv: list[str] = list(DEFAULT_ARGV)
    if raw:
        with contextlib.suppress(ValueError):
            given = json.loads(raw)
            if isinstance(given, list) and all(isinstance(a, str) for a in given):
                argv = given
    return [*argv, "--device", "cpu"]


def _worker_logging() -> None:
    """The worker's log format, as its main() would set it: the trainer kept from the dry
    run binds its logger there, and kept structlog's default whole seconds."""
    import logging

    import structlog

    from unbroken.common.logsetup import setup_worker_logging

    if not structlog.is_configured():
        setup_worker_logging(logging.INFO)


def __unbroken_warm__() -> None:
    """One dry restore and step of the embedded engine in a private world (see the module)."""
    import argparse

    import torch.distributed as dist

    try:  # torch's fake process group lives in a private module: without it, no dry run
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return

    import torch

    from unbroken.trainer import keeptrainer, stepthread
    from unbroken.trainer.flags import add_arguments, to_config
    from unbroken.trainer.gpt3d import GPT3DTrainer
    from unbroken.trainer.rejoin import note_dry_run

    if dist.is_initialized():
        return
    _worker_logging()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        argv = dry_run_argv()
        try:
            config = to_config(parser.parse_known_args(argv)[0])
        except (SystemExit, ValueError):  # flags of another version: the default model
            argv = [*DEFAULT_ARGV, "--device", "cpu"]
            config = to_config(parser.parse_args(argv))
        p = config.parallel
        if p.dp * p.cp * p.pp * p.tp == 1:  # FSDP wraps only from dp 2: warm that path
            argv = [*argv, "--dp", "2"]
        if config.model.n_params() > MAX_DRY_RUN_PARAMS:  # the default model, this layout
            argv = [*argv, *DEFAULT_ARGV, "--device", "cpu"]
        config = to_config(parser.parse_known_args(argv)[0])
        if config.model.n_params() > MAX_DRY_RUN_PARAMS:  # set field by field: no dry run
            return
        p = config.parallel
        world = p.dp * p.cp * p.pp * p.tp
        cpu_job = not torch.cuda.is_available()  # its worker's steps run on a gloo world
        rank = int(os.environ.get("RANK", "0") or 0)
        rank = rank if 0 <= rank < world else 0
        hook = sys.excepthook  # the group wraps it: "[rank0]: " on the worker's tracebacks
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        # Said before the first DTensor op, not after the last: the worker's start checks
        # its real place against it, and a dry run that fails part way has cached as much
        # as the ops before its failure. Noted only at its end, a pp2×tp2 dry run (which
        # failed in its step) was never noted: its caches were kept, and a standby promoted
        # to rank 2 ran rank 0's cached tp mesh, whose group ("19") rank 2 does not have.
        note_dry_run(rank, world)
        try:
            trainer, kept = GPT3DTrainer(), False
            try:
                trainer.setup(config)
                if p.pp > 1:  # no step below: torch's zero step warms the optimizer's ops
                    from torch.distributed.checkpoint.state_dict import _init_optim_state

                    for opt in trainer.optimizers:
                        _init_optim_state(opt)
                # a restore's path: the state of an optimizer that has not stepped, a load
                trainer.load_state_dict(trainer.state_dict())
                # No step with pp > 1: the stages first swap their activations' shapes
                # (`recv_object_list`), and the fake group receives nothing, so a stage
                # read uninitialised memory as a size and a pickle (stage 0 asked for
                # 140 TB and raised; a smaller garbage size could allocate it).
                if p.pp == 1:
                    # on the thread the worker's steps will run on (a gloo worker under an
                    # agent: trainer/stepthread.py), whose sharding cache is its own
                    stepthread.call(trainer.train_step) if cpu_job else trainer.train_step()
                    trainer.load_state_dict(trainer.state_dict())
                # the worker takes it where its place and flags are these (see above); with
                # pp > 1 its pipeline stages are made in the real world, as a survivor's are
                kept = keeptrainer.keep(trainer, leaving=True)
            finally:
                if not kept:
                    trainer.close()
        finally:
            dist.destroy_process_group()
            sys.excepthook = hook
