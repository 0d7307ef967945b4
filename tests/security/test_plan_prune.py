"""Plan pruning (`flashcopy.prune_plans`) against a hostile ring directory.

Only the names the directory lists are ever deleted, never a path a file names: a plan file
that is a symlink loses the link, not its target; a manifest naming `../` or a huge file
keeps everything (it is unreadable as a slot manifest) and is read 64 KiB at most.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import manifest_path, prune_plans
from unbroken.recovery.flashowner import FlashConfig, FlashOwner

pytestmark = pytest.mark.unit

OLD = time.time() - 3600


@pytest.fixture
def rank_dir() -> Iterator[Path]:
    root = tempfile.mkdtemp(prefix="ub-sec-", dir="/dev/shm")
    try:
        owner = FlashOwner(FlashConfig(root=root, job="t"))
        w = FlashWriter(0, owner)
        w.save({"w": torch.ones(4)}, 1).wait()
        w.close()
        yield owner.rank_dir(0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_symlinked_plan_loses_the_link_not_its_target(rank_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = rank_dir / "plan-0123456789abcdef.lines"
    link.symlink_to(target)
    os.utime(link, (OLD, OLD), follow_symlinks=False)
    assert prune_plans(rank_dir, min_age_s=0.0) == [link.name]
    assert not link.is_symlink() and target.read_text() == "keep me"


def test_a_hostile_manifest_keeps_every_plan_and_is_read_in_part(rank_dir: Path) -> None:
    plans = sorted(p.name for p in rank_dir.glob("plan-*.lines"))
    stale = rank_dir / "plan-fedcba9876543210.lines"
    stale.write_bytes(b"x")
    os.utime(stale, (OLD, OLD))
    bad = manifest_path(rank_dir, 1)
    bad.write_bytes(b'{"plan": "../../etc/passwd"}\n' + b"0" * (8 << 20))
    assert prune_plans(rank_dir, min_age_s=0.0) == []
    assert sorted(p.name for p in rank_dir.glob("plan-*.lines")) == sorted([*plans, stale.name])
