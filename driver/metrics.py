"""Prometheus metrics of the driver, served over HTTP (`--metrics-port`, 0 picks a free port).

The heartbeat handler never touches a Prometheus object (a locked counter per message
would cost more than the handler itself): it bumps plain ints in the live view, and a
custom collector turns them into metrics when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

DETECT_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class _LiveCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        v = self._read()
        c = CounterMetricFamily("unbroken_heartbeats", "Heartbeats received")
        c.add_metric([], v["heartbeats"])
        yield c
        g = GaugeMetricFamily("unbroken_nodes", "Nodes by live state", labels=["state"])
        for state, n in v["nodes"].items():
            g.add_metric([state], n)
        yield g
        e = CounterMetricFamily("unbroken_events_appended", "Events appended by detectors")
        e.add_metric([], v["events"])
        yield e
        d = CounterMetricFamily(
            "unbroken_commands_dropped", "Commands dropped because a stream's buffer was full"
        )
        d.add_metric([], v["dropped"])
        yield d


class DriverMetrics:
    """The driver's registry: live counters plus the detection-latency histogram."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_LiveCollector(read))
        self.detect_latency = Histogram(
            "unbroken_detection_latency_seconds",
            "From a node's last heartbeat to its NodeLost event being durable",
            buckets=DETECT_BUCKETS,
            registry=self.registry,
        )
        self.port = 0
        self._server: Any = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP endpoint; return the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
