"""A gloo rank's step on a side thread, so a step gloo never ends does not hold the rank.

Gloo (the copy in torch 2.13's wheel) forgets the waiter of a send or receive that is already
on the wire when its connection breaks: `Pair::signalException` fails the operations still
queued and those waiting for their peer's notice, but not the one being written (in `tx_`,
an unbound buffer's op: only bound buffers' are failed) nor the one being read (`rx_`). That
operation's `wait` then runs to the group's timeout, 30 minutes. Seen in CI and in one of
five local runs of `make run`'s layout (pp2 x tp2) with a rank SIGKILLed: the stage-1 rank
whose pipeline peer was killed stayed in its step's last gradient send while its other peers
left, and its agent killed it after the hold limit and replaced it. A small reproduction: a
receiver whose sender is killed mid-payload waits out the timeout (tests/integration/
test_stepthread.py). Nothing reaches that wait from Python: `Work` has no abort, the gloo
backend's `abort` and `shutdown` return without touching it (measured), and shutting the
rank's sockets down (the gloo guard) does nothing to a pair that is closed already.

So where the gloo guard runs (trainer/ncclguard.py: an agent can hold this rank), the step
runs on a side thread and the main thread waits for it. Once the guard has shut the world
down (the agent's hold), the step gets `GRACE_S` to fail as every other gloo operation then
does at once; a step still running after that is left behind: `LeftBehind` is raised, the
rank leaves its world as on a peer's failure, and the thread stays blocked until the old
group's timeout, when it ends and what it returned or raised is dropped. The trainer it was
stepping is never kept for the next world (`stepping` says so), since that thread may still
touch it. Only gloo: on a GPU the CUDA device is the calling thread's, and NCCL's guard
aborts the communicators, which does end their waits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from unbroken.trainer import ncclguard
from unbroken.trainer.rtrace import mark

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: How long a step may take to fail after the guard shut the world down: a gloo operation
#: on a shut socket fails within milliseconds; only the lost waiter above takes longer.
GRACE_S = 0.25
#: How often the main thread looks at the guard while the step runs.
POLL_S = 0.02


class LeftBehind(RuntimeError):
    """The step did not end after the world was shut down: it was left on its thread."""


class _Step:
    """One step's run on its thread: what it returned or raised, and when it ended."""

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self, fn: Callable[[], Any], grad: bool) -> None:
        import torch

        try:
            with torch.set_grad_enabled(grad):  # the caller's (thread-local in torch)
                self.result = fn()
        except BaseException as e:  # handed to the waiting thread
            self.error = e
        finally:
            self.done.set()

    def outcome(self) -> Any:
        """What the ended run returned; raises what it raised."""
        if self.error is not None:
            raise self.error
        return self.result


class _Runner:
    """The thread that runs the steps, one after the other. One for the process (a new
    thread per step made every step 15-40 % slower on the bench's tiny model: torch's
    per-thread state started cold each time), and a new one after a step was left behind."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[_Step, Callable[[], Any], bool]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="unbroken-step", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            job[0].run(job[1], job[2])
            del job  # no reference to the trainer between steps (one not kept is freed)


_runner: _Runner | None = None
#: The threads left behind, by the id of what they step (see `stepping`; an id is not reused
#: while its thread runs: the thread holds the object).
_left: dict[int, threading.Thread] = {}


def _submit(fn: Callable[[], Any]) -> tuple[_Runner, _Step]:
    """Queue `fn` on the step thread (made if none runs), with the caller's grad mode."""
    global _runner
    import torch

    if _runner is None:
        _runner = _Runner()
    step = _Step()
    _runner.jobs.put((step, fn, torch.is_grad_enabled()))
    return _runner, step


def call(fn: Callable[[], T]) -> T:
    """`fn()` on the step thread, now, whether or not steps run there yet: what must reach
    that thread's own state (DTensor's sharding cache is per thread: a standby's dry run
    warms it, a rejoin at another place clears it; trainer/warmup.py, trainer/rejoin.py)."""
    _, step = _submit(fn)
    step.done.wait()
    return step.outcome()  # type: ignore[no-any-return]


def started() -> bool:
    """Whether the step thread runs (`call` or a guarded `run` made it)."""
    return _runner is not None


def guarded() -> bool:
    """Whether steps run on a side thread: a gloo guard watches this rank's world."""
    return isinstance(ncclguard.active(), ncclguard.GlooGuard)


def run(fn: Callable[[], T], owner: Any) -> T:
    """`fn()` (a step of `owner`), on the step thread where `guarded`, else here. Raises
    what it raises, or `LeftBehind` when the guard shut the world down and it did not end."""
    global _runner
    if not guarded():
        return fn()
    runner, step = _submit(fn)
    while not step.done.wait(POLL_S):
        why = ncclguard.tripped()
        if why and not step.done.wait(GRACE_S):
            _left[id(owner)], _runner = runner.thread, None
            log.warning(
                "step left on its thread: it did not end after the world was shut down",
                why=why,
                grace_s=GRACE_S,
            )
            mark("step_left")
            raise LeftBehind(f"step still running {GRACE_S}s after its world was shut ({why})")
    return step.outcome()  # type: ignore[no-any-return]


def stepping(owner: Any) -> bool:
    """Whether a step of `owner` that was left behind still runs (it must not be kept)."""
    t = _left.get(id(owner))
    return t is not None and t.is_alive()
