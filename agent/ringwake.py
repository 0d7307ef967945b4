"""Wake the agent's flash loop the moment a local rank's copy is whole (`RingWake`).

A copy's replica goes to the buddy from the flash loop's scan. That scan ran when a worker
reported its next step (`NodeFlash.poke`) or at the poll timer, while the copy itself is
whole early in the next step (its tensors are copied while that step's forward runs): the
replica left most of a step later than it could, and a node lost in that gap restored its
ranks a step further back. inotify(7) says when a manifest is renamed into place
(`write_manifest`), which is when a copy becomes whole; a directory that cannot be watched
(no inotify, the instance limit reached) keeps the step-report wake and the timer.

A wake the sender could not act on is deferred, not dropped: while the sends' duty
(`ReplicaSender.cheap_in`) holds the next send back, the wake comes when it may go, once,
however many copies were made meanwhile (steps of a few milliseconds would otherwise wake
the loop for every save, each scan costing the host CPU the training wants).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

from unbroken.recovery.manifestwatch import MADE_WHOLE, ManifestWatch


class RingWake:
    """Sets `wake` (an event of the running loop) when a copy is made whole in one of the
    watched ring directories, or `ready_in()` seconds later when that is not 0 (the time
    until a send may go). Used on the flash thread's loop only."""

    def __init__(self, wake: asyncio.Event, ready_in: Callable[[], float] = lambda: 0.0) -> None:
        self._wake = wake
        self._ready_in = ready_in
        self._watches: dict[Path, ManifestWatch] = {}
        self._later: asyncio.TimerHandle | None = None
        self.woken = 0  # wakes for a whole copy, at once or deferred (tests, metrics)

    def watch(self, dirs: Iterable[Path]) -> None:
        """Watch exactly `dirs` (the local ranks' rings now): new ones added, others
        dropped. A directory replaced or removed since drops out and is watched again
        here while it is listed."""
        loop = asyncio.get_running_loop()
        want = set(dirs)
        for d in [d for d in self._watches if d not in want]:
            self._drop(loop, d)
        for d in want.difference(self._watches):
            w = ManifestWatch.open(d, MADE_WHOLE)
            if w is None:
                continue
            self._watches[d] = w
            loop.add_reader(w.fileno(), self._read, d)

    def watched(self) -> list[Path]:
        return sorted(self._watches)

    def _read(self, d: Path) -> None:
        w = self._watches.get(d)
        if w is None:
            return
        named = w.changed()
        if named is None:  # the directory went away or the queue overflowed
            self._drop(asyncio.get_running_loop(), d)
            self._wake.set()  # a scan now says what is there
        elif named and self._later is None:
            delay = self._ready_in()
            if delay <= 0:
                self._fire()
            else:
                self._later = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._later = None
        self.woken += 1
        self._wake.set()

    def _drop(self, loop: asyncio.AbstractEventLoop, d: Path) -> None:
        w = self._watches.pop(d)
        loop.remove_reader(w.fileno())
        w.close()

    def close(self) -> None:
        """Drop every watch and a deferred wake (on the loop that made them)."""
        if self._later is not None:
            self._later.cancel()
            self._later = None
        loop = asyncio.get_running_loop()
        for d in list(self._watches):
            self._drop(loop, d)
