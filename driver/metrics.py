"""Prometheus metrics of the driver, served over HTTP (`--metrics-port`, 0 picks a free port).

The heartbeat handler never touches a Prometheus object (a locked counter per message
would cost more than the handler itself): it bumps plain ints in the live view, and
custom collectors turn them into metrics when Prometheus scrapes. The per-node and
per-worker series (step, step time, loss, silence) are read from the live view at scrape
time, so the agents need no metrics endpoint of their own: the driver already holds every
agent's newest heartbeat. Job-level series (phase, incidents, committed checkpoint,
events by kind, time to resume) follow the events this driver appends (`on_event`, a
listener of the service's writer); after a failover they start from the next event.

`METRICS` names every exported series with its type and labels; the README's metrics
table and the Grafana dashboard (driver/grafana/unbroken.json, checked by
tests/unit/test_grafana.py) are written against it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from unbroken.common.promhttp import Endpoint
from unbroken.driver.liveview import LiveView
from unbroken.proto import events_pb2 as ev

DETECT_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
RESUME_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PHASES = tuple(ev.Phase.Name(p).removeprefix("PHASE_").lower() for p in ev.Phase.values())

#: Every series this module exports, as Prometheus shows it: name -> (type, labels, help).
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "unbroken_driver_is_leader": (
        "gauge",
        (),
        "1 while this driver leads the job (its job-level series are the job's), 0 standing by",
    ),
    "unbroken_heartbeats_total": ("counter", (), "Heartbeats received"),
    "unbroken_nodes": ("gauge", ("state",), "Nodes by live state (alive, lost)"),
    "unbroken_events_appended_total": (
        "counter",
        (),
        "Events appended by the driver's writer (detectors, recovery loop, commits)",
    ),
    "unbroken_commands_dropped_total": (
        "counter",
        (),
        "Commands dropped because a stream's buffer was full",
    ),
    "unbroken_detection_latency_seconds": (
        "histogram",
        (),
        "Time to detect a lost node: its last heartbeat to its NodeLost event being durable",
    ),
    "unbroken_fault_durable_seconds": (
        "histogram",
        (),
        "A fault's detection to its event being durable (the journal's fault lane)",
    ),
    "unbroken_snapshots_too_large_total": (
        "counter",
        (),
        "State snapshots too large for etcd (not written; archival waits until one fits)",
    ),
    "unbroken_faults_pending": ("gauge", (), "Detected faults not yet durable (etcd slow or down)"),
    "unbroken_log_alerts_coalesced_total": (
        "counter",
        (),
        "Log-alert lines folded into an earlier LogAlert of the same node and keyword",
    ),
    "unbroken_log_alerts_shed_total": (
        "counter",
        (),
        "Log alerts dropped under pressure (faults never are)",
    ),
    "unbroken_phase": ("gauge", ("phase",), "1 for the job's current recovery phase, else 0"),
    "unbroken_goodput_ratio": (
        "gauge",
        (),
        "Share of wall time since training began not lost to incidents (driver/goodput.py)",
    ),
    "unbroken_training_lost_seconds": (
        "gauge",
        ("cause",),
        "Training time lost so far, by the fault kind that opened each incident",
    ),
    "unbroken_badput_seconds": (
        "gauge",
        ("category",),
        "The same lost time by what it was spent on (detection, pause, diagnosis, restart, "
        "restore, steps_redone, startup; docs/goodput.md)",
    ),
    "unbroken_persist_interval_seconds": (
        "gauge",
        (),
        "Persistence interval the driver sends workers now (Young/Daly; 0: the agents' own)",
    ),
    "unbroken_incidents_total": ("counter", (), "Incidents opened (a fault left RUNNING)"),
    "unbroken_time_to_resume_seconds": (
        "histogram",
        (),
        "Incident opened (first RecoveryTransition) to TrainingResumed, by event wall time",
    ),
    "unbroken_events_total": ("counter", ("kind",), "Events appended by the writer, by payload"),
    "unbroken_recoveries_total": (
        "counter",
        ("mode",),
        "Incidents resumed, by recovery mode: in_job (healthy workers kept their processes) "
        "or restart (every worker process replaced)",
    ),
    "unbroken_checkpoint_committed_step": ("gauge", (), "Step of the newest committed checkpoint"),
    "unbroken_checkpoint_committed_bytes": (
        "gauge",
        (),
        "Data bytes of the newest committed checkpoint (all ranks)",
    ),
    "unbroken_checkpoints_committed_total": ("counter", (), "CheckpointCommitted events"),
    "unbroken_verified_step": (
        "gauge",
        (),
        "Newest step whose fingerprints agreed on every rank (docs/sdc.md; 0: none yet)",
    ),
    "unbroken_sdc_suspected_total": ("counter", (), "SdcSuspected events (docs/sdc.md)"),
    "unbroken_node_alive": ("gauge", ("node",), "1 while the node heartbeats, 0 once lost"),
    "unbroken_node_silent_seconds": ("gauge", ("node",), "Time since the node's last heartbeat"),
    "unbroken_node_persist_failures": (
        "gauge",
        ("node",),
        "Persist writes failed in a row on the node (0: its last one succeeded)",
    ),
    "unbroken_newest_commit_age_seconds": (
        "gauge",
        (),
        "Seconds since the newest CheckpointCommitted (absent before the first)",
    ),
    "unbroken_event_log_failing_seconds": (
        "gauge",
        (),
        "How long the event log has refused the leader's writes (0: they succeed)",
    ),
    "unbroken_event_log_full": (
        "gauge",
        (),
        "1 while etcd refuses writes for lack of space (NOSPACE alarm), else 0",
    ),
    "unbroken_awaiting_nodes": (
        "gauge",
        (),
        "1 while the open incident waits for nodes below --min-nodes (the job fails after "
        "--await-nodes-s unless nodes come back or join), else 0",
    ),
    "unbroken_mass_silence_nodes": (
        "gauge",
        (),
        "Silent nodes whose NodeLost a mass silence holds back now (0: none held)",
    ),
    "unbroken_mass_silence_unheard_seconds": (
        "gauge",
        (),
        "While a mass silence is held: how long no node at all was heard (0: none held)",
    ),
    "unbroken_driver_loop_busy_ratio": (
        "gauge",
        (),
        "The driver's event loop's own CPU over the last timeout window, as a share of it "
        "(at 0.8 or more, more than --mass-loss-min nodes silent together are held back)",
    ),
}
# Per-worker series come from each agent's own endpoint (agent/metrics.py AGENT_METRICS),
# not from the driver: at 10,000 nodes x 8 workers the driver would build ~320k series per
# scrape.


def _health(v: dict[str, Any]) -> Iterator[Any]:
    """The leader's own trouble: the event log refusing writes, a mass silence held."""
    health = v.get("event_log") or {}
    held, _, unheard = v.get("mass_silence", (0, 0.0, 0.0))
    for name, value in (
        ("unbroken_event_log_failing_seconds", health.get("failing_s", 0)),
        ("unbroken_event_log_full", health.get("full", 0)),
        ("unbroken_mass_silence_nodes", held),
        ("unbroken_mass_silence_unheard_seconds", unheard),
        ("unbroken_driver_loop_busy_ratio", v.get("loop_busy", 0.0)),
    ):
        g = GaugeMetricFamily(name, METRICS[name][2])
        g.add_metric([], float(value))
        yield g


