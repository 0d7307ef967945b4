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
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from unbroken.recovery.flash import FlashWriter, load_into
from unbroken.recovery.flashcopy import CopyRef, read_copy
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.replica import (
    PROTOCOL,
    SEND_CHUNK,
    ReplicaServer,
    fetch_replica,
    replica_dirs,
    ring,
    send_copy,
)
from unbroken.recovery.replicaauth import ReplicaAuth, ReplicaConfig
from unbroken.recovery.replicasend import ReplicaSender
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


def test_a_slow_check_of_a_stored_copy_holds_back_no_copy_and_checks_the_newest_next(
    nodes: tuple[FlashOwner, FlashOwner],
) -> None:
    """The buddy's check of a stored copy (the SDC opinion: a helper process that may be
    importing torch, or get no CPU, for seconds) runs beside the stream, not in its way:
    while the first copy's check is held, three newer copies of the rank are received at
    once, and when it ends the newest of them is checked next, the ones between never."""
    a, b = nodes
    release = threading.Event()
    checked: list[int] = []

    def check(node: str, ref: CopyRef) -> None:
        assert node == "nodeA"
        checked.append(ref.manifest.step)
        if len(checked) == 1:
            release.wait(30)

    async def scenario() -> list[float]:
        server = ReplicaServer(b, CFG)
        server.on_stored = check
        port = await server.start()
        took = []
        try:
            w = FlashWriter(0, a)
            for step in (1, 2, 3, 4):
                w.save(_state(step), step).wait()
                t0 = time.monotonic()
                sent = await send_copy(a.newest(0), "nodeA", "127.0.0.1", port, config=CFG)  # type: ignore[arg-type]
                took.append(time.monotonic() - t0)
                assert sent.ok, sent.error
                while not checked:  # the first copy's check has begun (and is held)
                    await asyncio.sleep(0.01)
            w.close()
            assert checked == [1]
            release.set()
            while len(checked) < 2 or server._checking:
                await asyncio.sleep(0.01)
        finally:
            release.set()
            await server.stop()
        return took

    took = asyncio.run(scenario())
    assert checked == [1, 4]
    assert max(took) < 10.0, took  # not the held check's 30 s


def test_a_copy_of_many_chunks_travels_whole_and_a_flip_in_a_late_chunk_is_refused(
    nodes: tuple[FlashOwner, FlashOwner], tmp_path: Path
) -> None:
    """A copy several `SEND_CHUNK`s long and not a multiple of it: stored and fetched back
    bit for bit; one bit flipped in its last chunk fails the checksum and the earlier
    replica stays."""
    a, b = nodes
    n = (4 * SEND_CHUNK + 4100) // 4  # float32s: four whole chunks and a ragged end
    states = {s: {"w": torch.randn(n, generator=torch.Generator().manual_seed(s))} for s in (1, 2)}

    async def scenario() -> None:
        server = ReplicaServer(b, CFG)
        port = await server.start()
        try:
            w = FlashWriter(0, a)
            w.save(states[1], 1).wait()
            ref = a.newest(0)
            assert ref is not None and ref.manifest.data_nbytes > 4 * SEND_CHUNK
            assert (await send_copy(ref, "nodeA", "127.0.0.1", port, config=CFG)).ok
            w.save(states[2], 2).wait()
            w.close()
            late = a.newest(0).manifest.data_nbytes - 10  # type: ignore[union-attr]
            bad = await send_copy(
                a.newest(0),
                "nodeA",
                "127.0.0.1",
                port,
                config=CFG,
                flip_bit_at=late,  # type: ignore[arg-type]
            )
            assert not bad.ok and "checksum" in bad.error
            c = FlashOwner(FlashConfig(root=str(tmp_path / "c"), job="j"))
            got = await fetch_replica(c, "nodeA", "127.0.0.1", port, config=CFG)
            assert [r.manifest.step for r in got] == [1]
            target = {"w": torch.zeros(n)}
            ref = c.newest(0, "replica-nodeA")
            assert ref is not None
            load_into(target, ref.manifest, read_copy(ref))
            assert torch.equal(target["w"], states[1]["w"])
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_a_buddy_speaking_another_protocol_is_refused_by_its_version(
    nodes: tuple[FlashOwner, FlashOwner],
) -> None:
    """A buddy of an older release (v2: 8 MiB chunks) would misread v3's chunks: the sender
    refuses at the greeting and says which version the buddy speaks."""
    a, _ = nodes
    w = FlashWriter(0, a)
    w.save(_state(1), 1).wait()
    w.close()

    async def scenario() -> str:
        async def old(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b'{"v": 2, "nonce": "00"}\n')
            await writer.drain()
            await reader.read()
            writer.close()

        server = await asyncio.start_server(old, "127.0.0.1", 0)
        port = int(server.sockets[0].getsockname()[1])
        try:
            res = await send_copy(a.newest(0), "nodeA", "127.0.0.1", port, config=CFG)  # type: ignore[arg-type]
        finally:
            server.close()
            await server.wait_closed()
        assert not res.ok
        return res.error

    error = asyncio.run(scenario())
    assert f"speaks replica protocol 2, not {PROTOCOL}" in error, error


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
