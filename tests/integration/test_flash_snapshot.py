"""The embedded engine's cheap per-step snapshot writes what a full state-dict save writes.

Two ranks (gloo, FSDP2 over dp=2) train the tiny model; after every step each rank saves
twice: through `FlashCheckpointer.save` (the `Snapshots` path: plan and tensor references
cached, only the learning rate, step, data position and RNG serialised, each param-group
value once per group) and through a
second writer given the full `trainer.state_dict()` (DCP's state-dict calls). The two
copies must have the same checksum and the same small values at every step, and the
snapshot path must have been taken (the param groups mapped to DCP's keys).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from unbroken.trainer.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.launch import spawn

pytestmark = pytest.mark.integration

STEPS = 4
REPO = Path(__file__).resolve().parents[2]


def _both_ways(cfg: TrainConfig, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from unbroken.recovery.flash import FlashWriter
    from unbroken.recovery.flashcopy import find_copy, seal
    from unbroken.recovery.flashplan import Shared
    from unbroken.trainer.flashckpt import KEY, FlashCheckpointer, FlashEnv, flat_fresh
    from unbroken.trainer.gpt3d import GPT3DTrainer

    rank = dist.get_rank()
    trainer = GPT3DTrainer()
    trainer.setup(cfg)
    ck = FlashCheckpointer(FlashEnv(root=root, job="snap", node=f"n{rank}"), rank)
    full = FlashWriter(rank + 100, ck.owner)  # another rank number: its own ring
    same = []

    def step_both_ways() -> None:
        trainer.train_step()
        assert ck.save(trainer, trainer.step, persist=True)
        assert ck._last is not None
        a = ck._last.wait()
        b = full.save_async({KEY: trainer}, trainer.step)
        assert b is not None
        mb = b.wait()
        sa, sb = (seal(find_copy(ck.owner.rank_dir(r), a.step)) for r in (rank, rank + 100))
        same.append((a.step, sa.checksum == sb.checksum, a.objects == mb.objects))

    try:
        for _ in range(STEPS):
            step_both_ways()
        hits = ck.writer.snapshot_hits
        # as after a restore: the state loaded (a new snapshot key), then the ring prepared,
        # which plans the first save (it reads no full state again), and it still equals
        trainer.load_state_dict(trainer.state_dict())
        ck.prepare(trainer)
        step_both_ways()
        prepared_hit = ck.writer.snapshot_hits == hits + 1
        # the fast path names every value as DCP's flattening does: each param-group
        # value once (`Shared`), standing for every parameter's key that holds it
        fast = flat_fresh(trainer)
        slow = dict(flatten_state_dict({KEY: trainer.snapshot_fresh()})[0])
        shared = [v for v in fast.values() if type(v) is Shared]
        expanded = {k: v for k, v in fast.items() if type(v) is not Shared}
        expanded.update({k: s.value for s in shared for k in s.keys})
        keys_same = (
            sorted(expanded) == sorted(slow)
            and all(repr(expanded[k]) == repr(v) for k, v in slow.items() if "param_groups" in k)
            and len(slow) > 100
            and len(fast) < len(slow) // 4
        )
    finally:
        ck.close()
        full.close()
        trainer.close()
    return {"same": same, "hits": hits, "keys_same": keys_same, "prepared_hit": prepared_hit}


def test_snapshot_copies_equal_full_state_dict_copies_under_fsdp2() -> None:
    cfg = TrainConfig(
        model=preset("tiny"),
        parallel=ParallelConfig(dp=2),
        optim=OptimConfig(warmup_steps=2, decay_steps=10),  # the lr changes every step
        data=DataConfig(seq_len=32, global_batch=8, max_corpus_bytes=256 << 10),
        steps=STEPS,
    )
    root = tempfile.mkdtemp(prefix="ub-snap-", dir="/dev/shm")
    try:
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get(
            "PYTHONPATH", "")}  # fmt: skip
        out = spawn(functools.partial(_both_ways, cfg, root), 2, timeout_s=240, env=env)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for rank, r in enumerate(out):
        assert [s for s, _, _ in r["same"]] == list(range(1, STEPS + 2)), r
        assert all(c and o for _, c, o in r["same"]), (rank, r)
        # planned at step 1 (optimizer state appears there), reused after
        assert r["hits"] == STEPS - 1, (rank, r)
        assert r["keys_same"], (rank, r)
        assert r["prepared_hit"], (rank, r)  # the first save after `prepare` took its plan
