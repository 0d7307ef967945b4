"""`completion.done_step`: when the world's workers all exited 0 (driver/completion.py)."""

from __future__ import annotations

import pytest

from unbroken.driver.completion import done_step
from unbroken.driver.liveview import NodeSlot
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit

EXITED, RUNNING = dpb.WORKER_STATE_EXITED, dpb.WORKER_STATE_RUNNING


def slot(node: str, *workers: tuple[int, int, int], alive: bool = True) -> NodeSlot:
    """A node's slot whose newest heartbeat lists `workers` as (state, exit code, step)."""
    s = NodeSlot(node)
    s.alive = alive
    for i, (state, code, step) in enumerate(workers):
        s.hb.workers.add(local_rank=i, state=state, exit_code=code, step=step)
    return s


def test_every_worker_exited_0_gives_the_highest_step() -> None:
    slots = {
        "a": slot("a", (EXITED, 0, 59), (EXITED, 0, 60)),
        "b": slot("b", (EXITED, 0, 60), (EXITED, 0, 60)),
    }
    assert done_step(("a", "b"), slots, 2) == 60


def test_a_running_failed_missing_or_silent_worker_is_not_done() -> None:
    done = slot("a", (EXITED, 0, 60))
    assert done_step(("a", "b"), {"a": done, "b": slot("b", (RUNNING, 0, 58))}, 1) is None
    assert done_step(("a", "b"), {"a": done, "b": slot("b", (EXITED, -9, 30))}, 1) is None
    assert done_step(("a", "b"), {"a": done, "b": slot("b", (EXITED, 1, 60))}, 1) is None
    assert done_step(("a", "b"), {"a": done, "b": slot("b")}, 1) is None  # no workers yet
    assert done_step(("a", "b"), {"a": done}, 1) is None  # never registered
    assert (
        done_step(("a", "b"), {"a": done, "b": slot("b", (EXITED, 0, 60), alive=False)}, 1) is None
    )
    assert done_step(("a",), {"a": done}, 2) is None  # fewer workers than the layout's
    assert done_step((), {}, 1) is None
