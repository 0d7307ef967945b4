"""A process's Prometheus endpoint: one registry served over HTTP (prometheus_client's own
server, in a thread), shared by the driver's and the agent's metrics.

Every endpoint also exports what any Prometheus target should: `unbroken_build_info`
(1, labelled with the package version, the component and Python's version: which build
runs where, and a join key for version-specific queries) and prometheus_client's process
collector (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
`process_open_fds`, `process_start_time_seconds`, ...).
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, start_http_server

BUILD_INFO = "unbroken_build_info"
#: series every endpoint exports besides its own: name -> (type, labels, help)
STANDARD_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    BUILD_INFO: (
        "gauge",
        ("version", "component", "python"),
        "1, labelled with the running build: package version, component, Python version",
    ),
}


def version() -> str:
    """The installed unbroken package's version ("unknown" when not installed)."""
    try:
        return metadata.version("unbroken")
    except metadata.PackageNotFoundError:
        return "unknown"


class Endpoint:
    """`/metrics` for `registry`; `serve` starts it, `close` stops it (idempotent).

    Args:
        registry: the component's own series.
        component: "driver" or "agent" (the build_info label).
    """

    def __init__(self, registry: CollectorRegistry, component: str = "") -> None:
        self.registry = registry
        if component:
            ProcessCollector(registry=registry)
            info = Gauge(BUILD_INFO, STANDARD_METRICS[BUILD_INFO][2],
                         list(STANDARD_METRICS[BUILD_INFO][1]), registry=registry)  # fmt: skip
            info.labels(version(), component, platform.python_version()).set(1)
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
