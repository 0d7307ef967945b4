"""The agent's flash thread: the flash work runs off the agent's loop, at a lower priority.

A replica send hashes and copies megabytes; at the workers' priority it delayed the rank
sharing its core (bench-recovery's throughput pairs), and on the agent's own loop it
delayed heartbeats. `LoopThread` runs it on its own loop and thread at `--flash-nice` (a nice
value, never SCHED_IDLE); the threads it starts inherit it; the agent's loop keeps its own.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog

from unbroken.agent import flash as flashmod
from unbroken.agent.flash import IO_NICE, NodeFlash, NodeFlashConfig
from unbroken.common.loopthread import LoopThread, lower_this_thread

pytestmark = pytest.mark.unit


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _run_then_stop(io: LoopThread, main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on a loop of this thread, then stop `io` whatever happened."""
    try:
        asyncio.run(main)
    finally:
        io.stop()


def _policy() -> int:
    return os.sched_getscheduler(0)  # 0: the calling thread (Linux)


def test_work_runs_on_its_own_thread_at_its_nice_value_and_its_helpers_inherit_it() -> None:
    base = _nice()  # the suite may run under `nice` (a CI runner, a newcomer's busy host)
    io = LoopThread("flash-t", 10)

    async def probe() -> tuple[int, int, int]:
        helper = await asyncio.to_thread(lambda: (threading.get_native_id(), _nice()))
        return threading.get_native_id(), _nice(), helper[1]

    async def main() -> None:
        here = threading.get_native_id()
        tid, nice, helper_nice = await io.call(probe())
        assert tid != here
        assert nice == max(10, base) and helper_nice == nice
        assert _nice() == base  # the calling loop's thread keeps its priority

    _run_then_stop(io, main())
    assert not io.alive


def test_the_flash_thread_runs_at_the_workers_nice_by_default() -> None:
    """At 19 the flash thread waited for idle time on busy cores and the buddy's copy of a
    lost node lagged (agent/flash.py `IO_NICE`)."""
    from unbroken.agent.launch import WorkerSpec

    cfg = NodeFlashConfig(node="n0", persist_url="/tmp/x")
    assert cfg.io_nice == IO_NICE == WorkerSpec(cmd=["true"]).nice == 5


def test_nice_19_is_a_nice_value_never_sched_idle() -> None:
    """`--flash-nice 19` stays SCHED_OTHER: at SCHED_IDLE the flash thread, once
    preempted holding the GIL on a busy host, kept it until a core fell idle and the agent's
    heartbeats stalled past the miss limit (false node losses in a bench-recovery run)."""
    io = LoopThread("flash-t", 19)

    async def probe() -> tuple[int, int, int]:
        return _policy(), await asyncio.to_thread(_policy), _nice()

    async def main() -> None:
        assert await io.call(probe()) == (os.SCHED_OTHER, os.SCHED_OTHER, 19)

    _run_then_stop(io, main())


def test_the_copy_threads_idle_class_is_asked_for_explicitly() -> None:
    got: list[tuple[str, int]] = []

    def probe() -> None:
        got.append((lower_this_thread(19, idle=True), _policy()))

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert got == [("idle", os.SCHED_IDLE)]
    assert _policy() == os.SCHED_OTHER  # only that thread


def test_an_error_on_the_thread_reaches_the_caller_and_the_thread_goes_on() -> None:
    io = LoopThread("flash-t", 0)

    async def fails() -> None:
        raise ValueError("bad copy")

    async def works() -> int:
        return 7

    async def main() -> None:
        with pytest.raises(ValueError, match="bad copy"):
            await io.call(fails())
        assert await io.call(works()) == 7

    _run_then_stop(io, main())


def test_nice_zero_leaves_the_thread_at_the_agents_priority() -> None:
    base = _nice()
    io = LoopThread("flash-t", 0)

    async def nice() -> int:
        return _nice()

    async def main() -> None:
        assert await io.call(nice()) == base

    _run_then_stop(io, main())


def test_plain_code_waits_with_a_deadline_and_a_late_coroutine_is_cancelled() -> None:
    """`call_sync` (the log watcher's etcd reads from `unbroken up`): a result, an error,
    and past the deadline a TimeoutError with the coroutine cancelled on the loop."""
    io = LoopThread("logwatch-t")
    cancelled = threading.Event()

    async def late() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def fails() -> None:
        raise OSError("etcd down")

    try:
        assert io.call_sync(asyncio.sleep(0, result=5), 5.0) == 5
        with pytest.raises(OSError, match="etcd down"):
            io.call_sync(fails(), 5.0)
        with pytest.raises(TimeoutError):
            io.call_sync(late(), 0.1)
        assert cancelled.wait(5.0)
    finally:
        io.stop()
    assert not io.alive


def test_flash_nice_is_validated() -> None:
    with pytest.raises(ValueError, match="--flash-nice"):
        NodeFlashConfig(node="n0", persist_url="/tmp/x", io_nice=20)


