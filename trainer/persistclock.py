"""When a worker marks a flash save for persistence: the clock every rank agrees on.

Split from trainer/flashckpt.py (the saves and the restore); trainer/run.py builds one per
rank from the interval the agent passed (`persist_every_s_from_env`).
"""

from __future__ import annotations

import collections
import math
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import structlog
import torch.distributed as dist

from unbroken.common.workerenv import WorkerEnv
from unbroken.recovery import lifecycle
from unbroken.recovery.sources import PERSIST_EVERY_S

log = structlog.get_logger(__name__)

CALIBRATE_CALLS = 8  # calls before the first agreement (the first steps are slow)
AGREE_CALLS = 128  # calls between agreements


def persist_every_s_from_env(env: Mapping[str, str] | None = None) -> float:
    """The persistence interval the agent passed (seconds), else `PERSIST_EVERY_S`."""
    every = WorkerEnv.from_env(os.environ if env is None else env).persist_every_s
    return PERSIST_EVERY_S if every is None else every


class PersistClock:
    """Which saves the agent persists: about one per `every_s`, the same steps on every rank.

    Every rank must mark the same steps (a commit needs every rank's shard of one step), so
    the interval is counted in steps and agreed collectively: at the `CALIBRATE_CALLS`-th
    call and every `AGREE_CALLS` calls after, each rank turns `every_s` into steps with its
    median step time and the ranks take the smallest wish (the slowest rank's steps are
    the longest, so the most frequent persistence any rank wants), kept steady
    (`lifecycle.persist_steps`: a few values an octave, moved only past 30 %) since the
    persisted steps are its multiples. Calls are counted, not timed, so the ranks agree at
    the same call. The first save of a job that starts from
    nothing is persisted too (every rank of a world starts together), so storage is proven
    and a step is committed one step in. A process that restored does not persist its first
    save: what it restored is committed or in every rank's ring, and a spare replacing a
    lost node fetches that node's copies from the replica server holding them (one commit
    per restart would be most of the commits of a job that sees a fault every few minutes).
    """

    def __init__(self, every_s: float, agree: Any = None, *, persist_first: bool = True) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.every_s = every_s
        self.persist_first = persist_first  # the run.py loop clears it after a restore
        self.every_steps = 0  # agreed; 0: not yet
        self.calls = 0
        self._agree = agree if agree is not None else _agree_min
        self._last: float | None = None
        self._times: collections.deque[float] = collections.deque(maxlen=AGREE_CALLS)

    def due(self, step: int) -> bool:
        """Whether the save of `step` is persisted (counts the call; collective now and then)."""
        now = time.perf_counter()
        if self._last is not None:
            self._times.append(now - self._last)
        self._last = now
        self.calls += 1
        if self.calls == CALIBRATE_CALLS or (
            self.calls > CALIBRATE_CALLS and (self.calls - CALIBRATE_CALLS) % AGREE_CALLS == 0
        ):
            step_s = statistics.median(self._times) if self._times else 0.0
            wish = max(1, math.ceil(self.every_s / step_s)) if step_s > 0 else 1
            agreed = lifecycle.persist_steps(self.every_steps, int(self._agree(wish)))
            if agreed != self.every_steps:
                log.info(
                    "persist.every",
                    steps=agreed,
                    every_s=self.every_s,
                    step_s=round(step_s, 4),
                    wish=wish,
                    at_step=step,
                )
            self.every_steps = agreed
        if self.calls == 1 and self.persist_first:
            return True  # a job's first save persists: storage proven, a step committed
        return self.every_steps > 0 and step % self.every_steps == 0


def _agree_min(wish: int) -> int:
    """The smallest wish of any rank (collective)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wish)
    return min(int(w) for w in everyone)
