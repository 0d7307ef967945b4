"""The flash-save pacer of the hooks SDK: which `save` calls really save.

A save costs more than the time it blocks (its background copy takes CPU, and copying
megabytes evicts the step's data from the caches), so the SDK measures that cost and
saves only as often as `SAVE_BUDGET` of the step time allows. Every rank must save the
same steps (a restore needs a step every rank holds), so calls are counted, not timed,
and the ranks agree on the interval collectively (the SDK does the collective; this
module does no I/O and imports no torch).
"""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import threading
import time
from typing import Any

from unbroken.recovery import lifecycle

SAVE_BUDGET = 0.02  # share of the step time flash saves may cost (init(save_budget=...))
# Of the flash copies, the agent persists to storage about one per this many seconds (the
# others live in memory and the buddy's replica): persisting every copy would cost the node
# far more than the save itself (init(persist_every_s=...)).
PERSIST_EVERY_S = 30.0
CALIBRATE_CALLS = 8  # save() calls that all save, to measure a save's cost
FIRST_RETUNE_CALLS = 64  # save() calls after calibrating to the first full measurement
RETUNE_CALLS = 256  # save() calls between later re-tunings
PROBE_CALLS = 16  # saving every step, skip every this-many-th so a save's cost shows
MAX_EVERY = 1000  # never fewer saves than one per this many steps


def save_interval(cost_s: float, step_s: float, budget: float, max_every: int = MAX_EVERY) -> int:
    """Steps between flash saves so that their cost stays within `budget` of the step time.

    Args:
        cost_s: what one save costs the training: the time it blocks the step plus the CPU
            time its background copy, checksum and manifest take (on a machine without a
            spare core that CPU is taken from training).
        step_s: the time of one step without saving.
        budget: the share of step time saves may take (0.02: 2 %).
        max_every: the longest interval, in steps.

    Returns:
        1 (save every step) when a save is cheap enough, else the smallest interval within
        budget, at most `max_every`.
    """
    if cost_s <= 0:
        return 1
    if step_s <= 0:
        return max_every
    return max(1, min(max_every, math.ceil(cost_s / (budget * step_s) - 1e-9)))


