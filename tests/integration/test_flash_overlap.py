"""Overlapped flash saves: the copy runs while the next step computes, and is still exact.

A real model (with dropout, so the RNG state matters) and a real AdamW train in this
process. After each optimizer step the state is saved twice: synchronously by one writer
(the reference) and with `save_async` by another whose copy is held in flight by its
progress hook until the next step's forward and backward are done and the data position
has moved on. The writer's optimizer guard must then hold `optimizer.step()` until the
copy is out; the overlapped copy must equal the synchronous one bit for bit (data bytes,
checksum, entries, small values). The second test removes the guard and shows the same
schedule tears the copy, so the first test is sensitive to what it claims. The third
does the same with the embedded trainer on dp2 (FSDP2 shards, DTensors), where the guard
sits inside `train_step`'s optimizer step.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import find_copy, read_copy
from unbroken.recovery.flashowner import FlashConfig, FlashOwner

pytestmark = pytest.mark.integration

STEPS = 4


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    root = tempfile.mkdtemp(prefix="ub-overlap-", dir="/dev/shm")
    try:
        yield FlashOwner(FlashConfig(root=root, job="overlap"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Loop:
    """A small MLP with dropout and AdamW; the data position lives in a dict."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Dropout(0.1), torch.nn.GELU(), torch.nn.Linear(64, 8)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.position = {"sample_index": 0}

    def forward_backward(self) -> None:
        g = torch.Generator().manual_seed(self.position["sample_index"])
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.position["sample_index"] += 16  # the loader moved on before the step

    def state(self, step: int) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "data": self.position,  # the live dict: the save must snapshot it
            "step": step,
            "rng": torch.get_rng_state(),
        }


def _same_copy(owner: FlashOwner, rank_a: int, rank_b: int, step: int) -> bool:
    a, b = find_copy(owner.rank_dir(rank_a), step), find_copy(owner.rank_dir(rank_b), step)
    ma, mb = a.manifest, b.manifest
    if (ma.checksum, ma.entries, dict(ma.objects)) != (mb.checksum, mb.entries, dict(mb.objects)):
        return False
    da, db = read_copy(a), read_copy(b)  # both verified against their checksums
    try:
        return da[: ma.data_nbytes] == db[: mb.data_nbytes]
    finally:
        da.close()
        db.close()


def _run(owner: FlashOwner, guarded: bool) -> list[bool]:
    """Train STEPS steps; returns, per step, whether the overlapped copy equals the sync one."""
    loop = Loop()
    release: dict[int, threading.Event] = {}  # per saved step
    in_flight = {"step": -1}

    def hold(i: int) -> None:
        # Copy the first tensor, then wait: the copy is in flight across the next step.
        if i == 1 and in_flight["step"] in release:
            assert release[in_flight["step"]].wait(30), "the test never released the copy"

    reference, overlapped = FlashWriter(0, owner), FlashWriter(1, owner, progress_hook=hold)
    guards = overlapped.guard([loop.opt]) if guarded else []
    same: list[bool] = []
    handle = None
    try:
        for step in range(1, STEPS + 2):
            loop.forward_backward()
            if handle is not None:
                assert not handle.copied()  # the copy really overlaps this forward/backward
            if guarded and handle is not None:
                threading.Timer(0.05, release[step - 1].set).start()
                loop.opt.step()  # the guard waits for the copy in flight
            else:
                loop.opt.step()  # mutates the parameters under the copy in flight
                if handle is not None:
                    release[step - 1].set()
            if handle is not None:
                assert handle.wait().step == step - 1
                same.append(_same_copy(owner, 0, 1, step - 1))
            if step > STEPS:
                break
            reference.save(loop.state(step), step).wait()  # type: ignore[union-attr]
            in_flight["step"] = step
            release[step] = threading.Event()
            handle = overlapped.save_async(loop.state(step), step)
            assert handle is not None
    finally:
        for event in release.values():
            event.set()
        for g in guards:
            g.remove()
        reference.close()
        overlapped.close()
    return same


def test_overlapped_copy_equals_synchronous_copy_bit_for_bit(owner: FlashOwner) -> None:
    assert _run(owner, guarded=True) == [True] * STEPS


def test_without_the_guard_the_same_schedule_tears_the_copy(owner: FlashOwner) -> None:
    assert _run(owner, guarded=False) == [False] * STEPS


def _gpt3d_rank(root: str, steps: int) -> list[bool]:
    """One rank of the tiny gpt3d on dp2 (FSDP2): overlapped saves vs synchronous ones."""
    import torch.distributed as dist

    from unbroken.trainer.config import DataConfig, ParallelConfig, TrainConfig, preset
    from unbroken.trainer.gpt3d import GPT3DTrainer

    cfg = TrainConfig(
        model=preset("tiny"),
        parallel=ParallelConfig(dp=2),
        data=DataConfig(seq_len=32, global_batch=4, max_corpus_bytes=256 << 10),
        steps=steps,
    )
    trainer = GPT3DTrainer()
    trainer.setup(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    owner = FlashOwner(FlashConfig(root=root, job="gpt3d"))
    release: dict[int, threading.Event] = {}
    current = {"step": -1}

    def hold(i: int) -> None:
        if i == 1:
            assert release[current["step"]].wait(30), "never released"

    reference, overlapped = (
        FlashWriter(rank + world, owner),
        FlashWriter(rank, owner, progress_hook=hold),
    )
    guards = overlapped.guard(trainer.optimizers)
    same = []
    handle = None
    try:
        for _ in range(steps):
            step = int(trainer.train_step()["step"])  # the guard waits in its optimizer step
            if handle is not None:
                # its checksum and manifest (an idle-priority thread) may still be due
                handle.wait(30.0)
                same.append(_same_copy(owner, rank, rank + world, step - 1))
            reference.save(trainer.state_dict(), step).wait()  # type: ignore[union-attr]
            current["step"] = step
            release[step] = threading.Event()
            handle = overlapped.save_async(trainer.state_dict(), step)
            assert handle is not None and not handle.copied()
            threading.Timer(0.1, release[step].set).start()  # during the next train_step
        overlapped.wait_copied()
    finally:
        for event in release.values():
            event.set()
        for g in guards:
            g.remove()
        reference.close()
        overlapped.close()
        trainer.close()
    return same


@pytest.mark.slow  # ~10 s: two trainer processes; the MLP tests above cover CI
def test_gpt3d_dp2_overlapped_saves_equal_synchronous_ones(owner: FlashOwner) -> None:
    from unbroken.trainer.launch import spawn

    steps = 3
    results = spawn(_gpt3d_rank, 2, str(owner.config.root), steps, timeout_s=180)
    assert results == [[True] * (steps - 1)] * 2
