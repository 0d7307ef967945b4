"""What the dashboard shows: the pure core behind its JSON (no I/O, no clock of its own).

`Series` keeps bounded rings of what the heartbeats said (loss and step-time points, a
per-rank step-time heatmap); the `*_json` functions turn the folded job state, the live
view and the event ring into the rows and numbers the page draws. Every list is capped,
so a response stays small whatever the world size.
"""

from __future__ import annotations

import collections
import heapq
import math
import statistics
from collections.abc import Iterable
from typing import Any

from google.protobuf import text_format

from unbroken.driver import goodput as goodputlib
from unbroken.driver import state as statelib
from unbroken.driver.liveview import LiveView, NodeSlot
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

DETAIL_CHARS = 240  # characters of an event's one-line detail sent


def _num(x: float, digits: int = 4) -> float | None:
    """A JSON-safe number: NaN and infinities become null (JSON has no NaN)."""
    return round(x, digits) if math.isfinite(x) else None


class Series:
    """Bounded rings of what the heartbeats said over time (fed by the sampler).

    `points`: one per advance of the job's step: (unix time, step, mean loss of the ranks
    that report one, median and max step time). `columns`: one per sample: unix time, the
    median step time over every rank, and rank -> step-time ms for the `keep_ranks` slowest
    ranks of that moment (every rank in a world that small), where a rank that stopped
    progressing counts its time since its last step (so a hung rank turns as red as a slow
    one). Memory is bounded by points + columns x keep_ranks whatever the world size.
    """

    def __init__(self, points: int, columns: int, keep_ranks: int = 128) -> None:
        self.keep_ranks = keep_ranks
        self.points: collections.deque[tuple[float, int, float | None, float, float]] = (
            collections.deque(maxlen=points)
        )
        self.columns: collections.deque[tuple[float, float, dict[int, float]]] = collections.deque(
            maxlen=columns
        )
        self.step = 0  # the highest step of the last sample

    def sample(self, workers: Iterable[dpb.WorkerStatus], t_unix: float) -> None:
        """Add one sample of the workers of every alive node."""
        col: dict[int, float] = {}
        step = 0
        losses: list[float] = []
        times: list[float] = []
        isfinite = math.isfinite
        for w in workers:
            ws = w.step
            if ws <= 0 or w.global_rank < 0:
                continue
            if ws > step:
                step = ws
            ms = w.step_time_ms
            if ms > 0 and isfinite(ms):
                times.append(ms)
                col[w.global_rank] = max(ms, w.since_progress_ms)
            if w.has_loss and isfinite(w.loss):
                losses.append(w.loss)
        self.step = step
        if col:
            med = statistics.median(col.values())
            if len(col) > self.keep_ranks:
                col = dict(heapq.nlargest(self.keep_ranks, col.items(), key=lambda kv: kv[1]))
            self.columns.append((t_unix, med, col))
        if not step:
            return
        while self.points and self.points[-1][1] > step:  # restored to an earlier step
            self.points.pop()
        if self.points and self.points[-1][1] == step:
            return
        loss = statistics.fmean(losses) if losses else None
        med_t = statistics.median(times) if times else math.nan
        self.points.append((t_unix, step, loss, med_t, max(times, default=math.nan)))

    def curves(self, after_t: float | None = None) -> dict[str, Any]:
        """The loss and step-time curves as parallel arrays: every point (`full`), or only
        those after the point at time `after_t` (as sent: rounded to ms) when the rings
        still hold it. A page that sends its newest point's time gets the new points only;
        after a restore rewound the curves, or from another driver, it gets them whole."""
        points = list(self.points)
        full = True
        if after_t is not None:
            for i in range(len(points) - 1, -1, -1):
                if round(points[i][0], 3) == after_t:
                    points, full = points[i + 1 :], False
                    break
        return {
            "full": full,
            "max_points": self.points.maxlen,
            "t": [round(p[0], 3) for p in points],
            "step": [p[1] for p in points],
            "loss": [None if p[2] is None else _num(p[2], 6) for p in points],
            "step_ms": [_num(p[3], 2) for p in points],
            "step_ms_max": [_num(p[4], 2) for p in points],
        }

    def heatmap(self, max_ranks: int, slow_ratio: float) -> dict[str, Any]:
        """Ranks x time of step time, with each rank's median ratio to its column's median.

        Returns:
            `ranks` (sorted; the `max_ranks` slowest when there are more), `t` per column,
            `ms` as rows (rank) of columns (null: no report), `median` per column, `ratio`
            per rank, and `slow`: the ranks whose ratio exceeds `slow_ratio`.
        """
        ratios: dict[int, list[float]] = collections.defaultdict(list)
        for _, med, col in self.columns:
            if len(col) < 2 or not med > 0:
                continue
            for r, v in col.items():
                ratios[r].append(v / med)
        all_ranks = {r for _, _, col in self.columns for r in col}
        ratio = {r: statistics.median(ratios[r]) if ratios[r] else 1.0 for r in all_ranks}
        ranks = sorted(all_ranks)
        if len(ranks) > max_ranks:
            ranks = sorted(sorted(ranks, key=lambda r: -ratio[r])[:max_ranks])
        return {
            "ranks": ranks,
            "t": [round(t, 3) for t, _, _ in self.columns],
            "median": [_num(med, 1) for _, med, _ in self.columns],
            "ms": [
                [_num(col[r], 1) if r in col else None for _, _, col in self.columns] for r in ranks
            ],
            "ratio": [_num(ratio[r], 3) for r in ranks],
            "slow": [r for r in ranks if ratio[r] > slow_ratio],
        }


