"""A 10,240-node world on a real etcd: registered, snapshotted in parts, replayed intact.

RegisterJob of 10,240 nodes with 30-character names (a 330 KB world, over the 64 KiB event
cap) is recorded as JobStarted/TrainingResumed heads and WorldNodes parts in one
transaction; its compressed snapshot goes in parts (under a limit lowered to make them).
ListNodes and LiveView answer bounded pages. A new driver (a new log on the same etcd
keys) replays it: the world and every node are as the first driver had them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.integration.journal_harness import leading
from unbroken.driver import etcdsnapshot, paging, worldsplit
from unbroken.driver.election import Election
from unbroken.driver.etcdlog import EtcdEventLog, connect
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

N = 10_240


def name(i: int) -> str:
    return f"gpu-{i:06d}.rack{i // 64:04d}.dc1.example.com"[:30].ljust(30, "x")


async def _pages_cover_every_node(svc: Any, stub: dgrpc.DriverStub, ids: list[str]) -> None:
    """ListNodes and LiveView without a page answer one bounded page and a token; following
    the tokens lists all 10,240 nodes once, in id order."""
    now = time.monotonic()
    for n in ids:
        slot = svc.view.slot(n)
        svc.view.mark_registered(slot, now)
        svc.view.mark_alive(slot, now)
    for call, req in (
        (stub.ListNodes, dpb.ListNodesRequest()),
        (stub.LiveView, dpb.LiveViewRequest()),
    ):
        seen: list[str] = []
        after, pages = "", 0
        while True:
            req.after = after
            page = await call(req, timeout=60)
            assert 0 < len(page.nodes) <= paging.DEFAULT_PAGE
            assert page.ByteSize() < 4 << 20
            pages += 1
            seen += [n.node_id for n in page.nodes]
            if not page.next_after:
                break
            after = page.next_after
        assert seen == sorted(ids) and pages == -(-N // paging.DEFAULT_PAGE), (len(seen), pages)


def test_a_10240_node_world_registers_snapshots_and_replays_intact(
    etcd_server: Any, tmp_path: Path
) -> None:
    ids = [name(i) for i in range(N)]
    assert len(set(ids)) == N and {len(n) for n in ids} == {30}

    async def go() -> None:
        async with leading(etcd_server, tmp_path / "archive") as (svc, journal, addr, elog):
            job = svc.job_id
            stub = dgrpc.DriverStub(grpc.aio.insecure_channel(addr))
            world = ev.WorldLayout(pp=1, tp=1, node_ids=ids, workers_per_node=8)
            resp = await stub.RegisterJob(
                dpb.RegisterJobRequest(trainer="torchrun", world=world), timeout=60
            )
            assert resp.seq == 1
            stored = await elog.read()
            kinds = [e.WhichOneof("payload") for e in stored]
            assert kinds[0] == "job_started" and "world_nodes" in kinds, kinds
            assert max(e.ByteSize() for e in stored) <= elog.max_event_bytes
            whole = worldsplit.merged(stored)
            assert list(whole[0].job_started.world.node_ids) == ids  # readers get it whole
            assert list(journal.state.world.node_ids) == ids
            assert list(journal.state.configured_world.node_ids) == ids
            for i in range(0, N, 60):  # every node joins (a registration each)
                await journal.record(
                    *(
                        ev.Event(
                            node_registered=ev.NodeRegistered(
                                node_id=n, epoch=1, hostname=n, ip="10.0.0.1", num_workers=8
                            )
                        )
                        for n in ids[i : i + 60]
                    )
                )
            # compressed, this state fits one put (2.2 MB serialized, ~0.2 MB stored): parts
            # are made to happen here with a smaller limit
            elog.max_snapshot_bytes = 64 * 1024
            while await elog.maintain_once():
                pass
            assert elog.snapshot_bytes > elog.max_snapshot_bytes  # it went in parts
            assert elog.snapshot_bytes < etcdsnapshot.MAX_SNAPSHOT_BYTES
            snap = await elog.latest_snapshot()
            assert snap is not None and snap.last_seq >= N - 1000
            assert snap.state.world.node_ids == journal.state.world.node_ids
            assert len(snap.state.nodes) >= N - 1000  # those registered before its seq
            assert all(r.state == ev.NODE_STATE_ACTIVE for r in snap.state.nodes.values())
            # (the view's nodes never beat: the driver declares them lost as the test ends)
            await _pages_cover_every_node(svc, stub, ids)
        want = journal.snapshot()  # its term has ended: nothing more is recorded

        # a new driver on the same keys: replay (snapshot parts + tail) gives the same state
        client = await connect(etcd_server.config)
        election = Election(client, job, "d2", ttl_s=10)
        log2 = EtcdEventLog(client, job, await election.campaign(timeout_s=10))
        try:
            got = await log2.replay()
            assert got == want
            assert list(got.world.node_ids) == ids
            assert set(got.nodes) == set(ids)
        finally:
            await log2.close()
            await election.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(go(), 600))
