"""Request bytes that are not a valid message get INVALID_ARGUMENT naming the rpc and the
message type, on every gRPC server of ours (the driver's service with the rendezvous and
health services beside it, and an agent's relay), never UNKNOWN with a Python class name.

Sent as a foreign client sends them: a raw channel, no serializer, garbage bytes.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.inproc import driver
from unbroken.agent.relay import Relay, RelayConfig
from unbroken.common import channel
from unbroken.driver.agentapi import LIVE_VIEW_MAX_PAGE
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration
GARBAGE = b"\xff\xff garbage"
TOKEN = "malformed-test-token-0123456789"
D = "/unbroken.driver.v1.Driver/"


async def unary(ch: grpc.aio.Channel, path: str, md: tuple[tuple[str, str], ...] = ()) -> Exception:
    call = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(GARBAGE, timeout=10, metadata=md)
    return info.value


async def session(ch: grpc.aio.Channel, node: str) -> Exception:
    """Garbage as the first message of node `node`'s (epoch 1) Session stream."""
    call = ch.stream_stream(D + "Session", request_serializer=None, response_deserializer=None)(
        iter([GARBAGE]), metadata=((channel.NODE_KEY, node), (channel.EPOCH_KEY, "1")), timeout=10
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value


def assert_invalid(err: Exception, path: str, message_type: str) -> None:
    assert isinstance(err, grpc.aio.AioRpcError)
    details = err.details() or ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), details)
    assert path in details and f"not a valid {message_type} message" in details, details
    assert "<class" not in details and "Unexpected" not in details, details


def test_driver_answers_invalid_argument_to_garbage() -> None:
    async def go() -> None:
        async with (
            driver(ServiceConfig(), rendezvous=True) as (_, _, addr),
            grpc.aio.insecure_channel(addr) as ch,
        ):
            for method, message in (
                ("Register", "RegisterRequest"),
                ("GetStatus", "GetStatusRequest"),
                ("InjectFault", "InjectFaultRequest"),
            ):
                err = await unary(ch, D + method)
                assert_invalid(err, D + method, f"unbroken.driver.v1.{message}")
            # a server-streaming rpc
            watch = ch.unary_stream(
                D + "WatchEvents", request_serializer=None, response_deserializer=None
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in watch(GARBAGE, timeout=10):
                    pass
            assert_invalid(info.value, D + "WatchEvents", "unbroken.driver.v1.WatchEventsRequest")
            # the rendezvous and health services on the same server
            path = "/unbroken.rendezvous.v1.Rendezvous/GetState"
            assert_invalid(await unary(ch, path), path, "unbroken.rendezvous.v1.GetStateRequest")
            path = "/grpc.health.v1.Health/Check"
            assert_invalid(await unary(ch, path), path, "grpc.health.v1.HealthCheckRequest")
            # the bidirectional session (read with context.read()) of a registered node
            await dgrpc.DriverStub(ch).Register(dpb.RegisterRequest(node_id="n0", epoch=1))
            err = await session(ch, "n0")
            assert_invalid(err, D + "Session", "unbroken.driver.v1.AgentMessage")
            # and the driver still serves well-formed calls
            status = await dgrpc.DriverStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=10)
            assert status.job_id == "job"

    asyncio.run(go())


def test_a_refused_call_is_refused_before_its_bytes_are_parsed() -> None:
    async def go() -> None:
        cfg = ServiceConfig(tokens=RoleTokens({"operator": [TOKEN]}))
        async with (
            driver(cfg, rendezvous=True) as (_, _, addr),
            grpc.aio.insecure_channel(addr) as ch,
        ):
            err = await unary(ch, D + "GetStatus")
            assert isinstance(err, grpc.aio.AioRpcError)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            md = (("authorization", f"Bearer {TOKEN}"),)
            err = await unary(ch, D + "GetStatus", md)
            assert_invalid(err, D + "GetStatus", "unbroken.driver.v1.GetStatusRequest")

    asyncio.run(go())


def test_relay_answers_invalid_argument_to_garbage() -> None:
    async def go() -> None:
        relay = Relay(RelayConfig(listen="127.0.0.1:0"), "r0", 0.1)
        sent: list[dpb.AgentMessage] = []

        async def upstream(msg: dpb.AgentMessage) -> None:
            sent.append(msg)

        relay.upstream = upstream  # as when the relay holds its own driver session
        port = await relay.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                err = await session(ch, "m0")
                assert_invalid(err, D + "Session", "unbroken.driver.v1.AgentMessage")
                assert sent == []  # nothing went up
                path = D + "Register"
                assert_invalid(await unary(ch, path), path, "unbroken.driver.v1.RegisterRequest")
        finally:
            await relay.close()

    asyncio.run(go())


def test_live_view_pages_and_refuses_an_oversized_page() -> None:
    """A page larger than the cap is refused (INVALID_ARGUMENT, naming the cap), not served
    from the whole view; pages chained by `next_after` list every node once, in order."""

    async def go() -> None:
        async with driver() as (svc, _store, addr), grpc.aio.insecure_channel(addr) as ch:
            now = time.monotonic()
            names = [f"n{i:03d}" for i in range(25)]
            for name in names:
                slot = svc.view.slot(name)
                svc.view.mark_registered(slot, now)
                svc.view.mark_alive(slot, now)
            stub = dgrpc.DriverStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                too_big = dpb.LiveViewRequest(page_size=LIVE_VIEW_MAX_PAGE + 1)
                await stub.LiveView(too_big, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(LIVE_VIEW_MAX_PAGE) in (info.value.details() or "")
            seen, after, pages = [], "", 0
            while True:
                req = dpb.LiveViewRequest(page_size=10, after=after)
                page = await stub.LiveView(req, timeout=10)
                pages += 1
                seen += [n.node_id for n in page.nodes]
                if not page.next_after:
                    break
                after = page.next_after
            assert seen == names and pages == 3, (seen, pages)
            whole = await stub.LiveView(dpb.LiveViewRequest(), timeout=10)  # no page: all
            assert [n.node_id for n in whole.nodes] == names and not whole.next_after

    asyncio.run(go())