_STATE_ORDER = {"lost": 0, "evicted": 1, "active": 2, "spare": 3, "alive": 4}


def node_display_state(rec: ev.NodeRecord | None, slot: NodeSlot | None, *, live: bool) -> str:
    """What the page shows for a node: alive, lost, evicted, spare, or active (no live data).

    Args:
        rec: the node's record in the folded state (None: only the live view knows it).
        slot: its live-view slot (None: this driver has not heard from it).
        live: whether this driver has a live view (the leader); a standby knows only the log.
    """
    state = rec.state if rec is not None else ev.NODE_STATE_UNSPECIFIED
    if state == ev.NODE_STATE_EVICTED:
        return "evicted"
    if live and slot is not None:
        if not slot.alive:
            return "lost"
        return "spare" if state == ev.NODE_STATE_SPARE else "alive"
    return {ev.NODE_STATE_LOST: "lost", ev.NODE_STATE_SPARE: "spare"}.get(state, "active")


def node_json(
    node_id: str, rec: ev.NodeRecord | None, slot: NodeSlot | None, shown: str, now: float
) -> dict[str, Any]:
    """One node row of the page."""
    workers = [w for w in slot.hb.workers if w.step > 0] if slot is not None else []
    times = [w.step_time_ms for w in workers if w.step_time_ms > 0]
    losses = [w.loss for w in workers if w.has_loss]
    info = slot.info if slot is not None else None
    return {
        "id": node_id,
        "state": shown,
        "hostname": rec.hostname if rec is not None else info.hostname if info else "",
        "ip": rec.ip if rec is not None else info.ip if info else "",
        "epoch": slot.epoch if slot is not None and slot.epoch else rec.epoch if rec else 0,
        "workers": rec.num_workers if rec is not None else info.num_workers if info else 0,
        "ranks": sorted(w.global_rank for w in workers if w.global_rank >= 0),
        "step": max((w.step for w in workers), default=0),
        "loss": _num(losses[-1], 6) if losses else None,
        "step_ms": _num(statistics.median(times), 2) if times else None,
        "silent_ms": (
            _num((now - slot.last_seen) * 1000.0, 1)
            if slot is not None and slot.last_seen
            else None
        ),
        "failures": rec.failures if rec is not None else 0,
        "connected": slot is not None and slot.outbox is not None,
    }


def node_rows(
    state: ev.JobState, view: LiveView, *, live: bool, now: float, max_nodes: int
) -> tuple[list[dict[str, Any]], dict[str, int], int]:
    """The node rows (by id; lost and evicted nodes first when over `max_nodes`), the count
    of nodes per shown state, and the number of nodes."""
    slots = view.nodes if live else {}
    ids = set(state.nodes) | set(slots)
    shown = {i: node_display_state(state.nodes.get(i), slots.get(i), live=live) for i in ids}
    picked = sorted(ids)
    if len(picked) > max_nodes:
        picked = sorted(sorted(ids, key=lambda i: (_STATE_ORDER[shown[i]], i))[:max_nodes])
    rows = [node_json(i, state.nodes.get(i), slots.get(i), shown[i], now) for i in picked]
    return rows, dict(collections.Counter(shown.values())), len(ids)


