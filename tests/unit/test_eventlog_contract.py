"""ONE contract suite for every `EventLog`: what the driver may rely on, whatever the store.

`EventLogContract` is abstract; each implementation subclasses it with an `env()` that
builds a leader's log on its store. Here it runs against `InMemoryEventLog`;
tests/integration/test_etcdlog_contract.py runs the very same class against etcd.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from unbroken.driver import state as statelib
from unbroken.driver.eventlog import (
    EventLog,
    EventTooLargeError,
    InMemoryEventLog,
    InMemoryStore,
    NotLeaderError,
)
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

SNAPSHOT_EVERY = 10
DEADLINE_S = 60.0


def lost(node: str) -> ev.Event:
    return ev.Event(node_lost=ev.NodeLost(node_id=node, silent_ms=300))


def registered(node: str) -> ev.Event:
    return ev.Event(node_registered=ev.NodeRegistered(node_id=node, epoch=1, num_workers=2))


class Env(abc.ABC):
    """A store with one leader's log on it."""

    log: EventLog

    @abc.abstractmethod
    async def new_leader(self) -> EventLog:
        """End the current leadership; return the log of a newly elected driver."""

    @abc.abstractmethod
    def reader(self) -> EventLog:
        """A log opened without leadership."""

    async def settled(self, snapshot_seq: int) -> None:
        """Wait until the snapshot at `snapshot_seq` (and what follows from it) is done."""
        while True:
            snap = await self.log.latest_snapshot()
            if snap is not None and snap.last_seq >= snapshot_seq:
                return
            await asyncio.sleep(0.02)


