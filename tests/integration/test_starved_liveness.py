"""A starved node keeps its place; a silent or killed one is lost: the driver's real
service (gRPC server, live view, node-lost sweep) against clients that speak the agents'
protocol (Register, a Session streaming heartbeats every 100 ms).

- a node whose heartbeats said its host was starved (CPU pressure) goes silent for 1.2 s,
  past the 0.5 s timeout, with its stream open, and comes back: no NodeLost;
- the same node's stream breaks and it registers again with the same epoch: a reconnect
  (no refusal, no new NodeRegistered, no NodeLost), and it heartbeats on;
- a node that said nothing of starvation goes silent with its stream open: lost at the
  timeout; a node that said it was starved but whose stream closed (a killed agent): lost
  at the timeout too, without the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import pytest

from tests.inproc import driver, session_md, until
from unbroken.driver.liveview import LiveViewConfig
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

STARVED = {"cpu_pressure_pct": 60.0, "loop_lag_ms": 80.0}


class ProtocolAgent:
    """One node's registration and session; `paused` stops its heartbeats, stream open."""

    def __init__(self, stub: dgrpc.DriverStub, node: str, starved: bool) -> None:
        self.stub, self.node, self.starved = stub, node, starved
        self.paused = False
        self.call: Any = None
        self.task: asyncio.Task[None] | None = None
        self.seq = 0

    async def open(self) -> None:
        await self.stub.Register(dpb.RegisterRequest(node_id=self.node, epoch=7), timeout=5)
        self.call = self.stub.Session(metadata=session_md(self.node, 7))
        self.task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            if not self.paused:
                self.seq += 1
                hb = dpb.Heartbeat(seq=self.seq, **(STARVED if self.starved else {}))
                await self.call.write(dpb.AgentMessage(heartbeat=hb))
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        if self.call is not None:
            self.call.cancel()


def lost(store: Any) -> list[str]:
    return [e.node_lost.node_id for e in store.events if e.HasField("node_lost")]


def test_starved_nodes_keep_their_place_and_silent_or_killed_ones_are_lost() -> None:
    live = LiveViewConfig(heartbeat_interval_ms=100, miss_limit=5, jitter_k=0)
    assert live.starved_hold_ms == 2000

    async def go() -> None:
        async with driver(ServiceConfig(live=live)) as (svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                nodes = {
                    n: ProtocolAgent(stub, n, starved=n in ("a", "c"))
                    for n in ("a", "b", "c", "d", "e", "f")
                }
                for a in nodes.values():
                    await a.open()
                await until(
                    lambda: all(s.heartbeats >= 3 for s in svc.view.nodes.values()), 10, "beats"
                )
                registered = sum(e.HasField("node_registered") for e in store.events)

                # a starved node silent 1.2 s with its stream open comes back: kept
                nodes["a"].paused = True
                await asyncio.sleep(1.2)
                nodes["a"].paused = False
                beats = svc.view.nodes["a"].heartbeats
                await until(lambda: svc.view.nodes["a"].heartbeats > beats, 5, "a back")
                await asyncio.sleep(0.3)
                assert lost(store) == [] and svc.nodewatch.starved_saved >= 1

                # its stream breaks; it registers again with the same epoch: a reconnect
                await nodes["a"].close()
                await nodes["a"].open()
                beats = svc.view.nodes["a"].heartbeats
                await until(lambda: svc.view.nodes["a"].heartbeats > beats + 2, 5, "a's new beats")
                assert lost(store) == []
                assert sum(e.HasField("node_registered") for e in store.events) == registered
                assert not any(e.HasField("node_refused") for e in store.events)

                # not starved, silent with the stream open: lost at the timeout
                nodes["b"].paused = True
                await until(lambda: "b" in lost(store), 5, "b's NodeLost")
                # said it was starved, but its stream closed (a killed agent): no grace
                await nodes["c"].close()
                await until(lambda: "c" in lost(store), 5, "c's NodeLost")
                silent_ms = {
                    e.node_lost.node_id: e.node_lost.silent_ms
                    for e in store.events
                    if e.HasField("node_lost")
                }
                assert silent_ms["c"] < live.timeout_s * 1000 + live.starved_hold_ms / 2, silent_ms
                assert sorted(lost(store)) == ["b", "c"]
                for a in nodes.values():
                    await a.close()

    asyncio.run(go())
