"""What the recovery machine (driver/machine.py) decides on and what it decides.

Observations beside events (`Paused`), the actions the shell performs (driver/loop.py
`PERFORMERS` has one performer per `Action`) and the machine's `Decision`. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from unbroken.proto import events_pb2 as ev

Phase: TypeAlias = ev.Phase


# ---------------------------------------------------------------- observations
@dataclass(frozen=True, slots=True)
class Paused:
    """Progress report: every reachable agent of the world stopped its workers (each rank's
    last step is in its flash ring: workers flash-save every step).

    `step` is the step the workers stopped at; `restorable_step` the newest step every
    rank of the world can obtain (memory, buddy or storage; `recovery.restore`), or None
    when unknown (then the newest committed checkpoint at or before `step` is used).
    """

    step: int
    restorable_step: int | None = None
    memory_steps: frozenset[int] = frozenset()  # every rank holds these in its ring now


Observation = ev.Event | Paused


# ---------------------------------------------------------------- actions
@dataclass(frozen=True, slots=True)
class Layout:
    """A world layout: dp x pp x tp ranks on `node_ids` (node order = rank order)."""

    dp: int
    pp: int
    tp: int
    node_ids: tuple[str, ...]
    workers_per_node: int

    @staticmethod
    def of(w: ev.WorldLayout) -> Layout:
        """The layout of a `WorldLayout` message."""
        return Layout(w.dp, w.pp, w.tp, tuple(w.node_ids), w.workers_per_node)

    def to_proto(self) -> ev.WorldLayout:
        """As the event message."""
        return ev.WorldLayout(
            dp=self.dp,
            pp=self.pp,
            tp=self.tp,
            node_ids=list(self.node_ids),
            workers_per_node=self.workers_per_node,
        )

    @property
    def world_size(self) -> int:
        """Ranks in the world."""
        return self.dp * self.pp * self.tp


@dataclass(frozen=True, slots=True)
class StopWorkers:
    """Send StopWorkers to every node (idempotent: a stopped worker stays stopped). The
    workers flash-save every step, so stopping them loses nothing a pause would keep.

    `in_job`: stop only `replace` ((node, local rank) of the faulty ranks) and hold every
    other worker in its process; otherwise stop every worker.
    """

    nodes: tuple[str, ...]
    reason: str
    in_job: bool = False
    replace: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class RunDiagnosis:
    """Run the bisection over `nodes` with `suspects` first; report `diagnosis_id`."""

    diagnosis_id: str
    suspects: tuple[str, ...]
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EvictNode:
    """Send Evict to a node (a node without a session is skipped)."""

    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class StartWorkers:
    """Start the world's workers; `rank_base` is each node's global rank of local rank 0."""

    world: Layout
    rank_base: tuple[tuple[str, int], ...]
    in_job: bool = False  # held workers rejoin in their processes; only the rest start


@dataclass(frozen=True, slots=True)
class Restore:
    """Restore every rank at `step`; `sources` are the preferred sources, best first.

    The agents' survey (`unbroken.recovery.restore.decide`) falls back from a preferred
    source that turns out to be missing. (`incident_id`, `attempt`) identifies the restore
    so a re-sent command is recognised.
    """

    step: int
    sources: tuple[tuple[int, str], ...]
    reshard: bool
    incident_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class ResumeAll:
    """Send Resume(at_step) to every node (a running worker ignores it)."""

    step: int
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopAll:
    """Stop every worker of `nodes` (the job failed; or a replica sits out of the world)."""

    nodes: tuple[str, ...]


Action = StopWorkers | RunDiagnosis | EvictNode | StartWorkers | Restore | ResumeAll | StopAll


@dataclass(frozen=True, slots=True)
class Decision:
    """What `decide` wants: events to append (in order), then actions to perform."""

    events: tuple[ev.Event, ...]
    actions: tuple[Action, ...]
    phase: Phase  # the phase once `events` are folded
    note: str = ""  # why an observation was ignored, for the log
