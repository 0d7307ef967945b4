"""A TCP proxy in front of a driver that can cut one agent off the network.

Every agent reaches the drivers through these proxies (one per driver slot; the drivers
advertise the proxy's address, so a standby's redirect leads back through a proxy, never
around it). A cut names an agent process: the proxy finds that process's client ports
with psutil and, for connections from those ports, either drops them (closes both sides
at once, new ones too: a refused/reset network) or blackholes them (keeps the sockets
open but forwards nothing either way: a silent partition, the nastier case for
heartbeats). Healing lifts the cut; the agent's own retry loop reconnects.

The proxy runs on its own asyncio loop in a daemon thread so the (synchronous) test can
drive it; every public method is thread-safe and bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import psutil

T = TypeVar("T")
CutMode = Literal["drop", "blackhole"]
CHUNK = 1 << 16
CALL_TIMEOUT_S = 10.0


@dataclass(slots=True, eq=False)  # hashed by identity: a set of live connections
class _Conn:
    client_port: int
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    blackholed: bool = False


def ports_of(pid: int) -> set[int]:
    """The local TCP ports of process `pid` (empty when it is gone)."""
    try:
        return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.laddr}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()


class ProxyLoop:
    """One asyncio loop in a daemon thread hosting any number of proxies."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="proxy")
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = CALL_TIMEOUT_S) -> T:
        """Run `coro` on the proxy loop and wait (at most `timeout_s`) for its result."""
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def close(self) -> None:
        """Stop the loop and join its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class DriverProxy:
    """Forwards 127.0.0.1:<port> to one driver's current address; cuts agents on demand."""

    def __init__(self, loop: ProxyLoop, name: str) -> None:
        self.loop = loop
        self.name = name
        self.upstream: tuple[str, int] | None = None
        self.port = 0
        self.cuts: dict[int, CutMode] = {}  # agent pid -> mode
        self._conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None
        self.accepted = 0
        self.refused = 0

    def start(self) -> int:
        """Listen on a free loopback port; return it."""

        async def go() -> int:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
            return int(self._server.sockets[0].getsockname()[1])

        self.port = self.loop.call(go())
        return self.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_upstream(self, address: str) -> None:
        """Point new connections at `address` (host:port); existing ones keep theirs."""
        host, port = address.rsplit(":", 1)

        async def go() -> None:
            self.upstream = (host, int(port))

        self.loop.call(go())

    def cut(self, pid: int, mode: CutMode) -> int:
        """Cut agent `pid` off; return how many of its open connections were hit."""

        async def go() -> int:
            self.cuts[pid] = mode
            ports = ports_of(pid)
            hit = 0
            for c in list(self._conns):
                if c.client_port in ports:
                    hit += 1
                    self._apply(c, mode)
            return hit

        return self.loop.call(go())

    def heal(self, pid: int) -> None:
        """Lift the cut on `pid`; blackholed connections are closed so the agent reconnects."""

        async def go() -> None:
            self.cuts.pop(pid, None)
            for c in list(self._conns):
                if c.blackholed:
                    self._apply(c, "drop")

        self.loop.call(go())

    def close(self) -> None:
        """Stop listening and close every connection."""

        async def go() -> None:
            if self._server is not None:
                self._server.close()
            for c in list(self._conns):
                self._apply(c, "drop")

        with contextlib.suppress(Exception):
            self.loop.call(go())

    # ------------------------------------------------------------ on the proxy loop
    def _cut_mode(self, client_port: int) -> CutMode | None:
        for pid, mode in self.cuts.items():
            if client_port in ports_of(pid):
                return mode
        return None

    def _apply(self, c: _Conn, mode: CutMode) -> None:
        if mode == "blackhole":
            c.blackholed = True
            return
        for w in c.writers:
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._conns.discard(c)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_port = int(writer.get_extra_info("peername")[1])
        conn = _Conn(client_port, [writer])
        self._conns.add(conn)
        mode = self._cut_mode(client_port) if self.cuts else None
        if mode == "drop" or self.upstream is None:
            self.refused += 1
            self._apply(conn, "drop")
            return
        if mode == "blackhole":
            conn.blackholed = True
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), 5.0
            )
        except (OSError, TimeoutError):
            self.refused += 1
            self._apply(conn, "drop")
            return
        conn.writers.append(up_writer)
        self.accepted += 1
        await asyncio.gather(
            self._pump(conn, reader, up_writer), self._pump(conn, up_reader, writer)
        )
        self._apply(conn, "drop")

    async def _pump(
        self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                data = await src.read(CHUNK)
                if not data:
                    break
                if conn.blackholed:
                    continue  # swallowed: the peer hears nothing
                dst.write(data)
                await dst.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.transport.abort()
