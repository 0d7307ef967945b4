"""A driver service in the test's own event loop: an in-memory event log, a real gRPC server
on a free loopback port. For tests of the service's RPCs (authentication, roles, malformed
requests, sessions) that need no etcd and no driver process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from unbroken.common import channel
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.rendezvous import RendezvousService
from unbroken.driver.service import DriverService, ServiceConfig, build_server


@contextlib.asynccontextmanager
async def driver(
    config: ServiceConfig | None = None,
    *,
    leader: bool = True,
    leader_address: str = "",
    rendezvous: bool = False,
) -> AsyncIterator[tuple[DriverService, InMemoryStore, str]]:
    """Serve `config` on a free port (leading job "job" unless `leader` is False; with the
    rendezvous service when `rendezvous`); yield the service, its store and its address."""
    svc = DriverService(
        config or ServiceConfig(), driver_id="d1", job_id="job", leader_address=leader_address
    )
    store = InMemoryStore()
    if leader:
        svc.lead(InMemoryEventLog(store, "job", store.elect("d1")), "")
    svc.start()
    server, port, _ = await build_server(svc, "127.0.0.1:0")
    if rendezvous:
        RendezvousService.attach(server, svc)
    try:
        yield svc, store, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
        await svc.close()


async def until(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Wait (in this loop) for `pred()` to be truthy; return its value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def status_of(call: Awaitable[Any]) -> grpc.StatusCode:
    """The status code an RPC ends with (OK when it returns)."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def session_md(node: str, epoch: int) -> tuple[tuple[str, str], ...]:
    """The metadata of a registered node's session."""
    return ((channel.NODE_KEY, node), (channel.EPOCH_KEY, str(epoch)))