class EventLogContract(abc.ABC):
    """The semantics every EventLog keeps (driver/eventlog.py module docstring)."""

    @abc.abstractmethod
    def env(self) -> contextlib.AbstractAsyncContextManager[Env]:
        """A fresh job on the store under test, snapshot_every=SNAPSHOT_EVERY."""

    def run(self, body: Callable[[Env], Awaitable[None]]) -> None:
        async def main() -> None:
            async with self.env() as env:
                await body(env)

        asyncio.run(asyncio.wait_for(main(), DEADLINE_S))

    def test_append_assigns_dense_seqs_and_reads_back(self) -> None:
        async def body(env: Env) -> None:
            assert await env.log.last_seq() == 0
            assert await env.log.read() == []
            got = [await env.log.append(lost(f"n{i}")) for i in range(5)]
            assert [e.seq for e in got] == [1, 2, 3, 4, 5]
            assert await env.log.last_seq() == 5
            stored = await env.log.read()
            assert [e.event_id for e in stored] == [e.event_id for e in got]
            assert all(e.job_id == env.log.job_id and e.schema_version == 1 for e in stored)
            assert [e.seq for e in await env.log.read(2, 4)] == [2, 3, 4]
            assert [e.seq for e in await env.log.read(4)] == [4, 5]
            assert await env.log.read(6) == []
            with pytest.raises(ValueError, match="from_seq"):
                await env.log.read(0)

        self.run(body)

    def test_find_by_event_id(self) -> None:
        async def body(env: Env) -> None:
            e = await env.log.append(registered("a"))
            found = await env.log.find(e.event_id)
            assert found is not None and found.seq == e.seq
            assert found.node_registered.node_id == "a"
            assert await env.log.find(uuid.uuid4().hex) is None

        self.run(body)

    def test_reappending_an_event_id_is_exactly_once(self) -> None:
        async def body(env: Env) -> None:
            await env.log.append(lost("x"))
            first = await env.log.append(
                ev.Event(event_id="retry-me", node_lost=ev.NodeLost(node_id="y"))
            )
            again = await env.log.append(
                ev.Event(event_id="retry-me", node_lost=ev.NodeLost(node_id="y"))
            )
            assert again.seq == first.seq == 2
            same_time = await asyncio.gather(
                *[
                    env.log.append(ev.Event(event_id="twice", node_lost=ev.NodeLost(node_id="z")))
                    for _ in range(2)
                ]
            )
            assert same_time[0].seq == same_time[1].seq == 3
            assert [e.event_id for e in await env.log.read()][1:] == ["retry-me", "twice"]

        self.run(body)

    def test_ten_concurrent_appenders_no_gap_no_duplicate_nothing_lost(self) -> None:
        async def body(env: Env) -> None:
            acked: list[ev.Event] = []

            async def appender(j: int) -> None:
                for i in range(100):
                    acked.append(await env.log.append(lost(f"w{j}-{i}")))

            await asyncio.gather(*[appender(j) for j in range(10)])
            stored = await env.log.read()
            assert [e.seq for e in stored] == list(range(1, 1001))  # dense: no gap
            assert len({e.event_id for e in stored}) == 1000  # no duplicate
            by_seq = {e.seq: e.event_id for e in stored}
            assert all(by_seq[a.seq] == a.event_id for a in acked)  # every ack is there
            per_writer = [
                [
                    int(e.node_lost.node_id.split("-")[1])
                    for e in stored
                    if e.node_lost.node_id.startswith(f"w{j}-")
                ]
                for j in range(10)
            ]
            assert all(order == list(range(100)) for order in per_writer)  # per-caller order

        self.run(body)

    def test_append_many_keeps_order(self) -> None:
        async def body(env: Env) -> None:
            got = await env.log.append_many([lost(f"n{i}") for i in range(25)])
            assert [e.seq for e in got] == list(range(1, 26))
            assert [e.node_lost.node_id for e in await env.log.read()] == [
                f"n{i}" for i in range(25)
            ]

        self.run(body)

    def test_stale_leader_is_fenced_off(self) -> None:
        async def body(env: Env) -> None:
            old = env.log
            await old.append(lost("before"))
            new = await env.new_leader()
            with pytest.raises(NotLeaderError):
                await old.append(lost("stale"))
            e = await new.append(lost("after"))
            assert e.seq == 2
            with pytest.raises(NotLeaderError):
                await old.append(lost("stale again"))
            assert [x.node_lost.node_id for x in await new.read()] == ["before", "after"]

        self.run(body)

    def test_log_without_leadership_cannot_append(self) -> None:
        async def body(env: Env) -> None:
            await env.log.append(lost("a"))
            reader = env.reader()
            with pytest.raises(NotLeaderError):
                await reader.append(lost("b"))
            assert [e.seq for e in await reader.read()] == [1]
            assert await reader.last_seq() == 1

        self.run(body)

    def test_bad_input_is_refused_before_the_store(self) -> None:
        async def body(env: Env) -> None:
            await env.log.append(lost("ok"))
            big = ev.Event(log_alert=ev.LogAlert(node_id="n", line="x" * (64 * 1024)))
            with pytest.raises(EventTooLargeError, match="cap"):
                await env.log.append(big)
            with pytest.raises(ValueError, match="no payload"):
                await env.log.append(ev.Event())
            assert await env.log.last_seq() == 1

        self.run(body)

    def test_watch_replays_then_follows_in_order(self) -> None:
        async def body(env: Env) -> None:
            for i in range(3):
                await env.log.append(lost(f"old{i}"))
            seen: list[ev.Event] = []

            async def watcher() -> None:
                async for e in env.log.watch(2):
                    seen.append(e)
                    if len(seen) == 2 + 2 * SNAPSHOT_EVERY + 5:
                        return

            task = asyncio.create_task(watcher())
            for i in range(2 * SNAPSHOT_EVERY + 5):  # crosses snapshots (and archival)
                await env.log.append(lost(f"new{i}"))
            await asyncio.wait_for(task, 20)
            assert [e.seq for e in seen] == list(range(2, 3 + 2 * SNAPSHOT_EVERY + 5 + 1))

        self.run(body)

    def test_watch_started_late_sees_archived_history(self) -> None:
        async def body(env: Env) -> None:
            await env.log.append_many([lost(f"n{i}") for i in range(3 * SNAPSHOT_EVERY)])
            await env.settled(3 * SNAPSHOT_EVERY)
            seen = []
            async for e in env.reader().watch(1):
                seen.append(e.seq)
                if e.seq == 3 * SNAPSHOT_EVERY:
                    break
            assert seen == list(range(1, 3 * SNAPSHOT_EVERY + 1))

        self.run(body)

    def test_snapshot_plus_tail_equals_full_history(self) -> None:
        async def body(env: Env) -> None:
            n = 3 * SNAPSHOT_EVERY + 4
            for i in range(n):
                e = registered(f"n{i % 7}") if i % 3 else lost(f"n{i % 7}")
                await env.log.append(e)
            await env.settled(3 * SNAPSHOT_EVERY)
            snap = await env.log.latest_snapshot()
            assert snap is not None and snap.last_seq == 3 * SNAPSHOT_EVERY
            full = await env.log.read()
            assert [e.seq for e in full] == list(range(1, n + 1))  # archived ones included
            everything = statelib.fold(full, statelib.initial(env.log.job_id))
            assert await env.log.replay() == everything
            assert await env.reader().replay() == everything
            assert everything.last_seq == n

        self.run(body)


class _MemEnv(Env):
    def __init__(self) -> None:
        self.store = InMemoryStore()
        self.job = "job-" + uuid.uuid4().hex[:8]
        self.log = InMemoryEventLog(
            self.store, self.job, self.store.elect("d1"), snapshot_every=SNAPSHOT_EVERY
        )

    async def new_leader(self) -> EventLog:
        return InMemoryEventLog(
            self.store, self.job, self.store.elect("d2"), snapshot_every=SNAPSHOT_EVERY
        )

    def reader(self) -> EventLog:
        return InMemoryEventLog(self.store, self.job, None, snapshot_every=SNAPSHOT_EVERY)


class TestInMemoryEventLog(EventLogContract):
    @contextlib.asynccontextmanager
    async def env(self) -> AsyncIterator[Env]:
        yield _MemEnv()
