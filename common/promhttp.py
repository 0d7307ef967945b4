"""A process's Prometheus endpoint: one registry served over HTTP (prometheus_client's own
server, in a thread), shared by the driver's and the agent's metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


class Endpoint:
    """`/metrics` for `registry`; `serve` starts it, `close` stops it (idempotent)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
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
