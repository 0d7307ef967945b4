"""Commits only from the world: a node outside it cannot commit, retire or steer storage.

Real gRPC: the driver service in-process (an in-memory event log) with per-node bound
tokens, and nodes that speak through real sessions. The attack each test plays: a spare (or
any node of a torchrun job) reports shards of a world of size 1 at steps 10^12..; on the
old code each became a CheckpointCommitted, and the Retention that followed told the real
nodes to delete their committed steps. One node's persist time also set the job's
persistence interval.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.inproc import driver, session_md, until
from unbroken.agent.flash import NodeFlash, NodeFlashConfig
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.persist import list_persisted, shard_uri

pytestmark = pytest.mark.integration

TOKENS = {n: f"{n}-token-0123456789abcdef" for n in ("node-a", "node-b", "spare")}
FORGED = 10**12


def md(node: str, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[node]}"), *extra)


def config() -> ServiceConfig:
    return ServiceConfig(tokens=RoleTokens({"node": [f"{t} {n}" for n, t in TOKENS.items()]}))


async def session(stub: dgrpc.DriverStub, node: str) -> Any:
    await stub.Register(dpb.RegisterRequest(node_id=node, epoch=1, hostname="h"), metadata=md(node))
    return stub.Session(metadata=md(node, *session_md(node, 1)))


def shard(step: int, rank: int, world: int, persist_s: float = 0.0) -> dpb.AgentMessage:
    return dpb.AgentMessage(
        shard_persisted=dpb.ShardPersisted(
            step=step,
            rank=rank,
            uri=f"/ckpt/step-{step}/rank-{rank}.ubf",
            world_size=world,
            url="/ckpt",
            persist_s=persist_s,
        )
    )


def committed(store: Any) -> list[int]:
    return [e.checkpoint_committed.step for e in store.events if e.HasField("checkpoint_committed")]


async def laid_out(svc: Any) -> None:
    world = ev.WorldLayout(dp=2, pp=1, tp=1, node_ids=["node-a", "node-b"], workers_per_node=1)
    await svc.journal.record(ev.Event(job_started=ev.JobStarted(world=world)))


def test_a_spare_outside_the_laid_out_world_cannot_commit() -> None:
    """The spare is registered (it may heartbeat) but holds no rank of the world: its
    shards of a world of size 1 are refused and nothing is committed."""

    async def go() -> None:
        async with driver(config()) as (svc, store, addr):
            await laid_out(svc)
            async with grpc.aio.insecure_channel(addr) as ch:
                call = await session(dgrpc.DriverStub(ch), "spare")
                for step in range(FORGED, FORGED + 3):
                    await call.write(shard(step, 0, 1))
                await until(lambda: svc.commits.ignored >= 3, 5, "the refusals")
                call.cancel()
            assert committed(store) == []

    asyncio.run(go())


def test_a_torchrun_node_reports_only_its_slice_of_the_round() -> None:
    """No laid-out world: the newest rendezvous round binds ranks to its participants in
    rank order. A node outside the round, and a participant claiming a world of size 1,
    commit nothing; the two participants' own shards commit."""

    async def go() -> None:
        async with driver(config()) as (svc, store, addr):
            assert svc.journal is not None
            round_ = ev.RendezvousRound(
                run_id="r", round=1, participants=["node-a@h1_1_0", "node-b@h2_1_0"]
            )
            await svc.journal.record(ev.Event(rendezvous_round=round_))
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                spare, a, b = [await session(stub, n) for n in ("spare", "node-a", "node-b")]
                await spare.write(shard(FORGED, 0, 1))
                await a.write(shard(FORGED, 0, 1))  # a world of 1 is not the round's
                await a.write(shard(FORGED + 1, 1, 2))  # node-b's rank
                await until(lambda: svc.commits.ignored >= 3, 5, "the refusals")
                await a.write(shard(100, 0, 2))
                await b.write(shard(100, 1, 2))
                await until(lambda: committed(store), 5, "the participants' commit")
                for c in (spare, a, b):
                    c.cancel()
            assert committed(store) == [100]

    asyncio.run(go())


def test_retention_never_retires_what_the_live_world_reached_for_a_forged_commit() -> None:
    """Committed 100..102 while both nodes' workers are at step 102; a commit at 10^12
    reaches the log anyway (an old leader's, a restored log). The Retention sent to the
    nodes ignores it: it keeps 100..102 and deletes nothing at or above them."""

    async def go() -> None:
        async with driver(config()) as (svc, store, addr):
            assert svc.journal is not None
            await laid_out(svc)
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                a, b = [await session(stub, n) for n in ("node-a", "node-b")]
                for call in (a, b):
                    hb = dpb.Heartbeat(seq=1)
                    hb.workers.add(local_rank=0, step=102, state=dpb.WORKER_STATE_RUNNING)
                    await call.write(dpb.AgentMessage(heartbeat=hb))
                for step in (100, 101, 102):
                    await a.write(shard(step, 0, 2))
                    await b.write(shard(step, 1, 2))
                await until(lambda: committed(store) == [100, 101, 102], 5, "the commits")
                forged = ev.CheckpointCommitted(step=FORGED, uri="/ckpt/x", ranks=1)
                await svc.journal.record(ev.Event(checkpoint_committed=forged))
                r = svc.keeper.retention()
                assert r is not None and r.below <= 102 and set(r.keep_steps) >= {100, 101, 102}
                # what node-a was told after the forged commit
                told = None
                while True:
                    m = await asyncio.wait_for(a.read(), 5)
                    if m.WhichOneof("kind") == "retention":
                        told = m.retention
                        if FORGED in [c.step for c in svc.journal.state.checkpoints]:
                            if told.below == r.below:
                                break
                assert told.below <= 102, told
                a.cancel()
                b.cancel()

    asyncio.run(go())


def test_one_node_cannot_set_the_persistence_interval() -> None:
    """node-b claims its shard took a day to write; the commit's cost is the lower median
    over the world's nodes, so the persistence interval stays node-a's."""

    async def go() -> None:
        async with driver(config()) as (svc, store, addr):
            assert svc.journal is not None
            await laid_out(svc)
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                a, b = [await session(stub, n) for n in ("node-a", "node-b")]
                await a.write(shard(10, 0, 2, persist_s=2.0))
                await b.write(shard(10, 1, 2, persist_s=86000.0))
                await until(lambda: committed(store) == [10], 5, "the commit")
                a.cancel()
                b.cancel()
            assert svc.journal.state.persist_cost_s == pytest.approx(2.0)

    asyncio.run(go())


def test_an_agent_refuses_a_retention_that_deletes_every_persisted_step(tmp_path: Path) -> None:
    """The agent's own last guard: a Retention that keeps none of its persisted steps
    (keep=[10^12], below=10^12+2) is refused with a clear error and deletes nothing; an
    ordinary one still deletes what it says."""
    persist = tmp_path / "ckpt"
    for step in (100, 101, 102):
        f = Path(shard_uri(str(persist), step, 0))
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"shard")
    flash = NodeFlash(
        NodeFlashConfig(root=str(tmp_path / "flash"), node="node-a", persist_url=str(persist)),
        world_size=1,
    )
    with pytest.raises(ValueError, match="would delete every persisted step"):
        flash.retain([FORGED], FORGED + 2)
    assert sorted(list_persisted(str(persist))) == [100, 101, 102]
    assert flash.retain([101, 102], 102) == [100]
    assert sorted(list_persisted(str(persist))) == [101, 102]
