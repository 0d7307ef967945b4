"""A command to the whole world reaches every member of a full relay group.

Real gRPC, the driver service in-process: relay r0 carries 64 members (the group size the
scale bench and a real deployment use), and a command to every node puts one per node into
r0's stream before its writer runs (the recovery loop's broadcast does exactly that). The
stream's outbox holds `stream_buffer` commands for each node it carries: with one node's
bound the 65th command overflowed, the driver dropped every member's stream and the relay's
own, and at 10,240 nodes each of those losses opened the next incident. The members'
replies that come up the relay's stream count as the relay and its group heard.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.inproc import driver, session_md, until
from unbroken.common import channel
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

MEMBERS = [f"m{i:02d}" for i in range(64)]


def test_a_broadcast_to_a_full_group_fits_its_relays_stream() -> None:
    async def go() -> None:
        async with driver(ServiceConfig(stream_buffer=4)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await stub.Register(dpb.RegisterRequest(node_id="r0", epoch=1))
                for m in MEMBERS:
                    await stub.Register(
                        dpb.RegisterRequest(node_id=m, epoch=7),
                        metadata=((channel.RELAY_KEY, "r0"),),
                    )
                call = stub.Session(metadata=session_md("r0", 1))
                b = dpb.RelayBatch(own=dpb.Heartbeat(seq=1), group_alive=True)
                for m in MEMBERS:
                    b.beats.add(node_id=m, epoch=7).heartbeat.seq = 1
                await call.write(dpb.AgentMessage(relay_batch=b))
                nodes = svc.view.nodes
                await until(
                    lambda: all(nodes[m].heartbeats == 1 for m in MEMBERS), 5, "every member"
                )
                # every node's command queued in one go, as the loop's broadcast does: 65
                # into a stream whose own bound is 4
                sent = {svc.send(n, dpb.DriverMessage(pause=dpb.Pause(reason="t"))): n
                        for n in ["r0", *MEMBERS]}  # fmt: skip
                assert svc.sessions.dropped_commands == 0
                got: dict[str, str] = {}
                while len(got) < len(sent):
                    down = await asyncio.wait_for(call.read(), 5)
                    assert down != grpc.aio.EOF, "the driver ended the relay's stream"
                    if down.WhichOneof("kind") == "relayed":
                        got[down.relayed.command.command_id] = down.relayed.node_id
                    else:
                        got[down.command_id] = "r0"
                assert got == sent
                assert all(nodes[n].outbox is not None for n in ["r0", *MEMBERS])
                # the members' acks, read ahead of the relay's next batch, are the relay's
                # word too: it is heard (at 10,240 nodes they delayed its batch 1.3 s)
                before = nodes["r0"].last_seen
                group = svc.view.groups["r0"]
                assert set(group.members) == set(MEMBERS)
                vouched = group.seen
                for cid, n in list(sent.items())[1:]:
                    ack = dpb.AgentMessage(ack=dpb.CommandAck(command_id=cid, ok=True))
                    up = dpb.RelayedUp(node_id=n, epoch=7, message=ack)
                    await call.write(dpb.AgentMessage(relayed=up))
                await until(lambda: nodes["r0"].last_seen > before, 5, "the relay heard")
                assert group.seen > vouched  # and the group it vouches for
                # still bounded: a relay that stops reading is dropped once its members'
                # room is used up too
                for _ in range(4 * 65 + 1):
                    svc.send("m00", dpb.DriverMessage(pause=dpb.Pause(reason="t")))
                assert svc.sessions.dropped_commands == 1
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    while True:
                        assert await asyncio.wait_for(call.read(), 5) != grpc.aio.EOF
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(go())
