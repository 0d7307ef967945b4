"""The event log tells the truth after an etcd stall: one condition is recorded once, and
wall times do not go backwards within a term.

The journal (driver/journal.py) on the in-memory event log whose store can be made
unreachable, as a stopped or stalled etcd is; the terms are real leadership changes of
that store.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable

import pytest

from unbroken.driver import state as statelib
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore, LogUnavailableError
from unbroken.driver.journal import Journal, JournalConfig
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration
FAST = JournalConfig(retry_min_ms=5, retry_max_ms=20)


class StallingLog(InMemoryEventLog):
    """The in-memory log whose store stops answering while `down`."""

    down = False

    async def append_many(self, events: Iterable[ev.Event]) -> list[ev.Event]:
        if self.down:
            raise LogUnavailableError("etcd at test:0 did not answer")
        return await super().append_many(events)


def _registered(node: str, epoch: int = 1) -> ev.Event:
    return ev.Event(node_registered=ev.NodeRegistered(node_id=node, epoch=epoch))


def _lost(node: str, epoch: int = 1) -> ev.Event:
    return ev.Event(node_lost=ev.NodeLost(node_id=node, epoch=epoch, reason="heartbeat timeout"))


async def _until(cond: object, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_one_node_lost_is_recorded_once_across_a_stall_and_a_new_term() -> None:
    """Term 1 detects node n1 lost while etcd stalls, and ends with the loss unrecorded;
    term 2's level check finds the same loss (the live view knows it) and the old term's
    observation is carried over: the log holds one NodeLost, and n1 one failure."""

    async def go() -> None:
        store = InMemoryStore()
        log1 = StallingLog(store, "job", store.elect("d1"))
        j1 = Journal(log1, statelib.initial("job"), config=FAST)
        j1.start()
        await j1.record(_registered("n1"), _registered("n2"))
        log1.down = True
        j1.submit(_lost("n1"))
        await _until(lambda: j1.stats.failed_appends >= 2)
        left = await j1.close()  # the term ends in the stall
        assert len(left) == 1

        log2 = StallingLog(store, "job", store.elect("d2"))  # a new leader, a new term
        state = await log2.replay()

        def conditions(s: ev.JobState) -> list[ev.Event]:
            rec = s.nodes["n1"]  # the live view: n1 at epoch 1 is silent
            return [_lost("n1")] if rec.state == ev.NODE_STATE_ACTIVE else []

        j2 = Journal(log2, state, config=FAST, conditions=conditions)
        j2.start()  # as the service leads: start (level check), then carry over
        j2.carry_over(left)
        try:
            await _until(lambda: j2.pending() == 0)
            await asyncio.sleep(0.1)
            lost = [e for e in await log2.read() if e.WhichOneof("payload") == "node_lost"]
            assert len(lost) == 1, f"one loss recorded {len(lost)} times"
            assert j2.state.nodes["n1"].failures == 1
            # a later loss of n1's next agent is a new condition and is recorded
            await j2.record(_registered("n1", epoch=2))
            j2.submit(_lost("n1", epoch=2))
            await _until(lambda: j2.state.event_counts["node_lost"] == 2)
        finally:
            await j2.close()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_wall_times_never_go_backwards_within_a_term() -> None:
    """The clock steps back by an hour mid-term (NTP), and an observation stamped at an
    append that failed is recorded after newer ones: the log's wall times still rise."""

    async def go() -> None:
        store = InMemoryStore()
        elog = StallingLog(store, "job", store.elect("d1"))
        now = [1_800_000_000 * 10**9]

        def clock() -> int:
            return now[0]

        j = Journal(elog, statelib.initial("job"), config=FAST, clock=clock)
        j.start()
        try:
            await j.record(_registered("a"))
            now[0] -= 3600 * 10**9  # the clock steps back an hour
            await j.record(_registered("b"))
            await j.record(_registered("c"))
            now[0] += 7200 * 10**9
            # stamped by a failed append, then recorded after an event stamped later
            old = _lost("a")
            old.wall_time_unix_ns = now[0] - 10**9
            await j.record(_registered("d"))
            await j.record(old)
            walls = [e.wall_time_unix_ns for e in await elog.read()]
            assert len(walls) == 5
            assert all(b > a for a, b in itertools.pairwise(walls)), walls
        finally:
            await j.close()

    asyncio.run(asyncio.wait_for(go(), 60))
