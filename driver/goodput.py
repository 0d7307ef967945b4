"""Goodput: the share of a job's wall time that trained, from the log and the live view.

The one figure the project exists to raise. The event log's fold keeps a ledger
(`JobState.goodput`, driver/state.py): when training began, its start-up (JobStarted to
the TrainingStepping that says every rank stepped), each incident's downtime (the fault's
own silence before it was declared, then the first transition out of RUNNING to the
TrainingResumed that closed it, on the events' own wall times) by the fault kind that opened
it and by what the time was spent on (`CATEGORIES`), and the steps trained again after
restores: from the step the ranks said they restored, not the plan's. At query time the
open incident's time so far is added, and the redone steps are priced at the live median
step time. Every leader folds the same ledger, so the figure survives a failover.

Both breakdowns sum to the same lost time. The categories map onto Google's
ml-goodput-measurement badput (docs/goodput.md): detection + pause + redone steps are its
"wasted progress from disruption", restart and startup its "program startup", restore its
"checkpoint restore". A flash save's copy and the data loader's waits happen inside a step
and are part of the step time, which the ledger counts as productive.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from unbroken.driver.liveview import LiveView
from unbroken.proto import events_pb2 as ev

SAMPLE_NODES = 64  # nodes whose workers' median step time make the live median
#: What lost time was spent on, in the order a recovery goes through them.
CATEGORIES = ("startup", "detection", "pause", "diagnosis", "restart", "restore", "steps_redone")


@dataclass(frozen=True, slots=True)
class Goodput:
    ratio: float  # -1 before training began
    wall_s: float
    lost_s_by_cause: dict[str, float] = field(default_factory=dict)
    lost_s_by_category: dict[str, float] = field(default_factory=dict)  # same sum

    @property
    def lost_s(self) -> float:
        return sum(self.lost_s_by_cause.values())


def median_step_s(view: LiveView) -> float:
    """The live median step time over a sample of alive nodes (0 when unknown)."""
    times: list[float] = []
    for slot in view.order.values():
        if len(times) >= SAMPLE_NODES * 8:
            break
        times.extend(w.median_step_ms for w in slot.hb.workers if w.median_step_ms > 0)
    return statistics.median(times) / 1000.0 if times else 0.0


def goodput(state: ev.JobState, now_ns: int, step_s: float) -> Goodput:
    """The job's goodput at `now_ns` (wall clock), redone steps priced at `step_s`."""
    g = state.goodput
    if not g.started_ns or now_ns <= g.started_ns:
        return Goodput(-1.0, 0.0)
    wall = (now_ns - g.started_ns) / 1e9
    lost = dict(g.lost_s_by_cause)
    cats = dict(g.lost_s_by_category)
    if g.startup_open:
        spent = max(0, now_ns - g.started_ns) / 1e9
        lost["startup"] = lost.get("startup", 0.0) + spent
        cats["startup"] = cats.get("startup", 0.0) + spent
    if g.incident_began_ns:
        cause = g.incident_cause or "other"
        lost[cause] = lost.get(cause, 0.0) + max(0, now_ns - g.incident_began_ns) / 1e9
        cat = g.segment_category or "pause"
        since = g.segment_began_ns or g.incident_began_ns
        cats[cat] = cats.get(cat, 0.0) + max(0, now_ns - since) / 1e9
    if g.steps_redone and step_s > 0:
        lost["steps_redone"] = cats["steps_redone"] = g.steps_redone * step_s
    ratio = max(0.0, min(1.0, (wall - sum(lost.values())) / wall))
    return Goodput(ratio, wall, lost, cats)