def event_json(e: ev.Event) -> dict[str, Any]:
    """One timeline entry: seq, wall time, kind and a one-line, truncated detail."""
    kind = e.WhichOneof("payload") or "?"
    detail = text_format.MessageToString(getattr(e, kind), as_one_line=True) if kind != "?" else ""
    out: dict[str, Any] = {
        "seq": e.seq,
        "t": e.wall_time_unix_ns // 1_000_000,
        "kind": kind,
        "detail": detail[:DETAIL_CHARS],
        "cause": e.cause[:64],
    }
    if kind == "straggler_suspected":  # the heatmap marks the node's ranks
        out["node"] = e.straggler_suspected.node_id
        out["slowdown"] = _num(e.straggler_suspected.slowdown, 3)
    return out


def stragglers_json(events: Iterable[dict[str, Any]], world: ev.WorldLayout) -> dict[str, float]:
    """Nodes of the current world the straggler detector named since the world last changed,
    with their slowdown (the newest), from the page's event ring."""
    in_world = set(world.node_ids)
    out: dict[str, float] = {}
    for e in events:
        if e["kind"] in ("job_started", "world_resized"):
            out.clear()  # a new world: earlier suspicions were acted on or are stale
        elif e["kind"] == "straggler_suspected" and e.get("node") in in_world:
            out[e["node"]] = e["slowdown"]
    return out


def rank_nodes(ranks: Iterable[int], world: ev.WorldLayout) -> list[str]:
    """The node of each global rank in `world` ("" when the world does not place it)."""
    wpn, nodes = world.workers_per_node, list(world.node_ids)
    return [nodes[r // wpn] if wpn and 0 <= r // wpn < len(nodes) else "" for r in ranks]


def world_json(w: ev.WorldLayout) -> dict[str, Any]:
    """The parallel layout and the node order of a world."""
    return {
        "dp": w.dp,
        "pp": w.pp,
        "tp": w.tp,
        "nodes": list(w.node_ids),
        "workers_per_node": w.workers_per_node,
    }


def state_json(
    state: ev.JobState | None,
    view: LiveView,
    *,
    live: bool,
    now: float,
    max_nodes: int,
) -> dict[str, Any]:
    """The job's overview, nodes and checkpoints from its folded state and the live view."""
    st = state if state is not None else statelib.initial("")
    nodes, counts, total = node_rows(st, view, live=live, now=now, max_nodes=max_nodes)
    return {
        "phase": ev.Phase.Name(st.phase).removeprefix("PHASE_").lower(),
        "step": st.step,
        "last_seq": st.last_seq,
        "leader": st.leader,
        "leader_term": st.leader_term,
        "incident": {
            "id": st.incident_id,
            "cause": st.incident_cause,
            "suspects": list(st.suspects),
            "bad_nodes": list(st.bad_nodes),
            "failed_restores": st.failed_restores,
        },
        "finished_reason": st.finished_reason,
        "awaiting_nodes": st.awaiting_nodes,
        "world": world_json(st.world),
        "trainer": st.trainer,
        "counts": counts,
        "nodes_total": total,
        "nodes": nodes,
        "checkpoints": [
            {"step": c.step, "bytes": c.bytes, "uri": c.uri, "seq": c.seq, "verified": c.verified}
            for c in reversed(st.checkpoints)
        ],
        "verified_steps": list(st.verified_steps),  # docs/sdc.md
        "sdc_suspected": st.sdc_suspected,
        "event_counts": dict(st.event_counts),
        "goodput": _goodput_json(st, view),
    }


def _goodput_json(st: ev.JobState, view: LiveView) -> dict[str, Any]:
    gp = goodputlib.goodput_now(st, view)
    return {
        "ratio": round(gp.ratio, 4),
        "wall_s": round(gp.wall_s, 1),
        "lost_s": {k: round(v, 1) for k, v in gp.lost_s_by_cause.items()},
        "badput_s": {
            k: round(gp.lost_s_by_category[k], 1)
            for k in goodputlib.CATEGORIES
            if k in gp.lost_s_by_category
        },
    }
