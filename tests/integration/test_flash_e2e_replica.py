"""A replacement node fetches a lost node's replicas back from the buddy, verified.

In-process, real TCP on loopback (port 0): node A's agent store replicates to buddy B;
A is lost; a replacement A' runs `fetch_replica` against B and gets A's copies back (both
of B's replicas per rank), bit for bit. A replica damaged in B's memory is refused by the
fetcher, never stored.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import list_copies, read_copy, replica_store
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.replica import ReplicaServer, fetch_replica
from unbroken.recovery.replicaauth import ReplicaAuth, ReplicaConfig
from unbroken.recovery.replicasend import ReplicaSender

pytestmark = pytest.mark.integration


@pytest.fixture
def owners() -> Iterator[tuple[FlashOwner, FlashOwner, FlashOwner]]:
    roots = [tempfile.mkdtemp(prefix=f"ub-fetch{i}-", dir="/dev/shm") for i in range(3)]
    try:
        yield tuple(FlashOwner(FlashConfig(root=r, job="j")) for r in roots)  # type: ignore[misc]
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


CFG = ReplicaConfig(auth=ReplicaAuth.keyed(b"test-replica-key-0123456789"))


def _save(owner: FlashOwner, rank: int, step: int) -> None:
    w = FlashWriter(rank, owner)
    try:
        w.save({"w": torch.full((1000,), float(step + rank)), "step": step}, step).wait()  # type: ignore[union-attr]
    finally:
        w.close()


def test_replacement_fetches_verified_replicas(
    owners: tuple[FlashOwner, FlashOwner, FlashOwner],
) -> None:
    a, b, replacement = owners

    async def go() -> None:
        server = ReplicaServer(b, CFG)
        port = await server.start("127.0.0.1", 0)
        try:
            for step in (1, 2):
                for rank in (0, 1):
                    _save(a, rank, step)
                sent = await ReplicaSender(a, "A", ("127.0.0.1", port), CFG).tick()
                assert all(r.ok for r in sent) and len(sent) == 2
            # A is lost; A' gets its copies back.
            # Both replicas of each rank come back, the older first (the newest may be a
            # step the survivors never finished saving), and the newest stays the newest.
            got = await fetch_replica(replacement, "A", "127.0.0.1", port, config=CFG)
            assert [(r.manifest.rank, r.manifest.step) for r in got] == [
                (0, 1), (0, 2), (1, 1), (1, 2)
            ]  # fmt: skip
            for rank in (0, 1):
                held = list_copies(replacement.rank_dir(rank, replica_store("A")))
                assert [r.manifest.step for r in held] == [2, 1]
            for ref in got:
                src = next(
                    r
                    for r in list_copies(a.rank_dir(ref.manifest.rank))
                    if r.manifest.step == ref.manifest.step
                )
                x, y = read_copy(ref), read_copy(src)
                assert x[: ref.manifest.data_nbytes] == y[: src.manifest.data_nbytes]
                x.close()
                y.close()
            # Damage rank 1's replica in B's memory: the fetcher refuses it.
            bad = list_copies(b.rank_dir(1, replica_store("A")))[0]
            with open(bad.data_path, "r+b") as f:
                f.seek(8)
                byte = f.read(1)
                f.seek(8)
                f.write(bytes([byte[0] ^ 1]))
            shutil.rmtree(replacement.job_dir / replica_store("A"))
            got = await fetch_replica(replacement, "A", "127.0.0.1", port, config=CFG)
            assert [(r.manifest.rank, r.manifest.step) for r in got] == [(0, 1), (0, 2), (1, 1)]
            held = list_copies(replacement.rank_dir(1, replica_store("A")))
            assert [r.manifest.step for r in held] == [1]  # the damaged step 2 is not kept
            # Nothing held for an unknown node: an empty answer, not an error.
            assert await fetch_replica(replacement, "nobody", "127.0.0.1", port, config=CFG) == []
        finally:
            await server.stop()

    asyncio.run(go())


def test_a_spares_workers_start_during_the_fetch_and_read_the_copies_after_it(
    owners: tuple[FlashOwner, FlashOwner, FlashOwner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare's agent fetches the lost node's copies while its workers start (not before):
    the replica store is marked as being fetched until the fetch ends, and a worker's
    restore reads the store only after that, so it finds every copy the fetch brought."""
    import threading
    import time

    from unbroken.agent import flash as agentflash
    from unbroken.agent.flash import NodeFlash, NodeFlashConfig
    from unbroken.trainer.flashckpt import FlashCheckpointer, FlashEnv

    a, b, replacement = owners
    real_fetch = agentflash.fetch_replica

    async def slow_fetch(*args: object, **kwargs: object) -> object:
        await asyncio.sleep(0.3)  # a buddy far away: the workers start well before the end
        return await real_fetch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(agentflash, "fetch_replica", slow_fetch)
    root = str(replacement.config.root)
    node = NodeFlash(NodeFlashConfig(root=root, job="j", node="A2"), 1)
    node.replica_cfg = CFG
    worker = FlashCheckpointer(FlashEnv(root=root, job="j", node="A"), 0)
    seen: dict[str, object] = {}

    def restore_side() -> None:  # what a worker's restore does before its survey
        t0 = time.monotonic()
        worker._await_fetch()
        seen["waited_s"] = time.monotonic() - t0
        held = list_copies(replacement.rank_dir(0, replica_store("A")))
        seen["steps"] = [r.manifest.step for r in held]

    async def go() -> None:
        server = ReplicaServer(b, CFG)
        port = await server.start("127.0.0.1", 0)
        try:
            _save(a, 0, 1)
            sent = await ReplicaSender(a, "A", ("127.0.0.1", port), CFG).tick()
            assert [r.ok for r in sent] == [True]
            fetch = node.begin_take_over("A", "A2", f"127.0.0.1:{port}")
            assert fetch is not None
            marker = replacement.fetching(replica_store("A"))
            assert marker.exists()
            t = threading.Thread(target=restore_side)
            t.start()
            assert await fetch is True
            await asyncio.to_thread(t.join, 30)
            assert not marker.exists()
        finally:
            await server.stop()

    try:
        asyncio.run(go())
        assert seen["steps"] == [1], seen  # read after the fetch, never an empty store
        assert 0.1 < float(seen["waited_s"]) < 30  # type: ignore[arg-type]
        # a marker its agent left behind (it died mid-fetch) holds a restore only so long
        replacement.fetching(replica_store("A")).write_text("0\n")
        t0 = time.monotonic()
        worker._await_fetch(limit_s=0.1)
        assert time.monotonic() - t0 < 10
        # nothing to fetch from (no replica credentials): no task, no marker
        node.replica_cfg = ReplicaConfig()
        assert node.begin_take_over("B", "A2", "127.0.0.1:1") is None
        assert not replacement.fetching(replica_store("B")).exists()
    finally:
        worker.close()
