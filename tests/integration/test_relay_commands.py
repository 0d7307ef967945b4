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
import time
from typing import Any

import grpc
import pytest

from tests.inproc import driver, session_md, until
from unbroken.common import channel
from unbroken.driver.agentapi import RELAYED_BATCH_MAX
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

MEMBERS = [f"m{i:02d}" for i in range(64)]


async def _full_group(stub: dgrpc.DriverStub, *, batches: bool = False) -> tuple[Any, Any]:
    """Relay r0 (epoch 1; `batches`: it takes RelayedDownBatch) and its 64 members (epoch 7)
    registered; r0's RegisterResponse and its open Session."""
    resp = await stub.Register(dpb.RegisterRequest(node_id="r0", epoch=1, relay_batches=batches))
    for m in MEMBERS:
        await stub.Register(
            dpb.RegisterRequest(node_id=m, epoch=7), metadata=((channel.RELAY_KEY, "r0"),)
        )
    return resp, stub.Session(metadata=session_md("r0", 1))


def test_a_broadcast_to_a_full_group_fits_its_relays_stream() -> None:
    async def go() -> None:
        async with driver(ServiceConfig(stream_buffer=4)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                _, call = await _full_group(dgrpc.DriverStub(ch))
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


def test_a_member_whose_relay_went_down_before_carrying_it_waits_twice_the_grace() -> None:
    """m1 registered naming r0 and r0's stream ended before r0 carried it: m1 gets the
    session grace twice (it registers again when r0 is back, or comes on its own), and is
    lost after that. m2, whose relay is up, is lost at the grace (no session after it)."""
    from unbroken.driver.liveview import LiveViewConfig

    live = LiveViewConfig(session_grace_ms=600)
    found: dict[str, float] = {}

    async def go() -> None:
        async with driver(ServiceConfig(live=live)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                for r in ("r0", "r1"):
                    await stub.Register(dpb.RegisterRequest(node_id=r, epoch=1))
                calls = {r: stub.Session(metadata=session_md(r, 1)) for r in ("r0", "r1")}
                for c in calls.values():
                    await c.write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=1)))
                nodes = svc.view.nodes
                await until(lambda: nodes["r0"].connected and nodes["r1"].connected, 5, "relays")
                calls["r0"].cancel()  # r0's stream ends (its agent restarts, say)
                await until(lambda: not nodes["r0"].connected, 5, "r0's stream to end")
                t0 = time.monotonic()
                for m, r in (("m1", "r0"), ("m2", "r1")):
                    await stub.Register(
                        dpb.RegisterRequest(node_id=m, epoch=7),
                        metadata=((channel.RELAY_KEY, r),),
                    )

                async def beat_r1() -> None:  # r1 stays up; it never carries m2
                    for seq in range(2, 1000):
                        await calls["r1"].write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=seq)))
                        await asyncio.sleep(0.05)

                beating = asyncio.create_task(beat_r1())
                while len(found) < 2 and time.monotonic() - t0 < 10:
                    for m in ("m1", "m2"):
                        if m not in found and not nodes[m].alive:
                            found[m] = time.monotonic() - t0
                    await asyncio.sleep(0.02)
                beating.cancel()
                calls["r1"].cancel()

    asyncio.run(go())
    assert set(found) == {"m1", "m2"}, found
    assert 0.55 <= found["m2"] < 1.1, found  # the grace (and a sweep or two)
    assert 1.15 <= found["m1"] < 1.9, found  # twice the grace


