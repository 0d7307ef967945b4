"""Buddy replicas over real TCP: a lost node's state comes back from its buddy's memory.

Two flash owners with separate shared-memory roots stand for two nodes; node A's
newest copies travel to node B's replica server over a loopback socket (port 0). Then
node A is lost (its store deleted) and a replacement restores from B's replica,
bit-for-bit. A copy damaged in transit is refused and the previous replica survives.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from unbroken.recovery.flash import FlashConfig, FlashOwner, FlashWriter, load_into
from unbroken.recovery.replica import (
    ReplicaAuth,
    ReplicaConfig,
    ReplicaSender,
    ReplicaServer,
    replica_dirs,
    ring,
    send_copy,
)
from unbroken.recovery.restore import Source, decide
from unbroken.recovery.sources import obtain, survey

pytestmark = pytest.mark.integration
AUTH = ReplicaAuth.keyed(b"test-replica-key-0123456789")  # the job's key (no TLS here)
CFG = ReplicaConfig(auth=AUTH)


@pytest.fixture
def nodes() -> Iterator[tuple[FlashOwner, FlashOwner]]:
    roots = [tempfile.mkdtemp(prefix=f"ub-node{i}-", dir="/dev/shm") for i in range(2)]
    try:
        yield tuple(FlashOwner(FlashConfig(root=r, job="j")) for r in roots)  # type: ignore[misc]
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "data": {"position": step * 32}}


def test_ring_pairs_each_node_with_the_next() -> None:
    assert ring(["a", "b", "c"]) == {"a": "b", "b": "c", "c": "a"}
    assert ring(["a", "b"]) == {"a": "b", "b": "a"}
    assert ring(["solo"]) == {}
    with pytest.raises(ValueError, match="distinct"):
        ring(["a", "a"])


def test_lost_node_restores_from_buddy_replica(nodes: tuple[FlashOwner, FlashOwner]) -> None:
    a, b = nodes

    async def scenario() -> None:
        server = ReplicaServer(b, ReplicaConfig(timeout_s=30, auth=AUTH))
        port = await server.start()
        try:
            sender = ReplicaSender(a, "nodeA", ("127.0.0.1", port), CFG)
            writers = [FlashWriter(r, a) for r in (0, 1)]
            for step in (1, 2):
                for r, w in enumerate(writers):
                    w.save(_state(step * 10 + r), step).wait()
                results = await sender.tick()
                assert [(x.rank, x.step, x.ok) for x in results] == [
                    (0, step, True),
                    (1, step, True),
                ]
            assert await sender.tick() == []  # nothing new: nothing sent
            for w in writers:
                w.close()
            assert server.received == 4
        finally:
            await server.stop()

    asyncio.run(scenario())
    a.cleanup()  # node A is lost with its shared memory

    dirs = replica_dirs(b, "nodeA")
    assert sorted(dirs) == [0, 1]
    sv = survey(memory={r: a.rank_dir(r) for r in (0, 1)}, buddy=dirs)
    plan = decide(sv.availability([0, 1]))
    assert plan.step == 2 and set(plan.source_by_rank.values()) == {Source.BUDDY}
    for r in (0, 1):
        src, manifest, data = obtain(sv, r, plan.step)
        assert src.kind is Source.BUDDY
        target = {"w": torch.zeros(256, 64), "data": {"position": -1}}
        load_into(target, manifest, data)
        expected = _state(20 + r)
        assert torch.equal(target["w"], expected["w"])  # type: ignore[arg-type]
        assert target["data"] == expected["data"]


def test_copy_damaged_in_transit_is_refused(nodes: tuple[FlashOwner, FlashOwner]) -> None:
    a, b = nodes

    async def scenario() -> None:
        server = ReplicaServer(b, CFG)
        port = await server.start()
        try:
            w = FlashWriter(0, a)
            w.save(_state(1), 1).wait()
            ok = await send_copy(a.newest(0), "nodeA", "127.0.0.1", port, config=CFG)  # type: ignore[arg-type]
            assert ok.ok
            w.save(_state(2), 2).wait()
            w.close()
            bad = await send_copy(
                a.newest(0),  # type: ignore[arg-type]
                "nodeA",
                "127.0.0.1",
                port,
                config=CFG,
                flip_bit_at=100,
            )
            assert not bad.ok and "checksum" in bad.error
            assert server.refused == 1
        finally:
            await server.stop()

    asyncio.run(scenario())
    replica = b.newest(0, "replica-nodeA")
    assert replica is not None and replica.manifest.step == 1  # step 2 never stored


def test_unreachable_buddy_is_a_failed_send_not_a_hang(
    nodes: tuple[FlashOwner, FlashOwner], tmp_path: Path
) -> None:
    a, _ = nodes
    w = FlashWriter(0, a)
    w.save(_state(1), 1).wait()
    w.close()

    async def closed_port() -> int:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = int(server.sockets[0].getsockname()[1])
        server.close()
        await server.wait_closed()
        return port

    port = asyncio.run(closed_port())
    res = asyncio.run(
        send_copy(
            a.newest(0), "nodeA", "127.0.0.1", port, config=ReplicaConfig(timeout_s=5, auth=AUTH)
        )  # type: ignore[arg-type]
    )
    assert not res.ok and res.error
