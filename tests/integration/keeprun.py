"""One rank of tests/integration/test_keep_trainer.py (run under torch.distributed.run).

Trains the embedded engine from its initial weights 5 steps in a gloo world (the first 3
are the `afresh` reference), keeps a copy of its state, trains 3 more (the `load`
reference), then fails a step in the middle of its backward on every rank (a backward
hook raises a peer's error, after autograd put gradients into some of FSDP2's unsharded
parameters), leaves that world as a survivor does (`keeptrainer.keep`, the registry dropped as
`ncclguard.drop_gloo_world` does), joins a second world on the same store, takes the kept
trainer, and either loads the copy (`load`) or, as when the restore finds no step on any
rank, lets it start afresh (`afresh`), and trains 3 steps. Prints one
JSON line on rank 0: the reference's and the second world's (loss, grad norm) per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from unbroken.trainer import keeptrainer, ncclguard
from unbroken.trainer.flags import add_arguments, to_config
from unbroken.trainer.plugin import load_trainer
from unbroken.trainer.rejoin import open_sockets, peer_failure, sever


def _clone(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    if isinstance(v, DTensor):
        return DTensor.from_local(
            v.to_local().clone(), v.device_mesh, v.placements, shape=v.shape, stride=v.stride()
        )
    return v.clone() if torch.is_tensor(v) else v


def main() -> None:
    mode, flags = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ.get("KEEPRUN_STORE_PORT") or int(os.environ["MASTER_PORT"]) + 1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    before = open_sockets()  # the first world's pairs are what a leaving rank shuts down
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("w1", store), rank=rank, world_size=world
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = to_config(parser.parse_args(["--preset", "tiny", "--flash-every", "0", *flags]))
    trainer = load_trainer(config.trainer)
    trainer.defer_init = True  # as under a flash store (trainer/run.py `_setup`)
    trainer.setup(config)
    trainer.init_weights()  # nothing restored: a fresh start
    first = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(3))]
    for _ in range(2):
        trainer.train_step()
    saved = _clone(trainer.state_dict())
    ref = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(3))]

    block = list(trainer.parts[0].layers.values())[-1]  # type: ignore[attr-defined]

    def peer_failed(*_: Any) -> None:
        raise RuntimeError("Connection closed by peer (injected in the backward)")

    hook = block.register_full_backward_hook(peer_failed)
    try:
        trainer.train_step()
        raise AssertionError("the step did not fail")
    except RuntimeError as e:
        assert peer_failure(e), repr(e)  # the whole chain (pipelining wraps it)
        if config.parallel.pp > 1:  # the last stage failed; the first waits for its grads
            sever(before)  # as a leaving rank does (trainer/rejoin.py): its peer's wait fails
    hook.remove()
    assert keeptrainer.keep(trainer, leaving=True), "the engine's trainer was not kept"
    ncclguard._forget_registry()  # the world left (its groups stay alive here)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("w2", store), rank=rank, world_size=world
    )
    assert keeptrainer.take(config) is trainer, "the kept trainer was not taken"
    if mode == "afresh":  # the restore found no step on any rank
        keeptrainer.restored(trainer, False)
        trainer.init_weights()
        ref = first
    else:
        keeptrainer.restored(trainer, True)
        trainer.state_dict()  # as the flash restore does first
        trainer.load_state_dict(saved)
    got = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(3))]
    if rank == 0:
        print(json.dumps({"ref": ref, "got": got}), flush=True)
    dist.destroy_process_group()
    # Not the interpreter's exit: in one run of 3-6 a rank aborted in it after the result was
    # printed ("terminate called without an active exception", with its first world's gloo
    # groups left alive as here or dropped as a survivor drops them), which is not what
    # this test checks; the engine's workers exit through trainer/run.py
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
