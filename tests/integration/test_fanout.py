"""The recovery loop's broadcasts (driver/fanout.py) over real sessions.

Real gRPC, the driver service in-process, two agents' Session streams read by the test: a
stop goes to a node once per session and command, however many decisions of the same
incident stop it (at 10,240 nodes each decision sent 10,240 stops); starting its workers,
another stop command or a new session sends it again; and a broadcast's failures are one
log line naming how many.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
import structlog

from tests.inproc import driver, session_md, until
from unbroken.driver.fanout import Fanout
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

STOP = dpb.DriverMessage(stop_workers=dpb.StopWorkers(grace_s=1.0))


class Agent:
    """One agent's Session stream, read into a queue by one task, with a heartbeat every
    100 ms as a real agent sends (a stream silent for 1.6 s is a lost node: CI at load once
    took that long between two of this test's steps)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.inbox: asyncio.Queue[dpb.DriverMessage] = asyncio.Queue()
        self.writing = asyncio.Lock()  # one write at a time on a stream
        self.reader = asyncio.create_task(self._read())
        self.beater = asyncio.create_task(self._beat())

    async def _read(self) -> None:
        while (msg := await self.call.read()) != grpc.aio.EOF:
            self.inbox.put_nowait(msg)

    async def _beat(self) -> None:
        seq = 1
        while True:
            async with self.writing:
                await self.call.write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=seq)))
            seq += 1
            await asyncio.sleep(0.1)

    async def next(self) -> dpb.DriverMessage:
        return await asyncio.wait_for(self.inbox.get(), 5)

    async def nothing(self) -> None:
        """No command comes within 0.3 s."""
        await asyncio.sleep(0.3)
        assert self.inbox.empty(), self.inbox.get_nowait()

    async def ack(self, msg: dpb.DriverMessage) -> None:
        ack = dpb.CommandAck(command_id=msg.command_id, ok=True, ring_fresh=True)
        async with self.writing:
            await self.call.write(dpb.AgentMessage(ack=ack))

    def close(self) -> None:
        self.beater.cancel()
        self.reader.cancel()
        self.call.cancel()


async def _open(stub: dgrpc.DriverStub, node: str, epoch: int) -> Agent:
    return Agent(stub.Session(metadata=session_md(node, epoch)))


def test_a_stop_goes_once_per_session_and_command() -> None:
    async def go() -> None:
        async with driver() as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                for n in ("a", "b"):
                    await stub.Register(dpb.RegisterRequest(node_id=n, epoch=1))
                calls = {n: await _open(stub, n, 1) for n in ("a", "b")}
                await until(lambda: all(svc.view.nodes[n].outbox for n in calls), 5, "sessions")
                fan = Fanout(svc, svc.view, timeout_s=5.0)
                nodes = ("a", "b")

                # two decisions stop the world before either node answered: one stop each
                acks1: dict[str, dpb.CommandAck] = {}
                acks2: dict[str, dpb.CommandAck] = {}
                first = asyncio.create_task(fan.broadcast(nodes, STOP, acks=acks1))
                got = {n: await c.next() for n, c in calls.items()}
                second = asyncio.create_task(fan.broadcast(nodes, STOP, acks=acks2))
                for c in calls.values():
                    await c.nothing()
                for n, c in calls.items():
                    assert got[n].WhichOneof("kind") == "stop_workers"
                    await c.ack(got[n])
                assert await first == {} and await second == {}
                assert set(acks1) == set(acks2) == {"a", "b"} and acks2["a"].ring_fresh
                # ...and a third, after the acks: still none sent
                assert await fan.broadcast(nodes, STOP) == {}
                for c in calls.values():
                    await c.nothing()
                assert fan.stops_reused == 4

                # a's workers started: its next stop goes again; b's does not
                fan.forget("a")
                third = asyncio.create_task(fan.broadcast(nodes, STOP))
                m = await calls["a"].next()
                await calls["b"].nothing()
                await calls["a"].ack(m)
                assert await third == {}

                # another stop (an in-job stop naming b's ranks to replace) goes to b
                def in_job(n: str) -> dpb.DriverMessage:
                    replace = [0] if n == "b" else []
                    stop = dpb.StopWorkers(grace_s=1.0, in_job=True, replace_local_ranks=replace)
                    return dpb.DriverMessage(stop_workers=stop)

                fourth = asyncio.create_task(fan.broadcast(nodes, in_job))
                got = {n: await c.next() for n, c in calls.items()}  # a's differs too: in_job
                assert list(got["b"].stop_workers.replace_local_ranks) == [0]
                for n, c in calls.items():
                    await c.ack(got[n])
                assert await fourth == {}

                # b's new session (its agent reconnected) is stopped again
                old = svc.view.nodes["b"].outbox
                calls["b"].close()
                calls["b"] = await _open(stub, "b", 1)
                # the new session's outbox, not the old one the driver has not yet let go of
                await until(lambda: svc.view.nodes["b"].outbox not in (None, old), 5, "b's new")
                fifth = asyncio.create_task(fan.broadcast(nodes, in_job))
                m = await calls["b"].next()
                await calls["a"].nothing()
                await calls["b"].ack(m)
                assert await fifth == {}
                for c in calls.values():
                    c.close()

    asyncio.run(go())