def _thread_cpu_s(prefix: str) -> float:
    """CPU seconds used so far by this process's threads whose name starts with `prefix`."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.ident is not None:
            with contextlib.suppress(OSError, AttributeError):
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return total


class Pacer:
    """Which `save` calls really save: all while calibrating, then one per `every` steps.

    Every rank must choose the same steps (a restore needs a step every rank holds), so
    the interval is agreed on collectively: each rank measures what its saves cost and what
    a step costs over a window of calls, and the ranks take the largest interval any of
    them needs. Calls are counted, not timed, so the ranks tune at the same call.

    A save costs more than the time it blocks: its background copy takes CPU (on a node
    without a spare core, from training), and copying megabytes evicts the step's data
    from the caches. So the cost is measured in this process's CPU time (every thread,
    which is also what other processes on the machine do not change): the CPU of the
    steps that carried a save's copy (the step after it; the latest 32) less that of the
    others (the latest 512), medians, so that a pause between two calls (an evaluation,
    a data stall) weighs no more than any other step. The interval is the
    larger of that CPU cost over `budget` of a step's CPU, and of the blocking over
    `budget` of a step's wall time. The calibrating window (every call saves, so no step
    is free of a save) falls back to the blocking plus the flash writer thread's CPU; the
    next window, `FIRST_RETUNE_CALLS` later, measures the whole cost. Saving every step,
    every `PROBE_CALLS`-th call skips its save so that the comparison stays possible.
    """

    def __init__(
        self, budget: float, writer_threads: str, persist_every_s: float = PERSIST_EVERY_S
    ) -> None:
        if not 0 < budget < 1:
            raise ValueError(f"save_budget must be in (0, 1), got {budget}")
        self.budget = budget
        self.writer_threads = writer_threads
        self.persist_every_s = persist_every_s
        self.every = 1
        self.persist_every = 0  # steps between persisted saves, agreed (0: none yet)
        self._persist_base = 0  # ... before rounding up to a multiple of the save interval
        self.persist_wanted = 0  # this rank's wish: persist_every_s over its step time
        self.calls = 0
        self.saves = 0
        self.blocked_s = 0.0  # of the saves of finished windows
        self.cost_s = 0.0  # the newest window's estimate of one save's cost (CPU s)
        self.step_cpu_s = 0.0  # and of one step's CPU without a save
        self._handles: list[Any] = []  # this window's saves (their blocked_s grows later)
        self._last: tuple[float, float] | None = None  # the previous call's (wall, CPU)
        self._prev_saved = False  # whether the previous call saved
        # this window's steps (time between calls): (wall s, CPU s, followed a save)
        self._steps: list[tuple[float, float, bool]] = []
        self._cpu0 = 0.0
        # CPU s of the latest steps that carried a save's copy, and of the others
        self._carried: collections.deque[float] = collections.deque(maxlen=32)
        self._free: collections.deque[float] = collections.deque(maxlen=512)

    def due(self, step: int) -> bool:
        """Whether the call for `step` saves (counts the call)."""
        self.calls += 1
        now = (time.perf_counter(), time.process_time())
        if self._last is None:
            self._cpu0 = _thread_cpu_s(self.writer_threads)
        else:
            self._steps.append((now[0] - self._last[0], now[1] - self._last[1], self._prev_saved))
        self._last, self._prev_saved = now, False
        if self.calls <= CALIBRATE_CALLS:
            return True
        if self.every == 1:  # all but every PROBE_CALLS-th, so some steps follow no save
            return self.calls % PROBE_CALLS != 0
        return step % self.every == 0

    def saved(self, handle: Any) -> None:
        if handle is not None:
            self._handles.append(handle)
            self.saves += 1
            self._prev_saved = True

    def _window_ends(self) -> bool:
        n = self.calls - CALIBRATE_CALLS
        return n == 0 or n == FIRST_RETUNE_CALLS or (n > 0 and n % RETUNE_CALLS == 0)

    def measure(self) -> int | None:
        """This rank's wanted interval when a window ends at this call, else None."""
        if not self._window_ends():
            return None
        cpu = _thread_cpu_s(self.writer_threads)
        steps, handles = self._steps, self._handles
        blocked = sum(h.blocked_s for h in handles)
        self.blocked_s += blocked
        self._handles, self._steps, self._cpu0, writer_cpu = [], [], cpu, cpu - self._cpu0
        free = [s for s in steps if not s[2]]
        if free:  # (not the calibrating window: its steps are the slower first ones)
            self._carried.extend(s[1] for s in steps if s[2])
            self._free.extend(s[1] for s in free)
        if self._carried and self._free:
            self.step_cpu_s = statistics.median(self._free)
            self.cost_s = max(0.0, statistics.median(self._carried) - self.step_cpu_s)
            wanted = save_interval(self.cost_s, self.step_cpu_s, self.budget)
            if free:
                wall = statistics.median(s[0] for s in free)
                self._wish_persist(wall)
                if handles:
                    blocking = save_interval(blocked / len(handles), wall, self.budget)
                    wanted = max(wanted, blocking)
            return wanted
        if not handles:  # nothing saved yet: nothing to learn
            return self.every
        # Every step followed a save (calibration): its blocking and the writer's CPU,
        # against the median time between calls less that cost.
        self.cost_s = (blocked + writer_cpu) / len(handles)
        gap = statistics.median(s[0] for s in steps) if steps else 0.0
        self._wish_persist(max(0.0, gap - self.cost_s))
        return save_interval(self.cost_s, max(0.0, gap - self.cost_s), self.budget)

    def _wish_persist(self, step_s: float) -> None:
        every = math.ceil(self.persist_every_s / step_s) if step_s > 0 else MAX_EVERY
        self.persist_wanted = max(1, every)

    def agreed(self, every: int, persist_every: int) -> None:
        """Take the intervals all ranks agreed on; persisted saves fall on saved steps (the
        persistence interval kept steady: `lifecycle.persist_steps`)."""
        self.every = every
        self._persist_base = lifecycle.persist_steps(self._persist_base, persist_every)
        self.persist_every = every * math.ceil(self._persist_base / every)

    def persist(self, step: int) -> bool:
        """Whether the save of `step` is one for the agent to persist."""
        return self.persist_every > 0 and step % self.persist_every == 0
