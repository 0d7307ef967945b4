"""The agent's flash loop wakes when a copy is made whole (agent/ringwake.py), not only at
the worker's next step report: real inotify on a real directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from unbroken.agent.ringwake import RingWake

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's"),
]


def _made_whole(rank_dir: Path, slot: int) -> None:
    """As `write_manifest` does: write a temporary file, rename it into place."""
    tmp = rank_dir / f".slot-{slot}.manifest.tmp"
    tmp.write_bytes(b"manifest")
    os.replace(tmp, rank_dir / f"slot-{slot}.manifest")


async def _woken(wake: asyncio.Event, within_s: float = 1.0) -> bool:
    try:
        await asyncio.wait_for(wake.wait(), within_s)
    except TimeoutError:
        return False
    wake.clear()
    return True


def test_a_copy_made_whole_wakes_the_loop_and_its_temporary_file_does_not(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        wake = asyncio.Event()
        rw = RingWake(wake)
        ring = tmp_path / "rank-00001"
        ring.mkdir()
        rw.watch([ring])
        assert rw.watched() == [ring]
        (ring / ".slot-0.manifest.tmp").write_bytes(b"half")  # written, not renamed in
        (ring / "slot-0.data").write_bytes(b"x" * 64)
        assert not await _woken(wake, 0.2)
        _made_whole(ring, 1)
        assert await _woken(wake)
        assert rw.woken == 1
        rw.close()
        assert rw.watched() == []
        _made_whole(ring, 2)
        assert not await _woken(wake, 0.2)

    asyncio.run(go())


def test_rings_come_and_go_with_the_ranks_listed(tmp_path: Path) -> None:
    async def go() -> None:
        wake = asyncio.Event()
        rw = RingWake(wake)
        a, b = tmp_path / "rank-00000", tmp_path / "rank-00001"
        a.mkdir()
        rw.watch([a, b])  # b is not there yet: watched once it is
        assert rw.watched() == [a]
        b.mkdir()
        rw.watch([a, b])
        assert rw.watched() == [a, b]
        rw.watch([b])  # rank 0 left this node
        assert rw.watched() == [b]
        _made_whole(a, 0)
        assert not await _woken(wake, 0.2)
        shutil.rmtree(b)  # removed under the watch: a scan is asked for, the watch goes
        assert await _woken(wake)
        assert rw.watched() == []
        rw.close()

    asyncio.run(go())


def test_a_wake_the_sender_cannot_act_on_comes_once_when_it_can(tmp_path: Path) -> None:
    async def go() -> None:
        wake = asyncio.Event()
        rw = RingWake(wake, lambda: 0.3)  # the duty holds the next send back 0.3 s
        ring = tmp_path / "rank-00000"
        ring.mkdir()
        rw.watch([ring])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for slot in range(3):  # three saves meanwhile: one wake
            _made_whole(ring, slot)
            await asyncio.sleep(0.02)
        assert not await _woken(wake, 0.1)
        assert await _woken(wake)
        assert loop.time() - t0 >= 0.29
        assert rw.woken == 1
        assert not await _woken(wake, 0.2)
        rw.close()

    asyncio.run(go())


def test_a_rescan_after_a_stop_lists_the_copies_held_for_other_nodes(tmp_path: Path) -> None:
    """As a buddy, the heartbeat after a stop (the one the driver picks the restore step
    from) lists the lost node's copies as they are then, not as the flash thread last
    polled them (no poll here: `--flash-poll-ms` a minute)."""
    import torch

    from unbroken.agent.flash import NodeFlash, NodeFlashConfig
    from unbroken.recovery.flash import FlashWriter
    from unbroken.recovery.flashcopy import replica_store, seal, write_raw_copy

    cfg = NodeFlashConfig(
        root=str(tmp_path / "shm"), job="j", node="n1", persist_url=str(tmp_path / "ckpt"),
        replica_key=b"k" * 16, listen="127.0.0.1:0", poll_ms=60_000,
    )  # fmt: skip

    async def main() -> None:
        flash = NodeFlash(cfg, world_size=2)
        await flash.start()
        try:
            w = FlashWriter(0, flash.owner)  # a copy of step 7, as node n0's buddy gets it
            w.save({"w": torch.arange(8.0)}, 7).wait()
            w.close()
            ref = flash.owner.newest(0)
            assert ref is not None
            with open(ref.data_path, "rb") as f:
                data = f.read(ref.manifest.data_nbytes)
            write_raw_copy(flash.owner.rank_dir(0, replica_store("n0")), seal(ref), data)
            assert flash.replicas_held() == []  # the flash thread has not looked
            await flash.rescan()
            assert flash.replicas_held() == [("n0", 0, [7])]
        finally:
            await flash.close(clean=True)

    asyncio.run(main())


def test_a_copy_goes_to_the_buddy_when_whole_without_a_step_report_or_a_poll(
    tmp_path: Path,
) -> None:
    """Two agents' flash stores over loopback, no poll (a minute) and no `poke`: the copy a
    worker makes whole reaches the buddy because its manifest woke the sender."""
    import torch

    from unbroken.agent.flash import NodeFlash, NodeFlashConfig
    from unbroken.recovery.flash import FlashWriter

    def cfg(node: str, buddy: str = "") -> NodeFlashConfig:
        return NodeFlashConfig(
            root=str(tmp_path / node), job="j", node=node, persist_url=str(tmp_path / "ckpt"),
            replica_key=b"k" * 16, listen="127.0.0.1:0", poll_ms=60_000, buddy=buddy,
            fetch_from_buddy=False,
        )  # fmt: skip

    async def held(flash: NodeFlash, within_s: float) -> list[tuple[str, int, list[int]]]:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            await flash.rescan()
            if flash.replicas_held():
                break
            await asyncio.sleep(0.05)
        return flash.replicas_held()

    async def main() -> None:
        buddy = NodeFlash(cfg("n1"), world_size=2)
        await buddy.start()
        node = NodeFlash(cfg("n0", buddy.listen_address()), world_size=2)
        await node.start()
        try:
            for _ in range(100):  # the flash loop watches the rings it has scanned
                if node.ring_wake is not None and node.ring_wake.watched():
                    break
                node.owner.rank_dir(0).mkdir(parents=True, exist_ok=True)
                node.poke()
                await asyncio.sleep(0.02)
            w = FlashWriter(0, node.owner)
            w.save({"w": torch.arange(8.0)}, 3).wait()
            w.close()
            assert await held(buddy, 5.0) == [("n0", 0, [3])]
        finally:
            await node.close(clean=True)
            await buddy.close(clean=True)

    asyncio.run(main())
