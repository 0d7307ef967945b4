"""The Grafana dashboard and the metrics table agree with what the driver really exports.

`METRICS` (driver/metrics.py) is the list the README and the dashboard are written against.
These tests (1) render a real `DriverMetrics` registry over a live view with one node and
two workers and a few appended events, and check that the exposition holds exactly the
series `METRICS` names, with their types and labels; (2) load the packaged dashboard JSON
and check that every query references only metrics that exist.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from unbroken.agent.metrics import AGENT_METRICS, AgentMetrics
from unbroken.driver.goodput import Goodput
from unbroken.driver.liveview import LiveView, LiveViewConfig
from unbroken.driver.metrics import METRICS, DriverMetrics
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

HIST_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
NAME = re.compile(r"\bunbroken_[a-z0-9_]+\b")


def _metrics() -> DriverMetrics:
    view = LiveView(LiveViewConfig())
    slot = view.slot("n0")
    view.mark_alive(slot, 100.0)
    hb = dpb.Heartbeat(seq=1)
    hb.workers.add(local_rank=0, step=7, median_step_ms=250.0, loss=2.5, has_loss=True)
    hb.workers.add(local_rank=1, step=7, step_time_ms=300.0, restarts=1)
    view.beat(slot, hb, 100.5)
    m = DriverMetrics(  # the phase is the journal's state's, read at scrape time
        lambda: {
            "heartbeats": 3,
            "nodes": {"alive": 1, "lost": 0},
            "events": 4,
            "dropped": 0,
            "phase": ev.PHASE_RUNNING,
            "goodput": Goodput(0.9, 100.0, {"node_lost": 10.0}),
            "persist_every_s": 182.0,
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
    ):
        for fn in listeners:
            fn(e)
    m.detect_latency.observe(0.3)
    return m


def _exposed(m: DriverMetrics) -> dict[str, Any]:
    text = generate_latest(m.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_table_matches_the_exposition() -> None:
    fams = _exposed(_metrics())
    exposed: dict[str, tuple[str, set[str]]] = {}
    for f in fams.values():
        for s in f.samples:
            if s.name.endswith("_created"):
                continue
            base = f.name if f.type == "histogram" else s.name
            labels = set(s.labels) - {"le"}
            exposed.setdefault(base, (f.type, set()))[1].update(labels)
    assert set(exposed) == set(METRICS), set(exposed) ^ set(METRICS)
    for name, (kind, labels) in exposed.items():
        want_kind, want_labels, _ = METRICS[name]
        assert kind == want_kind, name
        assert labels == set(want_labels), (name, labels)


def test_event_driven_series() -> None:
    fams = _exposed(_metrics())
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples
    }
    assert samples[("unbroken_phase", (("phase", "running"),))] == 1.0
    assert samples[("unbroken_persist_interval_seconds", ())] == 182.0
    assert samples[("unbroken_phase", (("phase", "paused"),))] == 0.0
    assert samples[("unbroken_incidents_total", ())] == 1.0
    assert samples[("unbroken_time_to_resume_seconds_count", ())] == 1.0
    assert samples[("unbroken_time_to_resume_seconds_sum", ())] == pytest.approx(3.0)
    assert samples[("unbroken_checkpoint_committed_step", ())] == 6.0
    assert samples[("unbroken_events_total", (("kind", "recovery_transition"),))] == 2.0
    assert not any(name.startswith("unbroken_worker_") for name, _ in samples)  # agents'
    assert samples[("unbroken_node_silent_seconds", (("node", "n0"),))] == pytest.approx(0.5)


def _agent_metrics() -> AgentMetrics:
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


def test_agent_metrics_table_matches_the_exposition() -> None:
    text = generate_latest(_agent_metrics().registry).decode()
    exposed: dict[str, tuple[str, set[str]]] = {}
    samples = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name.endswith("_created"):
                continue
            exposed.setdefault(s.name, (f.type, set()))[1].update(s.labels)
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert set(exposed) == set(AGENT_METRICS), set(exposed) ^ set(AGENT_METRICS)
    for name, (kind, labels) in exposed.items():
        assert kind == AGENT_METRICS[name][0], name
        assert labels == set(AGENT_METRICS[name][1]), (name, labels)
    r0, r1 = (("local_rank", "0"),), (("local_rank", "1"),)
    assert samples[("unbroken_agent_worker_step_time_seconds", r0)] == pytest.approx(0.25)
    assert samples[("unbroken_agent_worker_step_time_seconds", r1)] == pytest.approx(0.3)
    assert ("unbroken_agent_worker_loss", r1) not in samples
    assert (
        samples[("unbroken_agent_worker_state", (("local_rank", "0"), ("state", "running")))] == 1
    )
    assert samples[("unbroken_agent_heartbeats_sent_total", ())] == 1
    assert samples[("unbroken_agent_replica_send_failures_total", ())] == 2


def _dashboard() -> dict[str, Any]:
    text = resources.files("unbroken.driver").joinpath("grafana/unbroken.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def _exprs(panels: list[dict[str, Any]]) -> list[str]:
    out = []
    for p in panels:
        out.extend(t["expr"] for t in p.get("targets", []))
        out.extend(_exprs(p.get("panels", [])))
    return out


def test_dashboard_queries_reference_real_metrics() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"]
    exprs = _exprs(dash["panels"])
    assert len(exprs) >= 10
    every = {**METRICS, **AGENT_METRICS}
    histograms = {n for n, (kind, _, _) in every.items() if kind == "histogram"}
    used = set()
    for expr in exprs:
        names = NAME.findall(expr)
        assert names, f"query {expr!r} uses no unbroken metric"
        for n in names:
            base = next((n[: -len(s)] for s in HIST_SUFFIXES if n.endswith(s)), n)
            ok = n in every or base in histograms
            assert ok, f"query {expr!r} references {n!r}, which no unbroken process exports"
            used.add(n if n in every else base)
    unused = set(METRICS) - used  # the driver's: each on a panel (agents' are per node)
    assert not unused, f"metrics missing from the dashboard: {sorted(unused)}"


def test_dashboard_panels_are_well_formed() -> None:
    ids = []
    for p in _dashboard()["panels"]:
        ids.append(p["id"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p.get("targets", []):
            assert t["refId"] and t["datasource"]["uid"] == "${datasource}"
    assert len(ids) == len(set(ids))
