"""The buddy-replica security tests' nodes: flash owners in /dev/shm, one per node, and a
rank-0 copy of a given step saved as a worker saves it (test_replica_origin.py,
test_replica_node_keys.py)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashowner import FlashConfig, FlashOwner


@contextmanager
def shm_owners(prefix: str, nodes: tuple[str, ...]) -> Iterator[dict[str, FlashOwner]]:
    """A flash owner per node under /dev/shm/`prefix`-<pid>-<node>, removed after."""
    roots = {n: Path(f"/dev/shm/{prefix}-{os.getpid()}-{n}") for n in nodes}
    try:
        yield {n: FlashOwner(FlashConfig(root=str(r), job="j")) for n, r in roots.items()}
    finally:
        for r in roots.values():
            subprocess.run(["rm", "-rf", str(r)], check=False)


def save_step(owner: FlashOwner, step: int) -> None:
    """Rank 0's copy of `step` in `owner`'s ring: one tensor filled with the step."""
    w = FlashWriter(0, owner)
    try:
        w.save({"w": torch.full((4096,), float(step))}, step).wait()  # type: ignore[union-attr]
    finally:
        w.close()
