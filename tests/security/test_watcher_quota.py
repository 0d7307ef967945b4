"""Event watchers are shared out by principal, and operators always get one.

64 `WatchEvents` streams of one viewer token used to take every slot: the operator's
`unbroken events` was then refused. Now one principal holds at most a quarter of the
slots and the last eighth are kept for operators. Real gRPC, the driver service
in-process with role tokens; the watches are real follow streams.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.inproc import driver, until
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

VIEWERS = {f"v{i}": f"viewer-token-{i}-0123456789abcdef" for i in range(4)}
OPERATOR = "operator-token-0123456789abcdef"


def test_viewers_cannot_lock_the_operator_out_of_the_event_stream() -> None:
    tokens = RoleTokens(
        {"viewer": [f"{t} {n}" for n, t in VIEWERS.items()], "operator": [f"{OPERATOR} alice"]}
    )

    async def go() -> None:
        # 8 slots: 2 per principal, the last one kept for operators
        async with driver(ServiceConfig(tokens=tokens, max_watchers=8)) as (svc, _s, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                req = dpb.WatchEventsRequest(follow=True)

                def watch(token: str) -> grpc.aio.UnaryStreamCall:
                    return stub.WatchEvents(req, metadata=(("authorization", f"Bearer {token}"),))

                async def refused(token: str) -> str:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await asyncio.wait_for(watch(token).read(), 10)
                    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    return e.value.details() or ""

                ops = svc.operators
                calls = []

                async def streaming(token: str) -> None:
                    calls.append(watch(token))
                    n = ops.watchers + 1
                    await until(lambda: ops.watchers == n, 10, f"{n} watches streaming")

                for _ in range(2):
                    await streaming(VIEWERS["v0"])
                assert "this principal already has 2" in await refused(VIEWERS["v0"])
                for v in ("v1", "v2"):
                    for _ in range(2):
                        await streaming(VIEWERS[v])
                await streaming(VIEWERS["v3"])  # the seventh: the last non-reserved slot
                assert "kept for operators" in await refused(VIEWERS["v3"])
                await streaming(OPERATOR)  # the operator still gets the reserved slot
                assert ops.watchers_of["operator:alice"] == 1
                for c in calls:
                    c.cancel()

    asyncio.run(go())
