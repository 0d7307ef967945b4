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

Time lost inside the training loop is priced at query time too: the ranks report the
shares of their recent wall time spent blocked on checkpoint saves and waiting for data
(`WorkerStatus.checkpoint_save_share`, `data_loading_share`); the medians over a sample of
nodes, times the time that trained, are `checkpoint_save` and `data_loading`. They are the
recent shares applied to the whole run: a job whose save or loader cost changed over its
life is charged at today's.

Both breakdowns sum to the same lost time. The categories map onto Google's
ml-goodput-measurement badput (docs/goodput.md): detection + pause + redone steps are its
"wasted progress from disruption", restart and startup its "program startup", restore its
"checkpoint restore", checkpoint_save and data_loading its own two.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from unbroken.driver.liveview import LiveView
from unbroken.proto import events_pb2 as ev

SAMPLE_NODES = 64  # nodes whose workers' median step time make the live median
#: What lost time was spent on, in the order a recovery goes through them.
CATEGORIES = (
    "startup", "detection", "pause", "diagnosis", "restart", "restore", "steps_redone",
    "checkpoint_save", "data_loading",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Goodput:
    ratio: float  # -1 before training began
    wall_s: float
    lost_s_by_cause: dict[str, float] = field(default_factory=dict)
    lost_s_by_category: dict[str, float] = field(default_factory=dict)  # same sum

    @property
    def lost_s(self) -> float:
        return sum(self.lost_s_by_cause.values())


@dataclass(frozen=True, slots=True)
class LiveInputs:
    """What the live view says about the time inside the loop (each 0 when unknown)."""

    step_s: float = 0.0  # median step time
    save_share: float = 0.0  # median share of wall time blocked on checkpoint saves
    data_share: float = 0.0  # ...and waiting for data


def live_inputs(view: LiveView) -> LiveInputs:
    """The live median step time and in-loop shares over a sample of alive nodes."""
    times: list[float] = []
    save: list[float] = []
    data: list[float] = []
    for slot in view.heard():
        if len(times) >= SAMPLE_NODES * 8:
            break
        for w in slot.hb.workers:
            if w.median_step_ms > 0:
                times.append(w.median_step_ms)
                save.append(w.checkpoint_save_share)
                data.append(w.data_loading_share)
    if not times:
        return LiveInputs()
    return LiveInputs(
        statistics.median(times) / 1000.0, statistics.median(save), statistics.median(data)
    )


def goodput_now(state: ev.JobState, view: LiveView) -> Goodput:
    """The job's goodput now, priced from the live view."""
    live = live_inputs(view)
    return goodput(state, time.time_ns(), live.step_s, live)


def goodput(
    state: ev.JobState, now_ns: int, step_s: float, live: LiveInputs | None = None
) -> Goodput:
    """The job's goodput at `now_ns` (wall clock), redone steps priced at `step_s`, the time
    lost inside the loop at `live`'s shares (none without it)."""
    live = live or LiveInputs(step_s=step_s)
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
    # the time that trained, less what the loop spent saving and loading data in it
    trained = max(0.0, wall - sum(lost.values()))
    for cat, share in (("checkpoint_save", live.save_share), ("data_loading", live.data_share)):
        if share > 0:
            lost[cat] = cats[cat] = trained * min(1.0, share)
    ratio = max(0.0, min(1.0, (wall - sum(lost.values())) / wall))
    return Goodput(ratio, wall, lost, cats)
