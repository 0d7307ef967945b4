"""Save and load a trainer through torch.distributed.checkpoint (DCP), resharding as needed.

The trainer is a DCP `Stateful`, so DCP asks it for its (sharded) state dict, writes each
rank's shards, and on load fills a state dict shaped for the *current* layout before handing
it back through `load_state_dict`: a checkpoint written under dp2 loads under dp1, and one
written under pp2×tp2 loads under pp1. Flash checkpoints (recovery/) use the same state
dicts; this module is the storage-backed path for tests, `--save-to` and `--resume-from`.
"""

from __future__ import annotations

import os

import torch.distributed.checkpoint as dcp

from unbroken.trainer.plugin import Trainer

KEY = "trainer"


def save(trainer: Trainer, path: str | os.PathLike[str]) -> None:
    """Write this rank's shards of the trainer state to the folder `path` (collective)."""
    dcp.save({KEY: trainer}, checkpoint_id=os.fspath(path))


def load(trainer: Trainer, path: str | os.PathLike[str]) -> None:
    """Load the trainer state from `path`, resharding into the current layout (collective).

    Raises:
        ValueError: `path` holds no DCP checkpoint.
    """
    if not os.path.exists(os.path.join(os.fspath(path), ".metadata")):
        raise ValueError(
            f"{os.fspath(path)!r} holds no DCP checkpoint (.metadata missing); pass the folder "
            "that --save-to wrote"
        )
    dcp.load({KEY: trainer}, checkpoint_id=os.fspath(path))
