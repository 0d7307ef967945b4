"""Where a world's process groups are freed, in a process that outlives its worlds.

`hooks.recovery_loop` runs a script's distributed part again and again in one process, so
each world's process groups are freed while the process goes on. Two things in torch make
that unsafe or leaky, and this module takes both out of the script's way:

- **Freed holding the GIL.** DDP's C++ `Reducer` holds its process group, and pybind11
  frees a Reducer with the GIL held. When the Reducer is the group's last holder (the
  script's `destroy_process_group()` dropped the registry's), the gloo group's destructor
  runs there and joins its worker threads with the GIL held; a worker thread still
  finishing a collective that calls into Python (a `Future.then` callback; freeing tensors
  that had Python objects) waits for the GIL: a deadlock, in the frame teardown of the
  script's training function (tests/integration/test_world_end.py). CI saw such a hang
  twice (2026-12-06: the kept rank trained its last step and never returned, a thread with
  no Python frame waiting beside it). torch frees the Python `ProcessGroup` object with the
  GIL released, so `pin` holds those objects while the body runs and `release` drops them
  after it returned or left its world: the last holder is then a Python object, and the
  destructor joins its threads with the GIL free.
- **Pinned for ever.** `torch.distributed.nn.functional` takes `group.WORLD` as its
  functions' default argument when it is first imported, which DDP does at its first
  construction: the first world's default group is then held by those defaults for the
  life of the process, with its threads and its connections to peers that are gone.
  `import_early` imports it before any world exists, so the defaults are None (the
  default group of whichever world is current).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

_pinned: list[Any] = []  # the Python ProcessGroup objects of the current world


def import_early() -> None:
    """Import torch's modules that capture the default group at import time, before a
    world exists (a recovery loop calls it before its body)."""
    with contextlib.suppress(Exception):
        import torch.distributed.nn.functional  # noqa: F401


def pin() -> int:
    """Hold every process group of the current world (its Python objects) until `release`;
    the number held."""
    with contextlib.suppress(Exception):
        from torch.distributed import distributed_c10d as c10d

        _pinned[:] = list(c10d._world.pg_names)
    return len(_pinned)


def refresh() -> None:
    """`pin` again when the world has groups it did not have then (one made after the
    first save, a DDP on a subgroup): a dictionary's length, every step."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None and len(c10d._world.pg_names) != len(_pinned):
        pin()


def release(*, background: bool = False) -> None:
    """Drop what `pin` held: the groups no longer referenced elsewhere are destroyed, their
    worker threads joined with the GIL released; on a side thread with `background` (a
    rank going on into its next world does not wait for the old world's destructors, as
    `ncclguard.drop_gloo_world` does not)."""
    if not background:
        _pinned.clear()
        return
    held = _pinned[:]
    _pinned.clear()

    def drop() -> None:
        held.clear()  # the last references, for the groups nothing else holds

    threading.Thread(target=drop, name="unbroken-world-release", daemon=True).start()


def pinned() -> int:
    """How many groups are held (tests)."""
    return len(_pinned)
