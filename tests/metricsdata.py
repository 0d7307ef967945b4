"""Metrics the tests render: a driver's and an agent's registries with realistic values,
and the packaged Grafana dashboard's queries (tests/unit/test_grafana.py,
tests/integration/test_promql.py)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from unbroken.agent.metrics import AgentMetrics
from unbroken.driver.goodput import Goodput
from unbroken.driver.liveview import LiveView, LiveViewConfig
from unbroken.driver.metrics import DriverMetrics
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev


def driver_metrics(
    *,
    leader: bool = True,
    phase: int = ev.PHASE_RUNNING,
    lost_node: bool = False,
    awaiting: bool = False,
) -> DriverMetrics:
    """A driver's registry over a live view of one node with two workers (and, with
    `lost_node`, a second node lost), after a few recorded events."""
    view = LiveView(LiveViewConfig())
    slot = view.slot("n0")
    view.mark_alive(slot, 100.0)
    hb = dpb.Heartbeat(seq=1)
    hb.workers.add(local_rank=0, step=7, median_step_ms=250.0, loss=2.5, has_loss=True)
    hb.workers.add(local_rank=1, step=7, step_time_ms=300.0, restarts=1)
    view.beat(slot, hb, 100.5)
    if lost_node:
        lost = view.slot("n1")
        view.mark_alive(lost, 100.0)
        view.mark_lost(lost)
    m = DriverMetrics(  # the phase is the journal's state's, read at scrape time
        lambda: {
            "leader": leader,
            "heartbeats": 3,
            "nodes": {"alive": 1, "lost": int(lost_node)},
            "events": 4,
            "dropped": 0,
            "phase": phase,
            "awaiting_nodes": awaiting,
            "goodput": Goodput(0.9, 100.0, {"node_lost": 10.0}, {"restore": 10.0}),
            "persist_every_s": 182.0,
            "newest_commit_age_s": 41.0,
        }
    )
    listeners: list[Any] = []
    m.watch(view, listeners, lambda: 101.0)
    t0 = 1_000_000_000_000
    for e in (
        ev.Event(wall_time_unix_ns=t0, training_resumed=ev.TrainingResumed()),
        ev.Event(
            wall_time_unix_ns=t0 + 1,
            recovery_transition=ev.RecoveryTransition(
                from_phase=ev.PHASE_RUNNING, to_phase=ev.PHASE_SUSPECTED, incident_id="i1"
            ),
        ),
        ev.Event(
            wall_time_unix_ns=t0 + 2,
            recovery_transition=ev.RecoveryTransition(
                from_phase=ev.PHASE_SUSPECTED, to_phase=ev.PHASE_PAUSED, incident_id="i1"
            ),
        ),
        ev.Event(
            wall_time_unix_ns=t0 + 3_000_000_001,
            training_resumed=ev.TrainingResumed(mode="in_job"),
        ),
        ev.Event(checkpoint_committed=ev.CheckpointCommitted(step=6, bytes=1234, ranks=2)),
        ev.Event(step_verified=ev.StepVerified(step=6, ranks=2, groups=1)),
    ):
        for fn in listeners:
            fn(e)
    m.detect_latency.observe(0.3)
    return m


def agent_metrics() -> AgentMetrics:
    m = AgentMetrics(
        lambda: {
            "connected": True,
            "term": 3,
            "shards_persisted": 2,
            "persisted_bytes": 1000,
            "replicas_sent": 1,
            "replica_bytes_sent": 500,
            "replica_send_failures": 2,
            "replicas_received": 1,
            "replicas_refused": 0,
            "warm_starts": 1,
            "cold_starts": 1,
        }
    )
    hb = dpb.Heartbeat(seq=1)
    hb.workers.add(
        local_rank=0, step=7, median_step_ms=250.0, loss=2.5, has_loss=True,
        state=dpb.WORKER_STATE_RUNNING,
    )  # fmt: skip
    hb.workers.add(local_rank=1, step=7, step_time_ms=300.0, restarts=1)
    m.sent(hb)
    return m


def dashboard() -> dict[str, Any]:
    """The packaged Grafana dashboard (driver/grafana/unbroken.json)."""
    text = resources.files("unbroken.driver").joinpath("grafana/unbroken.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def exprs(panels: list[dict[str, Any]]) -> list[str]:
    """Every query of `panels` (rows' nested panels included)."""
    out: list[str] = []
    for p in panels:
        out.extend(t["expr"] for t in p.get("targets", []))
        out.extend(exprs(p.get("panels", [])))
    return out
