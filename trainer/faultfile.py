"""The worker fault file: faults injected into a running job reach the trainer through it.

`unbroken inject nan|loss-spike --node N [--step S]` makes the node's agent write a
`WorkerFault` atomically to the file its workers find in `UNBROKEN_FAULT_FILE`. A trainer
reads it once a step with `FaultFile.due` (one `os.stat`); the embedded engine
(`unbroken.trainer.run`) and the hooks SDK (`hooks.injected_fault`, which the adapters
use) both do. Pure Python: importing it imports neither torch nor gRPC.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from unbroken.common.faults import SLOW_FILE, WorkerFault, parse_slow_factor
from unbroken.common.workerenv import WorkerEnv

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class FaultFile:
    """Watches the fault file (one `os.stat` per step) and yields each fault once.

    Applied ids are appended to `<file>.applied-r<rank>`, so a worker restarted after the
    rollback the fault caused does not apply it again. `rank` is the worker's slot on the
    node whose file it is (its LOCAL_RANK, see `from_env`), not its global rank: a world
    that shrank gives the node's worker another global rank, and under that rank's empty
    marks a loss spike injected before it fired again at the first step after the restore
    (bench-recovery, the replica policy: a second rollback, to a checkpoint 1,100 steps
    back).
    """

    path: Path
    rank: int
    applied: set[str] = field(default_factory=set)
    pending: WorkerFault | None = None
    _seen: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        with contextlib.suppress(OSError):
            self.applied.update(self._marks().read_text().split())

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> FaultFile | None:
        """The fault file named by `UNBROKEN_FAULT_FILE`, or None; its marks are those of
        the worker's LOCAL_RANK (`rank` where that is not set)."""
        e = os.environ if env is None else env
        raw = WorkerEnv.from_env(e).fault_file
        try:
            slot = int(e.get("LOCAL_RANK", rank))
        except ValueError:
            slot = rank
        return cls(path=Path(raw), rank=slot) if raw else None

    def _marks(self) -> Path:
        return self.path.with_name(f"{self.path.name}.applied-r{self.rank}")

    def due(self, next_step: int) -> WorkerFault | None:
        """The fault to apply to `next_step` (marked applied), or None."""
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        key = (st.st_ino, st.st_mtime_ns, st.st_size) if st is not None else None
        if key is not None and key != self._seen:
            self._seen = key
            try:
                fault = WorkerFault.parse(self.path.read_text())
            except (OSError, ValueError) as e:
                log.warning("fault file ignored", path=str(self.path), error=str(e))
            else:
                if fault.id not in self.applied:
                    self.pending = fault
        f = self.pending
        if f is None or f.step > next_step:
            return None
        self.pending = None
        self.applied.add(f.id)
        with contextlib.suppress(OSError), open(self._marks(), "a") as out:
            out.write(f.id + "\n")
        return f


@dataclass(slots=True)
class SlowFile:
    """The node's injected compute slowdown (`unbroken inject slow-train --factor F`).

    The agent writes `{"factor": F}` atomically next to the fault file; unlike the one-shot
    faults it lasts (a slow machine stays slow) until a factor of 1 is written. One
    `os.stat` per step.
    """

    path: Path
    factor: float = 1.0
    _seen: tuple[int, int, int] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlowFile | None:
        """The slow file beside the one `UNBROKEN_FAULT_FILE` names, or None."""
        raw = WorkerEnv.from_env(os.environ if env is None else env).fault_file
        return cls(path=Path(raw).with_name(SLOW_FILE)) if raw else None

    def current(self) -> float:
        """The factor now in force (1.0: none)."""
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self.factor = None, 1.0
            return self.factor
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._seen:
            self._seen = key
            try:
                self.factor = parse_slow_factor(self.path.read_text())
            except (OSError, ValueError) as e:
                log.warning("slow file ignored", path=str(self.path), error=str(e))
        return self.factor
