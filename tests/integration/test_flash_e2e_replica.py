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
