"""trainer/worldpin.py: a world's groups outlive DDP's Reducer while pinned, and go on release.

A world of one gloo rank in this process: its group's threads are counted in
/proc/self/task, by name. With the group pinned, `destroy_process_group()` and freeing the
DDP model (its Reducer) leave the group alive (the Reducer is not its last holder, so its destructor
does not run there with the GIL held); `release` then destroys it and its threads end.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from unbroken.trainer import worldpin

pytestmark = pytest.mark.unit


def _tasks() -> int:
    """This process's gloo threads (a group's worker loops and its transport's event loop),
    by name: other threads an earlier test left may end at any time."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


def _settles(n: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _tasks() != n and time.monotonic() < deadline:
        time.sleep(0.05)
    return _tasks() == n


def test_a_pinned_group_outlives_the_reducer_and_goes_on_release() -> None:
    worldpin.import_early()
    assert not dist.is_initialized()
    before = _tasks()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Linear(4, 1))
        model(torch.randn(2, 4)).sum().backward()
        with_group = _tasks()
        assert with_group > before  # gloo's worker threads
        assert worldpin.pin() == 1
    finally:
        dist.destroy_process_group()
    del model
    assert _tasks() == with_group  # pinned: the Reducer did not free the group
    worldpin.release()
    assert worldpin.pinned() == 0
    assert _settles(before), (before, _tasks())  # freed on release, its threads joined


def test_release_without_a_pin_is_harmless() -> None:
    worldpin.release()
    assert worldpin.pinned() == 0


def test_a_background_release_frees_the_groups_on_a_side_thread() -> None:
    before = _tasks()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with_group = _tasks()
        assert worldpin.pin() == 1
    finally:
        dist.destroy_process_group()
    assert _tasks() == with_group  # pinned
    worldpin.release(background=True)
    assert worldpin.pinned() == 0
    assert _settles(before), (before, _tasks())


def test_refresh_pins_a_group_made_after_the_first_pin() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert worldpin.pin() == 1
        worldpin.refresh()
        assert worldpin.pinned() == 1  # nothing new: nothing done
        dist.new_group([0])
        worldpin.refresh()
        assert worldpin.pinned() == 2
    finally:
        dist.destroy_process_group()
        worldpin.release()