def test_a_relay_that_batches_gets_a_broadcast_in_a_few_messages_and_acks_it_in_one() -> None:
    """r0 registered with `relay_batches`: the 64 members' commands queued in one go come
    down in order as a few `RelayedDownBatch` messages (the relay's own command, queued
    first, alone before them), and one `RelayedUpBatch` of their 64 acks answers every
    member's request. The driver says in its RegisterResponse that it takes the batches."""

    async def go() -> None:
        async with driver(ServiceConfig(stream_buffer=4)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                resp, call = await _full_group(dgrpc.DriverStub(ch), batches=True)
                assert resp.relay_batches
                b = dpb.RelayBatch(own=dpb.Heartbeat(seq=1), group_alive=True)
                b.alive.extend(MEMBERS)
                await call.write(dpb.AgentMessage(relay_batch=b))
                nodes = svc.view.nodes
                await until(lambda: all(nodes[m].outbox for m in MEMBERS), 5, "every member")
                replies = {
                    n: svc.ask(n, dpb.DriverMessage(pause=dpb.Pause(reason="t")), 10)
                    for n in ["r0", *MEMBERS]
                }
                messages = 0
                order: list[str] = []
                ids: dict[str, str] = {}
                while len(order) < len(replies):
                    down = await asyncio.wait_for(call.read(), 5)
                    assert down != grpc.aio.EOF, "the driver ended the relay's stream"
                    messages += 1
                    kind = down.WhichOneof("kind")
                    if kind == "relayed_batch":
                        for d in down.relayed_batch.down:
                            order.append(d.node_id)
                            ids[d.node_id] = d.command.command_id
                    else:
                        assert kind == "pause" and not order, down  # r0's own, first
                        order.append("r0")
                        ids["r0"] = down.command_id
                assert order == ["r0", *MEMBERS]
                assert messages <= 3, messages  # r0's own, then the members' in one or two
                assert svc.sessions.dropped_commands == 0
                acks = dpb.AgentMessage()
                for m in MEMBERS:
                    ack = dpb.AgentMessage(ack=dpb.CommandAck(command_id=ids[m], ok=True))
                    acks.relayed_batch.up.add(node_id=m, epoch=7, message=ack)
                await call.write(acks)
                await call.write(
                    dpb.AgentMessage(ack=dpb.CommandAck(command_id=ids["r0"], ok=True))
                )
                got = await asyncio.wait_for(asyncio.gather(*replies.values()), 5)
                assert all(r.ack.ok for r in got)
                # a member's ack under another member's name answers nothing
                wrong = svc.ask("m01", dpb.DriverMessage(pause=dpb.Pause(reason="t")), 1.0)
                down = await asyncio.wait_for(call.read(), 5)
                assert down.WhichOneof("kind") == "relayed"  # one command: as it is
                cid = down.relayed.command.command_id
                forged = dpb.AgentMessage()
                ack = dpb.AgentMessage(ack=dpb.CommandAck(command_id=cid, ok=True))
                forged.relayed_batch.up.add(node_id="m01", epoch=8, message=ack)  # not its epoch
                await call.write(forged)
                with pytest.raises(TimeoutError):
                    await wrong
                # a batch past the cap: the entries beyond it are refused, not read
                refused = svc.agents.relay_refused
                flood = dpb.AgentMessage()
                for i in range(RELAYED_BATCH_MAX + 6):
                    flood.relayed_batch.up.add(node_id=MEMBERS[i % 64], epoch=7)
                await call.write(flood)
                await until(lambda: svc.agents.relay_refused >= refused + 6, 5, "the cap")

    asyncio.run(go())


@pytest.mark.parametrize("batch_up", [True, False])
def test_a_members_rescanned_rings_go_up_before_its_stop_ack(batch_up: bool) -> None:
    """A member acks a stop with `ring_fresh` right after a heartbeat with its rings
    rescanned; the driver then reads the steps each rank holds without waiting for more
    heartbeats. The relay (real gRPC, a real member stream) sends that heartbeat up ahead
    of the ack. Before, it waited for the periodic batch, behind the ack, and since a new
    copy in a ring changes no step the batch named the member only as alive: the driver
    chose the restore step from rings a heartbeat old. With `batch_up` the members' acks
    of one window go as one message, behind one batch of all their heartbeats."""
    from unbroken.agent.relay import Relay, RelayConfig

    def kinds(up: list[dpb.AgentMessage]) -> list[str]:
        return [str(m.WhichOneof("kind")) for m in up]

    def beat(ring: list[int]) -> dpb.AgentMessage:
        hb = dpb.Heartbeat()
        hb.workers.add(local_rank=0, state=dpb.WORKER_STATE_RUNNING, step=9, ring_steps=ring)
        return dpb.AgentMessage(heartbeat=hb)

    async def go() -> None:
        relay = Relay(RelayConfig(listen="127.0.0.1:0"), "r0", 0.1)
        relay.batch_up = batch_up
        port = await relay.start()
        up: list[dpb.AgentMessage] = []

        async def send(msg: dpb.AgentMessage) -> None:
            up.append(msg)

        forward = asyncio.create_task(relay.forward(send))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = dgrpc.DriverStub(ch).Session(metadata=session_md("m00", 7))
                await call.write(beat([7, 8]))
                members = relay.members
                await until(
                    lambda: "m00" in members and members["m00"].hb is not None, 5, "its beat"
                )
                batch = relay.batch(time.monotonic(), dpb.Heartbeat(seq=1))  # the periodic
                assert [b.node_id for b in batch.beats] == ["m00"]
                await call.write(beat([7, 8, 9]))  # the stop's rescan: step 9 saved
                ack = dpb.CommandAck(command_id="c1", ok=True, ring_fresh=True)
                await call.write(dpb.AgentMessage(ack=ack))
                await until(lambda: kinds(up)[-1:] == ["relayed"], 5, "the ack up")
                call.cancel()
        finally:
            forward.cancel()
            await relay.close()
        assert kinds(up) == ["relay_batch", "relayed"], kinds(up)
        (b,) = up[0].relay_batch.beats
        assert b.node_id == "m00" and list(b.heartbeat.workers[0].ring_steps) == [7, 8, 9]
        assert up[1].relayed.message.ack.command_id == "c1"

    asyncio.run(go())
