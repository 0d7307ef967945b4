"""A new leader's per-principal quotas go on from the log (driver/principalquota.py).

The registrations of the last minute are read back from the log's newest events, each at
its own wall time, and counted for `node:<id>`; the epoch the log holds for a node comes
back once uncounted (its agent, registering with the new leader). The failover itself,
between two real driver processes, is tests/security/test_principal_quotas.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from unbroken.driver import principalquota as pq
from unbroken.driver.config import LoopConfig, ServiceConfig
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.service import DriverService
from unbroken.driver.term import Term
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

S = 1_000_000_000  # ns


def _registered(node: str, epoch: int, wall_ns: int, cause: str = "detector") -> ev.Event:
    return ev.Event(
        cause=cause,
        wall_time_unix_ns=wall_ns,
        node_registered=ev.NodeRegistered(node_id=node, epoch=epoch),
    )


def _state(**epochs: int) -> ev.JobState:
    state = ev.JobState(job_id="j")
    for node, epoch in epochs.items():
        state.nodes[node].CopyFrom(ev.NodeRecord(node_id=node, epoch=epoch))
    return state


def test_the_last_minute_of_registrations_counts_for_each_nodes_principal() -> None:
    book = pq.QuotaBook(pq.PrincipalQuotas(registrations_per_minute=2))
    wall, now = 1_000_000 * S, 500.0
    book.seed(
        _state(a=3, b=1),
        [
            _registered("a", 1, wall - 90 * S),  # older than the window
            _registered("a", 2, wall - 30 * S),
            _registered("a", 3, wall - 10 * S),
            _registered("b", 1, wall - 20 * S, cause=pq.RETURNED),  # not counted by its term
            _registered("c", 1, wall + 5 * S),  # a clock ahead of ours: now
        ],
        wall_ns=wall,
        now=now,
    )
    why = book.registration("node:a", now)
    assert "registrations_per_minute=2" in why and "retry in 30 s" in why, why
    assert book.registration("node:b", now) == ""
    assert book.registration("node:b", now) == ""
    assert book.registration("node:b", now) != ""  # b's two new ones, nothing seeded
    assert book.registration("node:c", now) == ""
    assert book.registration("node:c", now + 59) != ""  # c's seeded one is 59 s old
    assert book.registration("node:a", now + 30) == ""  # a's older one left the window


def test_the_epoch_the_log_holds_comes_back_once_uncounted() -> None:
    book = pq.QuotaBook(pq.PrincipalQuotas())
    book.seed(_state(a=7, c=3), [], wall_ns=time.time_ns(), now=time.monotonic())
    assert book.returning("a", 7)
    assert not book.returning("a", 7)  # once per term
    assert not book.returning("b", 1)  # a node the log does not know
    assert not book.returning("c", 4)  # a new epoch is counted, and uses c's one chance
    assert not book.returning("c", 3)
    book.seed(_state(a=7), [], wall_ns=time.time_ns(), now=time.monotonic())
    assert book.returning("a", 7)  # a new term, a new chance


class _CountingLog(InMemoryEventLog):
    """The reference log, counting the events it hands out."""

    handed = 0

    async def read(self, from_seq: int = 1, to_seq: int | None = None) -> list[ev.Event]:
        got = await super().read(from_seq, to_seq)
        self.handed += len(got)
        return got


def test_a_term_reads_the_logs_last_minute_not_the_log() -> None:
    """A long history (snapshots every 1,000 events) with a minute of registrations on top:
    what is read back is that minute and at most one page more."""

    async def body() -> None:
        store = InMemoryStore()
        log = _CountingLog(store, "j", store.elect("d1"), snapshot_every=1000)
        wall = time.time_ns()
        old = [
            ev.Event(wall_time_unix_ns=wall - 3600 * S, node_lost=ev.NodeLost(node_id=f"n{i}"))
            for i in range(5000)
        ]
        await log.append_many(old)
        await log.append_many([_registered("a", 1, wall - 3600 * S)])  # long ago
        recent = [_registered(f"n{i % 7}", 2 + i, wall - (50 - i) * S) for i in range(40)]
        await log.append_many(recent)
        log.handed = 0
        got = await pq.read_recent(log, await log.last_seq(), wall)
        assert [(e.node_registered.node_id, e.node_registered.epoch) for e in got] == [
            (e.node_registered.node_id, e.node_registered.epoch) for e in recent
        ]
        assert log.handed <= len(recent) + pq.RECENT_PAGE, log.handed

    asyncio.run(body())


def test_a_term_begins_with_the_quotas_the_log_says() -> None:
    """A driver that takes over a log whose node used its quota a moment ago refuses that
    node's next new epoch, and takes its agent back under the logged epoch."""

    async def body() -> None:
        store = InMemoryStore()
        first = InMemoryEventLog(store, "j", store.elect("old"))
        wall = time.time_ns()
        await first.append_many([_registered("a", e, wall - (10 - e) * S) for e in (1, 2)])
        config = ServiceConfig(quotas=pq.PrincipalQuotas(registrations_per_minute=2))
        service = DriverService(config, driver_id="new", job_id="j")
        grant = store.elect("new")
        term = Term(service, InMemoryEventLog(store, "j", grant), grant, "", loop=LoopConfig())
        await term.begin()
        try:
            quotas = service.agents.quotas
            assert quotas.returning("a", 2)
            why = quotas.registration("node:a", time.monotonic())
            assert "registrations_per_minute=2" in why, why
            assert quotas.registration("node:b", time.monotonic()) == ""
        finally:
            await term.end()
            await service.close()

    asyncio.run(body())
