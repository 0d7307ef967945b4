"""The Grafana dashboard and the metrics table agree with what the driver really exports.

`METRICS` (driver/metrics.py) is the list the README and the dashboard are written against.
These tests (1) render a real `DriverMetrics` registry over a live view with one node and
two workers and a few appended events, and check that the exposition holds exactly the
series `METRICS` names, with their types and labels; (2) load the packaged dashboard JSON
and check that every query references only metrics that exist.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.metricsdata import agent_metrics, dashboard, driver_metrics, exprs
from unbroken.agent.metrics import AGENT_METRICS
from unbroken.common.promhttp import STANDARD_METRICS
from unbroken.driver.metrics import METRICS, DriverMetrics

pytestmark = pytest.mark.unit

HIST_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
NAME = re.compile(r"\bunbroken_[a-z0-9_]+\b")


def _exposed(m: DriverMetrics) -> dict[str, Any]:
    text = generate_latest(m.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_table_matches_the_exposition() -> None:
    fams = _exposed(driver_metrics())
    exposed: dict[str, tuple[str, set[str]]] = {}
    for f in fams.values():
        for s in f.samples:
            if s.name.endswith("_created") or s.name in STANDARD_METRICS:
                continue
            if s.name.startswith("process_"):
                continue  # prometheus_client's process collector
            base = f.name if f.type == "histogram" else s.name
            labels = set(s.labels) - {"le"}
            exposed.setdefault(base, (f.type, set()))[1].update(labels)
    assert set(exposed) == set(METRICS), set(exposed) ^ set(METRICS)
    for name, (kind, labels) in exposed.items():
        want_kind, want_labels, _ = METRICS[name]
        assert kind == want_kind, name
        assert labels == set(want_labels), (name, labels)


def test_event_driven_series() -> None:
    fams = _exposed(driver_metrics())
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


JOB_LEVEL = {
    "unbroken_nodes",
    "unbroken_phase",
    "unbroken_goodput_ratio",
    "unbroken_training_lost_seconds",
    "unbroken_persist_interval_seconds",
    "unbroken_incidents_total",
    "unbroken_time_to_resume_seconds",
    "unbroken_events_total",
    "unbroken_checkpoint_committed_step",
    "unbroken_checkpoint_committed_bytes",
    "unbroken_checkpoints_committed_total",
}


def test_a_standby_exports_no_job_level_values_and_says_it_does_not_lead() -> None:
    lead, standby = _exposed(driver_metrics()), _exposed(driver_metrics(leader=False))

    def names(fams: dict[str, Any]) -> set[str]:
        return {s.name.removesuffix("_count") for f in fams.values() for s in f.samples}

    def value(fams: dict[str, Any], name: str) -> float:
        return next(s.value for f in fams.values() for s in f.samples if s.name == name)

    assert JOB_LEVEL <= names(lead)
    assert not JOB_LEVEL & names(standby), JOB_LEVEL & names(standby)
    assert value(lead, "unbroken_driver_is_leader") == 1.0
    assert value(standby, "unbroken_driver_is_leader") == 0.0


def test_build_info_and_process_metrics_on_every_endpoint() -> None:
    for registry, component in (
        (driver_metrics().registry, "driver"),
        (agent_metrics().registry, "agent"),
    ):
        fams = {
            f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
        }
        (info,) = fams["unbroken_build_info"].samples
        assert info.name == "unbroken_build_info" and info.value == 1.0
        assert info.labels["component"] == component and info.labels["version"]
        assert "process_cpu_seconds" in fams and "process_resident_memory_bytes" in fams


def test_agent_metrics_table_matches_the_exposition() -> None:
    text = generate_latest(agent_metrics().registry).decode()
    exposed: dict[str, tuple[str, set[str]]] = {}
    samples = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name.endswith("_created") or s.name in STANDARD_METRICS:
                continue
            if s.name.startswith("process_"):
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
    assert samples[("unbroken_agent_worker_restarts_total", r1)] == 1


def test_dashboard_queries_reference_realdriver_metrics() -> None:
    dash = dashboard()
    assert dash["uid"] and dash["title"]
    queries = exprs(dash["panels"])
    assert len(queries) >= 10
    every = {**METRICS, **AGENT_METRICS}
    histograms = {n for n, (kind, _, _) in every.items() if kind == "histogram"}
    used = set()
    for expr in queries:
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
    for p in dashboard()["panels"]:
        ids.append(p["id"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p.get("targets", []):
            assert t["refId"] and t["datasource"]["uid"] == "${datasource}"
    assert len(ids) == len(set(ids))
