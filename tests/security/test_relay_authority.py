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
from unbroken.common import channel, reportmac
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
                await until(lambda: svc.agents.relay_refused >= 5, 5, "the refused entries")
                assert nodes["m2"].heartbeats == 0 and nodes["m2"].alive
                assert (
                    svc.agents.relay_refused == 5
                )  # m1's wrong epoch; m2's beat, alive, silent, shard
                assert svc.commits.ignored == 0  # the shard never reached the bookkeeping
                # a command for m1 goes down the relay's stream, wrapped for m1
                cid = svc.send("m1", dpb.DriverMessage(pause=dpb.Pause(reason="t")))
                down = await asyncio.wait_for(call.read(), 5)
                assert down.WhichOneof("kind") == "relayed"
                assert down.relayed.node_id == "m1" and down.relayed.command.command_id == cid
                call.cancel()

    asyncio.run(go())


def test_a_relay_cannot_forge_or_alter_its_members_shard_reports() -> None:
    """A shard report through a relay counts only when its member signed it with the key
    the driver handed the member at its own Register: the relay's unsigned report, a report
    it signed with a key of its own, and a signed report it altered are all refused; the
    member's own signed report, carried by the same relay, counts."""
    tokens = RoleTokens({"node": [f"{t} {n}" for n, t in TOKENS.items()]})

    def report(step: int) -> dpb.ShardsPersisted:
        return dpb.ShardsPersisted(
            shards=[dpb.ShardPersisted(step=step, rank=0, uri="x", world_size=2, bytes=1)]
        )

    async def go() -> None:
        async with driver(ServiceConfig(tokens=tokens)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                relay_reg = await stub.Register(
                    dpb.RegisterRequest(node_id="r0", epoch=1), metadata=md("r0")
                )
                member = await stub.Register(
                    dpb.RegisterRequest(node_id="m1", epoch=7),
                    metadata=md("m1", (channel.RELAY_KEY, "r0")),
                )
                assert len(member.report_key) == 32 and member.report_key != relay_reg.report_key
                call = stub.Session(metadata=md("r0", *session_md("r0", 1)))
                await call.write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=1)))

                async def up(msg: dpb.AgentMessage) -> None:
                    await call.write(
                        dpb.AgentMessage(relayed=dpb.RelayedUp(node_id="m1", epoch=7, message=msg))
                    )

                await up(dpb.AgentMessage(shards_persisted=report(100)))  # unsigned
                forged = reportmac.sign(relay_reg.report_key, 7, report(101))  # the relay's key
                await up(dpb.AgentMessage(signed_report=forged))
                altered = reportmac.sign(member.report_key, 7, report(5))
                altered.shards_persisted = report(10**12).SerializeToString()
                await up(dpb.AgentMessage(signed_report=altered))
                replayed = reportmac.sign(member.report_key, 6, report(102))  # another epoch
                await up(dpb.AgentMessage(signed_report=replayed))
                await until(
                    lambda: svc.agents.relay_refused >= 4, 5, "the four forged reports refused"
                )
                assert "m1" not in svc.commits.by_node  # none reached the bookkeeping
                own = reportmac.sign(member.report_key, 7, report(5))
                await up(dpb.AgentMessage(signed_report=own))
                await until(lambda: "m1" in svc.commits.by_node, 5, "m1's own signed report")
                assert svc.commits.by_node["m1"] == {0: 5}
                assert svc.agents.relay_refused == 4
                call.cancel()

    asyncio.run(go())


def test_a_relays_batch_of_replies_speaks_only_for_its_members_at_their_epoch() -> None:
    """The entries of a RelayedUpBatch are checked one by one as a RelayedUp is: m2 (which
    did not choose r0) and m1 at a wrong epoch are refused, m1's reply to m2's command
    answers nothing, m1's own reply answers its request; a batch past the driver's cap has
    the rest refused, not read."""
    from unbroken.driver.agentapi import RELAYED_BATCH_MAX

    tokens = RoleTokens({"node": [f"{t} {n}" for n, t in TOKENS.items()]})

    async def go() -> None:
        async with driver(ServiceConfig(tokens=tokens)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await stub.Register(
                    dpb.RegisterRequest(node_id="r0", epoch=1, relay_batches=True),
                    metadata=md("r0"),
                )
                await stub.Register(
                    dpb.RegisterRequest(node_id="m1", epoch=7),
                    metadata=md("m1", (channel.RELAY_KEY, "r0")),
                )
                await stub.Register(dpb.RegisterRequest(node_id="m2", epoch=9), metadata=md("m2"))
                m2 = stub.Session(metadata=md("m2", *session_md("m2", 9)))
                await m2.write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=1)))
                call = stub.Session(metadata=md("r0", *session_md("r0", 1)))
                b = dpb.RelayBatch(own=dpb.Heartbeat(seq=1))
                b.beats.add(node_id="m1", epoch=7).heartbeat.seq = 1
                await call.write(dpb.AgentMessage(relay_batch=b))
                nodes = svc.view.nodes
                await until(lambda: nodes["m1"].outbox is not None, 5, "m1 carried by r0")
                await until(lambda: nodes["m2"].outbox is not None, 5, "m2's own session")
                mine = svc.ask("m1", dpb.DriverMessage(pause=dpb.Pause(reason="t")), 5)
                theirs = svc.ask("m2", dpb.DriverMessage(pause=dpb.Pause(reason="t")), 1.0)
                down = await asyncio.wait_for(call.read(), 5)
                cid1 = down.relayed.command.command_id
                cid2 = (await asyncio.wait_for(m2.read(), 5)).command_id
                before = svc.agents.relay_refused
                batch = dpb.AgentMessage()
                ups = batch.relayed_batch.up

                def ack(cid: str) -> dpb.AgentMessage:
                    return dpb.AgentMessage(ack=dpb.CommandAck(command_id=cid, ok=True))

                ups.add(node_id="m2", epoch=9, message=ack(cid2))  # not r0's member
                ups.add(node_id="m1", epoch=6, message=ack(cid1))  # a wrong epoch
                shard = dpb.ShardPersisted(step=5, rank=0, uri="x", world_size=1)
                ups.add(node_id="m2", epoch=9, message=dpb.AgentMessage(shard_persisted=shard))
                # a command id is a counter now: m1 answering m2's (guessed) id answers
                # nothing (Sessions.reply checks the node the command went to)
                ups.add(node_id="m1", epoch=7, message=ack(cid2))
                ups.add(node_id="m1", epoch=7, message=ack(cid1))  # its own, last
                await call.write(batch)
                assert (await asyncio.wait_for(mine, 5)).ack.ok
                with pytest.raises(TimeoutError):
                    await theirs
                assert svc.agents.relay_refused == before + 3
                assert svc.commits.ignored == 0
                flood = dpb.AgentMessage()
                for _ in range(RELAYED_BATCH_MAX + 5):
                    flood.relayed_batch.up.add(node_id="m2", epoch=9)
                await call.write(flood)
                await until(
                    lambda: svc.agents.relay_refused == before + 3 + RELAYED_BATCH_MAX + 5,
                    5,
                    "every entry of the flood refused: the cap's and m2's",
                )
                call.cancel()
                m2.cancel()

    asyncio.run(go())
