"""Adapters: unbroken for training code written with other libraries, found by entry point.

Each adapter gives a library's own training loop what the embedded engine gets, through
the hooks SDK (`unbroken.trainer.hooks`): a flash save into the node agent's memory every
step (or every N), the restore at start from memory, the buddy's replica or storage
(with the data position and step), step and loss reports (hang, straggler and spike
detection), and after a loss-spike rollback the restore point and the batches to skip.
The common part is `unbroken.trainer.adapters.core`; each library's lives in a module of
its own that imports the library only there. Adapters are registered in the
`unbroken.adapters` entry-point group, so a package adds one by declaring, e.g.
`[project.entry-points."unbroken.adapters"] mine = "pkg.module:MyAdapter"`. This module
imports neither torch nor any library.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "unbroken.adapters"


def available() -> list[str]:
    """Names of the adapters registered under `unbroken.adapters`."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load(name: str) -> Any:
    """The adapter registered as `name` (a class or factory; importing it imports its library).

    Raises:
        ValueError: no adapter of that name is installed.
        ImportError: its library is not installed (the message says which extra to add).
    """
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        raise ValueError(
            f"no adapter named {name!r} in entry-point group {ENTRY_POINT_GROUP!r}; "
            f"installed: {available() or 'none'}"
        )
    try:
        return matches[0].load()
    except ImportError as e:
        raise ImportError(
            f"adapter {name!r} needs a library that is not installed ({e}); "
            "install it, e.g. `pip install 'unbroken[adapters]'`"
        ) from e
