"""The agent's own Prometheus endpoint: this node's workers, flash copies and replicas.

Prometheus' convention is that each process exports its own series: the driver keeps the
job-level ones (phase, incidents, goodput, events, detection and recovery latencies) and
no longer builds per-worker series for every node at scrape time (about 320k series at
10,000 nodes of 8 workers); each agent exports its node's.

Scrapes run in prometheus_client's HTTP thread. They read only snapshots the agent's event
loop publishes (`AgentMetrics.heartbeat`: the newest heartbeat it sent, a message the loop
never mutates after sending; plain integer counters), so a scrape never iterates a dict
the loop is changing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from unbroken.common.promhttp import Endpoint
from unbroken.proto import driver_pb2 as dpb

# name -> (type, labels, help): the table the Grafana dashboard is checked against
# (tests/unit/test_grafana.py), as driver/metrics.py's METRICS is.
AGENT_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "unbroken_agent_connected": ("gauge", (), "1 while this agent's session with a driver is open"),
    "unbroken_agent_heartbeats_sent_total": ("counter", (), "Heartbeats this agent sent"),
    "unbroken_agent_leader_term": ("gauge", (), "Newest leader term a command came with"),
    "unbroken_agent_worker_state": (
        "gauge",
        ("local_rank", "state"),
        "1 for each worker's current state (starting, running, exited, stopped, paused)",
    ),
    "unbroken_agent_worker_step": ("gauge", ("local_rank",), "Each worker's newest step"),
    "unbroken_agent_worker_step_time_seconds": (
        "gauge",
        ("local_rank",),
        "Each worker's median step time over its recent steps",
    ),
    "unbroken_agent_worker_loss": ("gauge", ("local_rank",), "Each worker's newest loss"),
    "unbroken_agent_worker_restarts_total": (
        "counter",
        ("local_rank",),
        "Times this agent (re)started each local rank",
    ),
    "unbroken_agent_shards_persisted_total": (
        "counter",
        (),
        "Flash copies written to durable storage and verified",
    ),
    "unbroken_agent_persisted_bytes_total": ("counter", (), "Bytes of those shards"),
    "unbroken_agent_flash_scan_age_seconds": (
        "gauge",
        (),
        "Seconds since the flash thread last scanned the ring (large: it gets no CPU, and "
        "replication and persistence wait)",
    ),
    "unbroken_agent_replicas_sent_total": ("counter", (), "Copies sent to the buddy node"),
    "unbroken_agent_replica_bytes_sent_total": ("counter", (), "Bytes sent to the buddy node"),
    "unbroken_agent_replica_send_failures_total": (
        "counter",
        (),
        "Sends to the buddy that failed (unreachable, refused, or this node's copy corrupt)",
    ),
    "unbroken_agent_replicas_received_total": (
        "counter",
        (),
        "Copies received from the node this agent is the buddy of",
    ),
    "unbroken_agent_replicas_refused_total": (
        "counter",
        (),
        "Replica connections or copies refused (authentication, size, checksum)",
    ),
    "unbroken_agent_loop_boosts_total": (
        "counter",
        (),
        "Times the agent's background threads were raised to its loop's real-time priority "
        "because the loop waited for the GIL they held (agent/loopguard.py)",
    ),
    "unbroken_agent_worker_starts_total": (
        "counter",
        ("kind",),
        "Worker starts: warm (a pre-imported standby) or cold",
    ),
}

STATES = {
    dpb.WORKER_STATE_STARTING: "starting",
    dpb.WORKER_STATE_RUNNING: "running",
    dpb.WORKER_STATE_EXITED: "exited",
    dpb.WORKER_STATE_STOPPED: "stopped",
    dpb.WORKER_STATE_PAUSED: "paused",
}


class _AgentCollector(Collector):
    def __init__(self, metrics: AgentMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Any]:
        m = self._m
        v = m.read()
        hb = m.heartbeat  # one reference: the loop replaces it, never mutates it

        def gauge(name: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, AGENT_METRICS[name][2])
            g.add_metric([], value)
            return g

        def counter(name: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name.removesuffix("_total"), AGENT_METRICS[name][2])
            c.add_metric([], value)
            return c

        yield gauge("unbroken_agent_connected", 1.0 if v.get("connected") else 0.0)
        yield counter("unbroken_agent_heartbeats_sent_total", m.heartbeats_sent)
        yield gauge("unbroken_agent_leader_term", v.get("term", 0))
        yield gauge("unbroken_agent_flash_scan_age_seconds", v.get("flash_scan_age", 0.0))
        lab = ["local_rank"]
        state = GaugeMetricFamily(
            "unbroken_agent_worker_state",
            AGENT_METRICS["unbroken_agent_worker_state"][2],
            labels=["local_rank", "state"],
        )
        step = GaugeMetricFamily(
            "unbroken_agent_worker_step", AGENT_METRICS["unbroken_agent_worker_step"][2], labels=lab
        )
        st = GaugeMetricFamily(
            "unbroken_agent_worker_step_time_seconds",
            AGENT_METRICS["unbroken_agent_worker_step_time_seconds"][2],
            labels=lab,
        )
        loss = GaugeMetricFamily(
            "unbroken_agent_worker_loss", AGENT_METRICS["unbroken_agent_worker_loss"][2], labels=lab
        )
        restarts = CounterMetricFamily(
            "unbroken_agent_worker_restarts",
            AGENT_METRICS["unbroken_agent_worker_restarts_total"][2],
            labels=lab,
        )
        for w in [*hb.workers, *hb.attached]:
            r = str(w.local_rank)
            for code, name in STATES.items():
                state.add_metric([r, name], 1.0 if w.state == code else 0.0)
            step.add_metric([r], w.step)
            ms = w.median_step_ms or w.step_time_ms
            if ms:
                st.add_metric([r], ms / 1000.0)
            if w.has_loss:
                loss.add_metric([r], w.loss)
            restarts.add_metric([r], w.restarts)
        yield from (state, step, st, loss, restarts)
        for name, key in (
            ("unbroken_agent_shards_persisted_total", "shards_persisted"),
            ("unbroken_agent_persisted_bytes_total", "persisted_bytes"),
            ("unbroken_agent_replicas_sent_total", "replicas_sent"),
            ("unbroken_agent_replica_bytes_sent_total", "replica_bytes_sent"),
            ("unbroken_agent_replica_send_failures_total", "replica_send_failures"),
            ("unbroken_agent_replicas_received_total", "replicas_received"),
            ("unbroken_agent_replicas_refused_total", "replicas_refused"),
            ("unbroken_agent_loop_boosts_total", "loop_boosts"),
        ):
            yield counter(name, v.get(key, 0))
        starts = CounterMetricFamily(
            "unbroken_agent_worker_starts",
            AGENT_METRICS["unbroken_agent_worker_starts_total"][2],
            labels=["kind"],
        )
        starts.add_metric(["warm"], v.get("warm_starts", 0))
        starts.add_metric(["cold"], v.get("cold_starts", 0))
        yield starts


class AgentMetrics(Endpoint):
    """This agent's registry. The event loop sets `heartbeat` (each one it sends) and
    bumps `heartbeats_sent`; `read()` returns the other values (cheap attribute reads)."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self.read = read
        self.heartbeat = dpb.Heartbeat()
        self.heartbeats_sent = 0
        super().__init__(CollectorRegistry(), component="agent")
        self.registry.register(_AgentCollector(self))

    def sent(self, hb: dpb.Heartbeat) -> None:
        """The loop sent `hb` (it is not changed after this)."""
        self.heartbeat = hb
        self.heartbeats_sent += 1
