"""A relay never widens anyone's authority (docs/relays.md).

Real gRPC, the driver service in-process with per-node named tokens: relay r0 may carry
heartbeats and replies only of members whose own registration named r0, at their
registered epoch. A member that registered directly (or named another relay), a wrong
epoch, and a member's report of a shard that is not its own are all refused; the relay
cannot open a session as one of its members either.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.inproc import driver, session_md, until
from unbroken.common import channel
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

TOKENS = {
    "r0": "relay-token-r0-0123456789",
    "m1": "member-token-m1-012345",
    "m2": "member-m2-0123456789ab",
}


def md(node: str, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[node]}"), *extra)


def test_relay_speaks_only_for_members_that_chose_it() -> None:
    tokens = RoleTokens({"node": [f"{t} {n}" for n, t in TOKENS.items()]})

    async def go() -> None:
        async with driver(ServiceConfig(tokens=tokens)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await stub.Register(dpb.RegisterRequest(node_id="r0", epoch=1), metadata=md("r0"))
                await stub.Register(
                    dpb.RegisterRequest(node_id="m1", epoch=7),
                    metadata=md("m1", (channel.RELAY_KEY, "r0")),
                )
                # m2 registers on its own, naming no relay
                await stub.Register(dpb.RegisterRequest(node_id="m2", epoch=9), metadata=md("m2"))

                # the relay's token cannot open a session as its member
                bad = stub.Session(metadata=md("r0", *session_md("m1", 7)))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await bad.read()
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

                call = stub.Session(metadata=md("r0", *session_md("r0", 1)))
                b = dpb.RelayBatch()
                b.beats.add(node_id="m1", epoch=7).heartbeat.seq = 1
                b.beats.add(node_id="m1", epoch=6).heartbeat.seq = 2  # a wrong epoch
                b.beats.add(node_id="m2", epoch=9).heartbeat.seq = 1  # did not choose r0
                b.alive.append("m2")
                b.silent.add(node_id="m2", epoch=9, silent_ms=5000)  # cannot get m2 declared lost
                await call.write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=1)))
                await call.write(dpb.AgentMessage(relay_batch=b))
                # nor report a shard as m2
                shard = dpb.AgentMessage(
                    shard_persisted=dpb.ShardPersisted(step=5, rank=0, uri="x", world_size=1)
                )
                await call.write(
                    dpb.AgentMessage(relayed=dpb.RelayedUp(node_id="m2", epoch=9, message=shard))
                )
                nodes = svc.view.nodes
                await until(lambda: nodes["m1"].heartbeats == 1, 5, "m1's relayed heartbeat")
                await until(lambda: svc.relay_refused >= 5, 5, "the refused entries")
                assert nodes["m2"].heartbeats == 0 and nodes["m2"].alive
                assert svc.relay_refused == 5  # m1's wrong epoch; m2's beat, alive, silent, shard
                assert svc.commits.ignored == 0  # the shard never reached the bookkeeping
                # a command for m1 goes down the relay's stream, wrapped for m1
                cid = svc.send("m1", dpb.DriverMessage(pause=dpb.Pause(reason="t")))
                down = await asyncio.wait_for(call.read(), 5)
                assert down.WhichOneof("kind") == "relayed"
                assert down.relayed.node_id == "m1" and down.relayed.command.command_id == cid
                call.cancel()

    asyncio.run(go())