class _LiveCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]], job: CollectorRegistry) -> None:
        self._read = read
        self._job = job

    def collect(self) -> Iterator[Any]:
        v = self._read()
        leader = bool(v.get("leader"))
        g = GaugeMetricFamily("unbroken_driver_is_leader", METRICS["unbroken_driver_is_leader"][2])
        g.add_metric([], 1.0 if leader else 0.0)
        yield g
        c = CounterMetricFamily("unbroken_heartbeats", "Heartbeats received")
        c.add_metric([], v["heartbeats"])
        yield c
        if leader:
            # The job-level series are the leader's alone: a standby's would be zeros or a
            # stale term's values, and a `max`/`sum` over every driver would mix them in.
            g = GaugeMetricFamily("unbroken_nodes", "Nodes by live state", labels=["state"])
            for state, n in v["nodes"].items():
                g.add_metric([state], n)
            yield g
            yield from self._job.collect()
        e = CounterMetricFamily("unbroken_events_appended", "Events appended by detectors")
        e.add_metric([], v["events"])
        yield e
        d = CounterMetricFamily(
            "unbroken_commands_dropped", "Commands dropped because a stream's buffer was full"
        )
        d.add_metric([], v["dropped"])
        yield d
        for name, kind in (
            ("unbroken_log_alerts_coalesced", "alerts_coalesced"),
            ("unbroken_log_alerts_shed", "alerts_shed"),
            ("unbroken_snapshots_too_large", "snapshots_too_large"),
        ):
            c = CounterMetricFamily(name, METRICS[name + "_total"][2])
            c.add_metric([], v.get(kind, 0))
            yield c
        g = GaugeMetricFamily("unbroken_faults_pending", METRICS["unbroken_faults_pending"][2])
        g.add_metric([], v.get("faults_pending", 0))
        yield g
        if not leader:
            return
        # read from the journal's folded state, never re-derived
        name = ev.Phase.Name(v["phase"]).removeprefix("PHASE_").lower()
        g = GaugeMetricFamily("unbroken_phase", METRICS["unbroken_phase"][2], labels=["phase"])
        for p in PHASES:
            g.add_metric([p], 1.0 if p == name else 0.0)
        yield g
        g = GaugeMetricFamily("unbroken_awaiting_nodes", METRICS["unbroken_awaiting_nodes"][2])
        g.add_metric([], 1.0 if v.get("awaiting_nodes") else 0.0)
        yield g
        yield from _health(v)
        if v.get("newest_commit_age_s", -1.0) >= 0:
            name = "unbroken_newest_commit_age_seconds"
            g = GaugeMetricFamily(name, METRICS[name][2])
            g.add_metric([], v["newest_commit_age_s"])
            yield g
        if "persist_every_s" in v:
            name = "unbroken_persist_interval_seconds"
            g = GaugeMetricFamily(name, METRICS[name][2])
            g.add_metric([], v["persist_every_s"])
            yield g
        gp = v.get("goodput")
        if gp is not None and gp.ratio >= 0:
            g = GaugeMetricFamily("unbroken_goodput_ratio", METRICS["unbroken_goodput_ratio"][2])
            g.add_metric([], gp.ratio)
            yield g
            g = GaugeMetricFamily(
                "unbroken_training_lost_seconds",
                METRICS["unbroken_training_lost_seconds"][2],
                labels=["cause"],
            )
            for cause, lost in gp.lost_s_by_cause.items():
                g.add_metric([cause], lost)
            yield g
            name = "unbroken_badput_seconds"
            g = GaugeMetricFamily(name, METRICS[name][2], labels=["category"])
            for cat, lost in gp.lost_s_by_category.items():
                g.add_metric([cat], lost)
            yield g


