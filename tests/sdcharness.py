"""An SDC buddy's harness: a small trainer, a flash owner in /dev/shm, and a fingerprinted
copy saved as a rank saves it (the SDC buddy's unit and integration tests)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import find_copy
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.flashplan import Snapshot
from unbroken.recovery.statehash import SDC_META
from unbroken.trainer import sdc


class Trainer:
    """A model and its AdamW, stepped a few times (the Fingerprinter's view of a trainer)."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        self.optimizers = [torch.optim.AdamW(self.model.parameters(), lr=1e-2)]
        for _ in range(3):
            self.model(torch.randn(4, 16)).square().sum().backward()
            self.optimizers[0].step()
            self.optimizers[0].zero_grad()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizers[0].state_dict()}


@contextmanager
def shm_owner() -> Iterator[FlashOwner]:
    """A flash owner whose ring lies in /dev/shm, removed at the end."""
    root = tempfile.mkdtemp(prefix="ub-test-", dir="/dev/shm")
    try:
        yield FlashOwner(FlashConfig(root=root, job="sdc-buddy"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def save_fingerprinted(
    owner: FlashOwner, t: Trainer, step: int, *, flip_in_copy: bool = False
) -> tuple[dict[str, int], Any]:
    """Fingerprint `t` as a rank does, save its copy marked for the buddy; returns the
    rank's report and the copy."""
    w = FlashWriter(0, owner)
    snap = Snapshot(key=1, full=t.state, fresh=dict)
    w.save(snap, step=step - 1).wait()  # a first save plans the copy (as training does)
    fp = sdc.Fingerprinter(t)
    report = fp.compute()
    meta = fp.copy_meta(step, w.entry_names)
    assert meta is not None
    at = sdc.flip_bit(t, tensor="o0.g0.p2", bit=27, seed=3)[1] if flip_in_copy else None
    w.save(snap, step=step, meta={SDC_META: meta}).wait()
    if at is not None:  # the live state right again: the flip is in the copy alone
        sdc.flip_bit(t, at=at)
    w.close()
    return report, find_copy(owner.rank_dir(0), step)
