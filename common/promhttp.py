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
import queue
import threading
from importlib import metadata
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import _get_best_family

MAX_CONNECTIONS = 16  # served at once (Prometheus needs one per scrape)
IDLE_TIMEOUT_S = 10.0  # a connection silent (or not reading) this long is dropped

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

    def serve(
        self,
        port: int,
        host: str = "127.0.0.1",
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> int:
        """Start the HTTP endpoint; return the bound port.

        At most `max_connections` are served at a time, by as many threads at most (one
        over the cap is closed at once) and a connection that sends or reads nothing for
        `idle_timeout_s` is dropped, so idle or slow clients cannot pile up threads or hold
        the port from Prometheus for longer than that.
        """

        class Server(_CappedServer):
            pass

        Server.address_family, addr = _get_best_family(host, port)
        Server.cap = max_connections
        handler = type("Handler", (_QuietHandler,), {"timeout": idle_timeout_s})
        server = make_server(addr, port, make_wsgi_app(self.registry), Server, handler)
        threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
        self._server = server
        self.port = int(server.server_port)
        return self.port

    @property
    def serving(self) -> int:
        """Connections being served (or handed to a thread) now: at most `max_connections`."""
        return int(self._server.busy) if self._server is not None else 0

    @property
    def refused(self) -> int:
        """Connections closed at once because `max_connections` were open."""
        return int(self._server.refused) if self._server is not None else 0

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, no access log; `timeout` (set per server) bounds every
    read and write of the socket."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _CappedServer(WSGIServer):
    """At most `cap` connections served at once, each by one of at most `cap` threads
    (started as needed and kept, so the cap holds for threads too: a thread-per-connection
    server's finished thread lingers a moment after it frees its slot); a connection over
    the cap is closed at once."""

    cap = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.busy = 0  # connections taken and not yet done with
        self.refused = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            over = self.busy >= self.cap
            if over:
                self.refused += 1
            else:
                self.busy += 1
                if len(self._threads) < self.busy:  # every taken connection has a thread
                    name = f"metrics-conn-{len(self._threads)}"
                    t = threading.Thread(target=self._serve_connections, daemon=True, name=name)
                    self._threads.append(t)
                    t.start()
        if over:
            self.shutdown_request(request)
        else:
            self._queue.put((request, client_address))

    def _serve_connections(self) -> None:
        while (item := self._queue.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                pass  # a dropped (idle, slow) client is no error worth a traceback
            finally:
                self.shutdown_request(request)
                with self._lock:
                    self.busy -= 1

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            for _ in self._threads:
                self._queue.put(None)