class _ViewCollector(Collector):
    """Per-node series from the live view (per-worker ones are the agents' own)."""

    def __init__(self, view: LiveView, clock: Callable[[], float]) -> None:
        self._view = view
        self._clock = clock

    def collect(self) -> Iterator[Any]:
        now = self._clock()
        slots = list(self._view.nodes.values())  # one C-level copy: safe from this thread
        alive = GaugeMetricFamily(
            "unbroken_node_alive", METRICS["unbroken_node_alive"][2], labels=["node"]
        )
        silent = GaugeMetricFamily(
            "unbroken_node_silent_seconds",
            METRICS["unbroken_node_silent_seconds"][2],
            labels=["node"],
        )
        name = "unbroken_node_persist_failures"
        failing = GaugeMetricFamily(name, METRICS[name][2], labels=["node"])
        for s in slots:
            alive.add_metric([s.node_id], 1.0 if s.alive else 0.0)
            silent.add_metric([s.node_id], max(0.0, now - s.last_seen) if s.last_seen else 0.0)
            failing.add_metric([s.node_id], float(s.hb.persist_failures if s.alive else 0))
        yield from (alive, silent, failing)


class DriverMetrics(Endpoint):
    """The driver's registry: live counters, the view's per-node series, job-level series."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        super().__init__(CollectorRegistry(), component="driver")
        # job-level series live in their own registry, exported only while leading
        self.job_registry = CollectorRegistry()
        self.registry.register(_LiveCollector(read, self.job_registry))
        self.detect_latency = Histogram(
            "unbroken_detection_latency_seconds",
            METRICS["unbroken_detection_latency_seconds"][2],
            buckets=DETECT_BUCKETS,
            registry=self.registry,
        )
        r = self.registry
        self.fault_durable = Histogram(
            "unbroken_fault_durable_seconds",
            METRICS["unbroken_fault_durable_seconds"][2],
            buckets=DETECT_BUCKETS,
            registry=r,
        )
        r = self.job_registry
        self.incidents = Counter(
            "unbroken_incidents", METRICS["unbroken_incidents_total"][2], registry=r
        )
        self.time_to_resume = Histogram(
            "unbroken_time_to_resume_seconds",
            METRICS["unbroken_time_to_resume_seconds"][2],
            buckets=RESUME_BUCKETS,
            registry=r,
        )
        self.events = Counter(
            "unbroken_events", METRICS["unbroken_events_total"][2], ["kind"], registry=r
        )
        self.recoveries = Counter(
            "unbroken_recoveries", METRICS["unbroken_recoveries_total"][2], ["mode"], registry=r
        )
        self.ckpt_step = Gauge(
            "unbroken_checkpoint_committed_step",
            METRICS["unbroken_checkpoint_committed_step"][2],
            registry=r,
        )
        self.ckpt_bytes = Gauge(
            "unbroken_checkpoint_committed_bytes",
            METRICS["unbroken_checkpoint_committed_bytes"][2],
            registry=r,
        )
        self.ckpts = Counter(
            "unbroken_checkpoints_committed",
            METRICS["unbroken_checkpoints_committed_total"][2],
            registry=r,
        )
        self.verified_step = Gauge(
            "unbroken_verified_step", METRICS["unbroken_verified_step"][2], registry=r
        )
        self.sdc = Counter(
            "unbroken_sdc_suspected", METRICS["unbroken_sdc_suspected_total"][2], registry=r
        )
        self._incident = ""
        self._incident_ns = 0  # wall time of the open incident's first transition

    def watch(
        self,
        view: LiveView,
        listeners: list[Callable[[ev.Event], None]],
        clock: Callable[[], float],
    ) -> None:
        """Export `view`'s per-node series and follow the events the writer appends."""
        self.registry.register(_ViewCollector(view, clock))
        listeners.append(self.on_event)

    def on_event(self, e: ev.Event) -> None:
        """Update the job-level series from one recorded event (event-loop thread).

        The phase is not derived here: the collector reads it from the journal's state.
        """
        kind = e.WhichOneof("payload") or "none"
        self.events.labels(kind).inc()
        if kind == "recovery_transition":
            t = e.recovery_transition
            if t.to_phase == ev.PHASE_RUNNING:
                self._resumed(e)
            elif t.incident_id and t.incident_id != self._incident:
                self._incident = t.incident_id
                self._incident_ns = e.wall_time_unix_ns
                self.incidents.inc()
        elif kind == "training_resumed":
            if e.training_resumed.mode:  # "" is the job's start, no incident
                self.recoveries.labels(e.training_resumed.mode).inc()
            self._resumed(e)
        elif kind == "step_verified":
            self.verified_step.set(e.step_verified.step)
        elif kind == "sdc_suspected":
            self.sdc.inc()
        elif kind == "checkpoint_committed":
            self.ckpt_step.set(e.checkpoint_committed.step)
            self.ckpt_bytes.set(e.checkpoint_committed.bytes)
            self.ckpts.inc()

    def _resumed(self, e: ev.Event) -> None:
        if self._incident_ns and e.wall_time_unix_ns >= self._incident_ns:
            self.time_to_resume.observe((e.wall_time_unix_ns - self._incident_ns) / 1e9)
        self._incident_ns = 0