def test_a_broadcasts_failures_are_one_line() -> None:
    async def go() -> None:
        async with driver() as (svc, _store, _addr):
            fan = Fanout(svc, svc.view, timeout_s=1.0)
            nodes = tuple(f"gone{i:03d}" for i in range(100))  # no session: KeyError each
            with structlog.testing.capture_logs() as logs:
                bad = await fan.broadcast(nodes, dpb.DriverMessage(resume=dpb.Resume()))
            assert set(bad) == set(nodes) and all(e.startswith("KeyError") for e in bad.values())
            lines = [x for x in logs if x["event"] == "command not done everywhere"]
            assert len(lines) == 1
            assert lines[0]["failed"] == 100 and lines[0]["of"] == 100
            assert lines[0]["kind"] == "resume" and len(lines[0]["errors"]) == 16

    asyncio.run(go())


def test_a_node_that_does_not_answer_fails_at_the_deadline_and_its_stop_goes_again() -> None:
    async def go() -> None:
        async with driver() as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await stub.Register(dpb.RegisterRequest(node_id="a", epoch=1))
                a = await _open(stub, "a", 1)
                await until(lambda: svc.view.nodes["a"].outbox is not None, 5, "a's session")
                fan = Fanout(svc, svc.view, timeout_s=0.3)
                t0 = time.monotonic()
                bad = await fan.broadcast(("a",), STOP)
                assert 0.25 < time.monotonic() - t0 < 2.0
                assert bad["a"].startswith("TimeoutError"), bad
                assert not svc.sessions._replies  # nothing left waiting
                first = await a.next()
                # the unanswered stop does not count: the next decision's goes again
                second = asyncio.create_task(fan.broadcast(("a",), STOP))
                again = await a.next()
                assert again.command_id != first.command_id
                await a.ack(again)
                assert await second == {}
                a.close()

    asyncio.run(go())


def test_a_broadcast_a_newer_decision_took_over_stops_queuing() -> None:
    """Once `current()` says a newer decision took over (it broadcasts its own), no more
    commands are queued: at 10,240 nodes each of an incident's decisions went through the
    whole world. Checked at each turn of the event loop (every YIELD_EVERY nodes)."""
    from unbroken.driver.fanout import YIELD_EVERY
    from unbroken.driver.liveview import LiveView, LiveViewConfig

    sent: list[str] = []

    class Recorder:  # the sessions' side, recording what the broadcast queues
        def send(self, node_id: str, msg: dpb.DriverMessage) -> str:
            sent.append(node_id)
            return str(len(sent))

        def ask(
            self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
        ) -> asyncio.Future[dpb.AgentMessage]:
            raise AssertionError("not asked: wait=False")

    nodes = tuple(f"n{i:04d}" for i in range(4 * YIELD_EVERY))
    turns = 0

    def current() -> bool:
        nonlocal turns
        turns += 1
        return turns < 2  # superseded at the second turn

    async def go() -> None:
        fan = Fanout(Recorder(), LiveView(LiveViewConfig()), timeout_s=1.0)
        await fan.broadcast(nodes, STOP, wait=False, current=current)
        assert sent == list(nodes[: 2 * YIELD_EVERY])
        sent.clear()
        await fan.broadcast(nodes, STOP, wait=False)  # no `current`: every node
        assert sent == list(nodes)

    asyncio.run(go())
