"""A leader's term begins and ends in one place (driver/term.py)."""

from __future__ import annotations

import asyncio

import pytest

from unbroken.driver.config import LoopConfig, ServiceConfig
from unbroken.driver.decider import RecordOnly
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.scheduler import BridgeConfig, InMemoryScheduler
from unbroken.driver.service import DriverService
from unbroken.driver.term import Term

pytestmark = pytest.mark.unit


def _kinds(store: InMemoryStore) -> list[str]:
    return [e.WhichOneof("payload") or "" for e in store.events]


def test_a_launchers_term_records_its_election_and_hands_its_bridge_over() -> None:
    """Without --nodes: the journal records as it is; the scheduler bridge is the one the
    operator's ClearNode finds, from the term's start to its end."""

    async def body() -> None:
        store = InMemoryStore()
        service = DriverService(ServiceConfig(), driver_id="d1", job_id="j")
        grant = store.elect("d1")
        term = Term(
            service,
            InMemoryEventLog(store, "j", grant),
            grant,
            "127.0.0.1:1",
            loop=LoopConfig(),
            scheduler=InMemoryScheduler.of(["n1"], []),
            bridge=BridgeConfig(poll_s=0),
        )
        journal = await term.begin()
        try:
            assert service.journal is journal and service.leader_address == "127.0.0.1:1"
            assert isinstance(journal.decider, RecordOnly) and term.loop is None
            assert _kinds(store) == ["leader_elected"]
            assert store.events[0].leader_elected.driver_id == "d1"
            assert service.leadership.bridge is term.bridge is not None
        finally:
            await term.end("elsewhere:1")
        assert service.journal is None and service.leadership.bridge is None
        assert service.leader_address == "elsewhere:1" and term.bridge is None
        await service.close()

    asyncio.run(body())


def test_a_recovering_term_decides_through_its_loop_and_stops_it_at_the_end() -> None:
    async def body() -> None:
        store = InMemoryStore()
        service = DriverService(ServiceConfig(), driver_id="d1", job_id="j")
        grant = store.elect("d1")
        term = Term(
            service,
            InMemoryEventLog(store, "j", grant),
            grant,
            "127.0.0.1:1",
            loop=LoopConfig(nodes=1, start_timeout_s=60),
        )
        journal = await term.begin()
        loop = term.loop
        try:
            assert loop is not None and journal.decider is term and term.recovers
            assert loop.view is service.view  # given the live view, not the service's reach
            tasks = set(loop._tasks)
            assert tasks  # it watches the job (waiting for its nodes)
        finally:
            await term.end()
        assert term.loop is None and service.journal is None
        assert all(t.done() for t in tasks)  # the loop stopped with its term
        await service.close()

    asyncio.run(body())