def test_node_flash_starts_and_stops_its_thread(tmp_path: Path) -> None:
    """start() serves and persists from the flash thread; close() stops it (a clean close
    removes the shared memory); a start that fails (the replica port taken) leaves no
    thread behind."""
    root = tmp_path / "shm"
    cfg = NodeFlashConfig(
        root=str(root), job="j", node="n0", persist_url=str(tmp_path / "ckpt"),
        replica_key=b"k" * 16, listen="127.0.0.1:0",
    )  # fmt: skip

    async def main() -> None:
        flash = NodeFlash(cfg, world_size=1)
        await flash.start()
        io = flash._io
        assert io is not None and io._thread.is_alive()
        assert flash.port > 0 and flash.persister is not None
        await flash.close(clean=True)
        assert not io.alive and flash._io is None
        assert not flash.owner.job_dir.exists()

        # it scans once a minute: a scan's `to_thread` may start a helper thread of its own
        # loop at any time, which the thread count below would blame on `busy` (a CI run)
        taken = NodeFlash(replace(cfg, poll_ms=60_000), world_size=1)
        await taken.start()
        port = taken.port
        other = replace(cfg, job="j2", node="n1", listen=f"127.0.0.1:{port}")
        busy = NodeFlash(other, world_size=1)
        # (its own threads, named flash-*: in a whole test run other threads come and go,
        # as gRPC's C threads that call into Python register as threads)
        before = {t.ident for t in threading.enumerate() if t.name.startswith("flash")}
        with pytest.raises(OSError):
            await busy.start()
        assert busy._io is None
        after = {t.ident for t in threading.enumerate() if t.name.startswith("flash")}
        assert after - before == set()
        await taken.close(clean=True)

    asyncio.run(main())


def test_persistence_waits_for_idle_cpu_whatever_the_flash_threads_nice(tmp_path: Path) -> None:
    """The persister's thread (bulk writes and read-backs) runs at nice 19 even where the
    flash thread runs nearer the workers' priority (replication keeps up on a busy host)."""
    base = _nice()
    cfg = NodeFlashConfig(
        root=str(tmp_path / "shm"), job="j", node="n0", persist_url=str(tmp_path / "ckpt"),
        replica_key=b"k" * 16, listen="127.0.0.1:0", io_nice=5,
    )  # fmt: skip

    async def main() -> tuple[int, int]:
        flash = NodeFlash(cfg, world_size=1)
        await flash.start()
        try:
            io, pers = flash._io, flash.persister
            assert io is not None and pers is not None

            async def nice() -> int:
                return _nice()

            flash_nice = await io.call(nice())
            tid = pers._thread.native_id
            assert tid is not None
            for _ in range(500):  # the thread lowers itself as it starts
                if os.getpriority(os.PRIO_PROCESS, tid) == flashmod.PERSIST_NICE:
                    break
                await asyncio.sleep(0.01)
            return flash_nice, os.getpriority(os.PRIO_PROCESS, tid)
        finally:
            await flash.close(clean=True)

    assert asyncio.run(main()) == (max(5, base), flashmod.PERSIST_NICE)


def test_a_starved_flash_thread_is_said_once_and_its_scans_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's loop (not the flash thread) notices a flash thread that finishes no ring
    scan: the flash loop is held busy (as when it gets no CPU), its scan age grows,
    `starved` says so once; released, it scans again and `starved` clears."""
    monkeypatch.setattr(flashmod, "STARVED_S", 0.3)
    cfg = NodeFlashConfig(
        root=str(tmp_path / "shm"), job="j", node="n0", persist_url=str(tmp_path / "ckpt"),
        replica_key=b"k" * 16, listen="127.0.0.1:0", poll_ms=20,
    )  # fmt: skip

    async def main() -> None:
        flash = NodeFlash(cfg, world_size=1)
        await flash.start()
        io = flash._io
        assert io is not None
        try:
            while flash.scanned_at is None:  # its first scan
                await asyncio.sleep(0.01)
            assert not flash.starved(time.monotonic())
            release = threading.Event()

            async def hold() -> None:  # the flash loop gets nothing done meanwhile
                release.wait(10)

            held = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(hold(), io.loop))
            await asyncio.sleep(0.6)
            now = time.monotonic()
            assert flash.scan_age_s(now) >= 0.5
            assert flash.starved(now) and flash.starved(now)
            release.set()
            await held
            before = flash.scanned_at
            while flash.scanned_at == before:
                await asyncio.sleep(0.01)
            assert not flash.starved(time.monotonic())
        finally:
            await flash.close(clean=True)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(main())
    warned = [e for e in logs if e["event"] == "flash.starved"]
    assert len(warned) == 1 and warned[0]["seconds"] >= 0.5, warned
    assert any(e["event"] == "flash.scanning_again" for e in logs)


def test_a_step_report_scans_the_rings_at_once_not_at_the_next_poll(tmp_path: Path) -> None:
    """A worker's copy waited up to `--flash-poll-ms` for the scan that sends it to the
    buddy (a lost node's ranks then restored an older copy). `poke` (the agent calls it on
    each step report) scans now: with a poll of a minute, a poke scans within a second."""
    cfg = NodeFlashConfig(
        root=str(tmp_path / "shm"), job="j", node="n0", persist_url=str(tmp_path / "ckpt"),
        replica_key=b"k" * 16, listen="127.0.0.1:0", poll_ms=60_000,
    )  # fmt: skip

    async def main() -> None:
        flash = NodeFlash(cfg, world_size=1)
        flash.poke()  # before start: nothing to wake, no error
        await flash.start()
        try:
            await asyncio.sleep(0.2)
            assert flash.scanned_at is None  # no scan for a minute unless poked
            flash.poke()
            flash.poke()  # a second poke before the scan is the same scan
            deadline = time.monotonic() + 5
            while flash.scanned_at is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert flash.scanned_at is not None
        finally:
            await flash.close(clean=True)
        flash.poke()  # after close: nothing to wake, no error

    asyncio.run(main())


def test_replica_duty_is_validated() -> None:
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="--replica-duty"):
            NodeFlashConfig(node="n0", persist_url="/tmp/x", replica_duty=bad)
    assert NodeFlashConfig(node="n0", persist_url="/tmp/x", replica_duty=1.0).replica_duty == 1.0
