"""Slow readers cannot lock an operator out of the dashboard.

A client that sends requests and never reads the answers holds its connection in the
server's write for the idle deadline (15 s), so a handful of them, renewed as they are
dropped, kept every place of the connection cap and the dashboard answered 503 to
everyone else. Anyone who reaches the port can do it: the static assets need no token.
At the cap the dashboard now closes the connection that has been stuck in a write the
longest (after the idle ones), as it closes the idle one longest.

A real Dashboard on a real socket, in process; the slow readers pipeline requests for the
open static script and never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from unbroken.driver.dashboard import Dashboard, DashboardConfig
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import DriverService, ServiceConfig
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration
TOKEN = "viewer-token-0123456789"
CAP = 4


async def _slow_reader(port: int) -> asyncio.StreamWriter:
    """A connection that asks for the script again and again and reads none of it."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.transport.set_write_buffer_limits(high=1 << 24)  # type: ignore[union-attr]
    writer.write(b"GET /static/app.js HTTP/1.1\r\n\r\n" * 2000)
    return writer


def test_slow_readers_at_the_cap_do_not_lock_a_viewer_out() -> None:
    async def go() -> None:
        svc = DriverService(ServiceConfig(), driver_id="d1", job_id="j")
        store = InMemoryStore()
        elog = InMemoryEventLog(store, "j", store.elect("d1"))
        await elog.append(ev.Event(node_registered=ev.NodeRegistered(node_id="n0", epoch=1)))
        svc.lead(elog, "127.0.0.1:1", await elog.replay())
        tokens = RoleTokens({"viewer": [TOKEN]})
        dash = Dashboard(DashboardConfig(tokens=tokens, max_connections=CAP), svc)
        port = await dash.start()
        slow: list[asyncio.StreamWriter] = []
        try:
            slow = [await _slow_reader(port) for _ in range(CAP)]
            await asyncio.sleep(1.0)  # each is stuck in the server's write by now
            assert dash.stalled_writers() == CAP, "the slow readers do not hold the cap"
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                f"GET /api/state HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            out = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert out.startswith(b"HTTP/1.1 200"), out[:200]
            assert json.loads(out.split(b"\r\n\r\n", 1)[1])["nodes"][0]["id"] == "n0"
            assert dash.evicted_stalled == 1
        finally:
            for w in slow:
                with contextlib.suppress(Exception):
                    w.transport.abort()
            await dash.close()
            await svc.close()

    asyncio.run(go())
