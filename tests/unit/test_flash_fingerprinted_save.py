"""A fingerprinted step's flash save is never skipped for a busy ring: it is the step a
silent corruption rolls back to (docs/sdc.md). A memory-only save of another step is."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator

import pytest
import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import list_copies
from unbroken.trainer.flashckpt import FlashCheckpointer, FlashEnv

pytestmark = pytest.mark.unit


@pytest.fixture
def checkpointer() -> Iterator[FlashCheckpointer]:
    root = tempfile.mkdtemp(prefix="ub-test-", dir="/dev/shm")
    ck = FlashCheckpointer(FlashEnv(root=root, job="t", node="n0", copies=4), 0)
    ck._layout = {"world": 1}  # (no process group in a unit test)
    try:
        yield ck
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_fingerprinted_save_waits_for_the_copy_in_flight_where_a_plain_one_skips(
    checkpointer: FlashCheckpointer,
) -> None:
    ck = checkpointer
    release = threading.Event()
    ck.writer.close()
    ck.writer = FlashWriter(0, ck.owner, progress_hook=lambda i: release.wait(10))
    model = torch.nn.Linear(8, 4)
    assert ck.save(model, 14, persist=False)  # its copy waits on the hook: in flight
    assert not ck.save(model, 15, persist=False)  # a plain memory copy: skipped
    assert ck.writer.skipped_busy == 1
    threading.Timer(0.2, release.set).start()
    assert ck.save(model, 15, persist=False, sdc={"step": 15})  # waited for step 14's copy
    ck.writer.close()
    steps = [c.manifest.step for c in list_copies(ck.owner.rank_dir(0))]
    assert sorted(steps) == [14, 15] and ck.writer.skipped_busy == 1
