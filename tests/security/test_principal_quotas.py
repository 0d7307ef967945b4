"""One node's credential cannot wear out what the job shares: streams, registrations,
relay capacity (the rendezvous' per-principal quotas are in test_rdzv_quota.py).

Real gRPC against the driver service in-process, with per-node named tokens.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.inproc import driver, session_md, until
from unbroken.common import channel
from unbroken.driver.principalquota import PrincipalQuotas
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

NODES = ("a", "b", "r0", "m1", "m2", "m3")
TOKENS = {n: f"quota-token-{n}-0123456789abcdef" for n in NODES}


def md(node: str, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[node]}"), *extra)


def _config(**quotas: int) -> ServiceConfig:
    tokens = RoleTokens({"node": [f"{t} {n}" for n, t in TOKENS.items()]})
    if not quotas:
        return ServiceConfig(tokens=tokens)
    return ServiceConfig(tokens=tokens, quotas=PrincipalQuotas(**quotas))


async def _ended(call: grpc.aio.StreamStreamCall, within_s: float) -> grpc.StatusCode | None:
    """The status the stream ended with within `within_s` (None: still open)."""
    try:
        async with asyncio.timeout(within_s):
            while True:
                if await call.read() == grpc.aio.EOF:
                    return grpc.StatusCode.OK
    except TimeoutError:
        return None
    except grpc.aio.AioRpcError as e:
        return e.code()


def test_a_newer_session_of_a_node_replaces_its_older_one() -> None:
    async def go() -> None:
        async with driver(_config()) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await stub.Register(dpb.RegisterRequest(node_id="a", epoch=1), metadata=md("a"))
                calls = []
                for _ in range(3):
                    calls.append(stub.Session(metadata=md("a", *session_md("a", 1))))
                    await until(lambda: svc.view.nodes["a"].connected, 5, "the session")
                    await asyncio.sleep(0.2)
                # the older streams are ended, the newest holds the node's commands
                for old in calls[:-1]:
                    assert await _ended(old, 5) == grpc.StatusCode.ABORTED, (
                        "an older session of the same node is still open"
                    )
                svc.send("a", dpb.DriverMessage(pause=dpb.Pause()))
                got = await asyncio.wait_for(calls[-1].read(), 5)
                assert got.WhichOneof("kind") == "pause"
                calls[-1].cancel()

    asyncio.run(go())


def test_one_node_registers_new_epochs_at_a_bounded_rate() -> None:
    async def go() -> None:
        async with driver(_config(registrations_per_minute=5)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                codes = []
                for epoch in range(1, 9):
                    try:
                        await stub.Register(
                            dpb.RegisterRequest(node_id="a", epoch=epoch), metadata=md("a")
                        )
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
                        detail = e.details() or ""
                assert codes[:5] == [grpc.StatusCode.OK] * 5
                assert codes[5:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3, codes
                assert "node:a" in detail and "registrations_per_minute=5" in detail
                assert svc.view.nodes["a"].epoch == 5  # nothing of the refused ones landed
                # another node is not held back by a's quota, and a's live epoch reconnects
                await stub.Register(dpb.RegisterRequest(node_id="b", epoch=1), metadata=md("b"))
                await stub.Register(dpb.RegisterRequest(node_id="a", epoch=5), metadata=md("a"))

    asyncio.run(go())


def test_a_relay_carries_a_bounded_number_of_members() -> None:
    async def go() -> None:
        async with driver(_config(max_relay_members=2)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await stub.Register(dpb.RegisterRequest(node_id="r0", epoch=1), metadata=md("r0"))
                via = (channel.RELAY_KEY, "r0")
                for m in ("m1", "m2"):
                    await stub.Register(
                        dpb.RegisterRequest(node_id=m, epoch=1), metadata=md(m, via)
                    )
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Register(
                        dpb.RegisterRequest(node_id="m3", epoch=1), metadata=md("m3", via)
                    )
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_relay_members=2" in (e.value.details() or "")
                assert "m3" not in svc.view.nodes or svc.view.nodes["m3"].relay != "r0"
                # m3 may register directly; once m2 leaves the relay, m3 may join it
                await stub.Register(dpb.RegisterRequest(node_id="m3", epoch=1), metadata=md("m3"))
                await stub.Register(dpb.RegisterRequest(node_id="m2", epoch=2), metadata=md("m2"))
                await stub.Register(
                    dpb.RegisterRequest(node_id="m3", epoch=2), metadata=md("m3", via)
                )
                assert svc.view.nodes["m3"].relay == "r0"

    asyncio.run(go())
