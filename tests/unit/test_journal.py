"""The journal (driver/journal.py): one writer, one transaction per decision, nothing lost.

Runs on the in-memory log (the reference implementation of `EventLog`); the etcd twin of
the failure cases is tests/chaos/test_journal_chaos.py.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import pytest

from tests.astparse import parse
from unbroken.driver import state as statelib
from unbroken.driver.decider import Decision
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore, LogUnavailableError
from unbroken.driver.journal import Journal, JournalClosedError, JournalConfig
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

DRIVER = Path(__file__).resolve().parents[2] / "driver"
LOG_IMPLEMENTATIONS = {"eventlog.py", "etcdlog.py"}  # where append/append_many are defined


def test_exactly_one_driver_module_appends_to_the_log() -> None:
    """Every awaited `.append(...)` / `.append_many(...)` in driver/ is in journal.py.

    A list's `append` is never awaited; an event log's always is, so the awaited calls
    are exactly the writes to the log (the implementations themselves excepted).
    """
    writers: dict[str, list[int]] = {}
    for path in sorted(DRIVER.glob("*.py")):
        if path.name in LOG_IMPLEMENTATIONS:
            continue
        for node in ast.walk(parse(path.read_text())):
            if not isinstance(node, ast.Await) or not isinstance(node.value, ast.Call):
                continue
            fn = node.value.func
            if isinstance(fn, ast.Attribute) and fn.attr in ("append", "append_many"):
                writers.setdefault(path.name, []).append(node.lineno)
    assert set(writers) == {"journal.py"}, writers


class FlakyLog(InMemoryEventLog):
    """The in-memory log whose store can be made unreachable (what a stopped etcd does)."""

    down = False
    appends = 0

    async def append_many(self, events: Iterable[ev.Event]) -> list[ev.Event]:
        if self.down:
            raise LogUnavailableError("etcd at test:0 did not answer")
        self.appends += 1
        return await super().append_many(events)


def _log(store: InMemoryStore | None = None) -> FlakyLog:
    store = store or InMemoryStore()
    return FlakyLog(store, "job", store.elect("d1"))


def _sync(fn: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Run an async test body in a fresh event loop, with a deadline."""

    @functools.wraps(fn)
    def run() -> None:
        asyncio.run(asyncio.wait_for(fn(), 30.0))  # type: ignore[arg-type]

    return run


def _lost(node: str, epoch: int = 1) -> ev.Event:
    return ev.Event(node_lost=ev.NodeLost(node_id=node, epoch=epoch, reason="test"))


def _alert(node: str, line: str = "NCCL WARN x") -> ev.Event:
    return ev.Event(log_alert=ev.LogAlert(node_id=node, keyword="NCCL WARN", line=line))


def _registered(node: str, epoch: int = 1) -> ev.Event:
    return ev.Event(node_registered=ev.NodeRegistered(node_id=node, epoch=epoch))


async def _until(cond: object, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@_sync
async def test_record_is_one_transaction_folded_and_notified() -> None:
    elog = _log()
    j = Journal(elog, statelib.initial("job"))
    seen: list[int] = []
    j.subscribers.append(lambda e: seen.append(e.seq))
    stored = await j.record(*(_registered(f"n{i}") for i in range(20)))
    assert [e.seq for e in stored] == list(range(1, 21))
    assert elog.appends == 1  # one transaction for the whole decision
    assert seen == list(range(1, 21))
    assert j.state == await elog.replay()  # the one fold equals the log's
    assert len(j.state.nodes) == 20


@_sync
async def test_faults_are_served_before_a_storm_of_alerts() -> None:
    elog = _log()
    j = Journal(elog, statelib.initial("job"), config=JournalConfig(alert_window_ms=60_000))
    for i in range(5000):
        j.submit(_alert(f"noisy{i % 3}", f"line {i}"))
    j.submit(_lost("dead"), detected=0.0)
    j.start()
    try:
        await _until(lambda: j.state.event_counts["node_lost"] == 1)
        # the fault went first: at most the alerts of one earlier decision precede it
        kinds = [e.WhichOneof("payload") for e in await elog.read()]
        assert kinds[0] == "node_lost"
        assert j.stats.alerts_coalesced == 5000 - 3  # one alert per node and keyword
    finally:
        await j.close()


@_sync
async def test_alert_windows_end_with_one_event_counting_the_rest() -> None:
    elog = _log()
    j = Journal(elog, statelib.initial("job"), config=JournalConfig(alert_window_ms=50))
    j.start()
    try:
        for i in range(100):
            j.submit(_alert("n0", f"line {i}"))
        await _until(lambda: j.state.event_counts["log_alert"] == 2)
        alerts = [e.log_alert for e in await elog.read()]
        assert [a.repeats for a in alerts] == [0, 99]
        assert alerts[1].line == "line 99"
    finally:
        await j.close()


@_sync
async def test_a_full_alert_lane_sheds_alerts_never_faults() -> None:
    j = Journal(
        _log(), statelib.initial("job"), config=JournalConfig(alert_queue=10, max_alert_keys=100)
    )
    for i in range(50):  # 50 distinct keys: nothing to coalesce
        assert j.submit(_alert(f"n{i}")) == (i < 10)
    for i in range(50):
        assert j.submit(_lost(f"m{i}"))
    assert j.stats.alerts_shed == 40
    assert j.faults_pending() == 50
    await j.close()


@_sync
async def test_a_failed_append_keeps_the_fault_and_records_it_once_the_log_is_back() -> None:
    elog = _log()
    elog.down = True
    j = Journal(
        elog, statelib.initial("job"), config=JournalConfig(retry_min_ms=5, retry_max_ms=20)
    )
    j.start()
    try:
        j.submit(_lost("dead"), detected=0.0)
        await _until(lambda: j.stats.failed_appends >= 2)  # retried, and still held
        assert j.faults_pending() == 1
        assert await elog.last_seq() == 0
        elog.down = False
        await _until(lambda: j.faults_pending() == 0)
        assert [e.WhichOneof("payload") for e in await elog.read()] == ["node_lost"]
    finally:
        await j.close()


@_sync
async def test_level_check_records_what_the_view_knows_and_the_log_does_not() -> None:
    truths: list[ev.Event] = []
    checks = [0]

    def conditions(state: ev.JobState) -> list[ev.Event]:
        checks[0] += 1
        return [e for e in truths if state.nodes[e.node_lost.node_id].state == ev.NODE_STATE_ACTIVE]

    elog = _log()
    j = Journal(
        elog, statelib.initial("job"), conditions=conditions, config=JournalConfig(reconcile_ms=20)
    )
    await j.record(_registered("a"), _registered("b"))
    truths.append(_lost("a"))
    j.start()
    try:
        await _until(lambda: j.state.nodes["a"].state == ev.NODE_STATE_LOST)
        seen = checks[0]
        await _until(lambda: checks[0] >= seen + 3)  # more checks ran: nothing repeats
        assert j.state.event_counts["node_lost"] == 1
        assert j.state.nodes["b"].state == ev.NODE_STATE_ACTIVE
    finally:
        await j.close()


@_sync
async def test_a_closed_term_hands_its_observations_to_the_next() -> None:
    store = InMemoryStore()
    old = FlakyLog(store, "job", store.elect("d1"))
    old.down = True
    j1 = Journal(old, statelib.initial("job"))
    j1.start()
    j1.submit(_lost("dead"))
    j1.submit(_registered("late"))
    waiter = asyncio.ensure_future(j1.observe(_lost("other"), 5.0))
    await _until(lambda: j1.pending() == 3)  # the observation is queued
    left = await j1.close()
    with pytest.raises(JournalClosedError):
        await waiter
    # registrations share the fault lane (a loss never overtakes its node's registration)
    assert [p.obj.WhichOneof("payload") for p in left] == [
        "node_lost",
        "node_registered",
        "node_lost",
    ]
    new = InMemoryEventLog(store, "job", store.elect("d1"))
    j2 = Journal(new, await new.replay())
    assert j2.carry_over(left) == 3
    j2.start()
    try:
        await _until(lambda: j2.state.last_seq == 3)
        assert j2.state.nodes["dead"].state == ev.NODE_STATE_LOST
    finally:
        await j2.close()


@_sync
async def test_observe_runs_the_decider_and_returns_its_durable_events() -> None:
    elog = _log()
    j = Journal(elog, statelib.initial("job"))
    ran: list[int] = []

    class Decide:
        recovers = True

        def decide(self, state: ev.JobState, obj: object) -> Decision:
            assert isinstance(obj, ev.Event)
            extra = ev.Event(node_evicted=ev.NodeEvicted(node_id="a", reason="decided"))
            return Decision([obj, extra], after=lambda: ran.append(j.state.last_seq))

    j.decider = Decide()
    j.start()
    try:
        stored = await j.observe(_registered("a"), 5.0)
        assert [e.seq for e in stored] == [1, 2] and elog.appends == 1
        await _until(lambda: ran == [2])  # actions run once the whole decision is durable
    finally:
        await j.close()


def test_gone_nodes_are_pruned_from_the_state_but_not_the_world() -> None:
    s = statelib.initial("job")
    events = [_registered("w0")]
    events.append(ev.Event(job_started=ev.JobStarted(world=ev.WorldLayout(node_ids=["w0"], dp=1))))
    seq = 0
    for e in events:
        seq += 1
        e.seq = seq
    s = statelib.fold(events, s)
    s = statelib.fold([_stamped(_lost("w0"), seq := seq + 1)], s)
    for i in range(3 * statelib.KEEP_GONE_NODES):
        s = statelib.fold(
            [_stamped(_registered(f"n{i}"), seq := seq + 1), _stamped(_lost(f"n{i}"), seq + 1)],
            s,
        )
        seq += 1
    assert "w0" in s.nodes  # the world's own nodes are never pruned
    assert s.gone_nodes == sum(r.state == ev.NODE_STATE_LOST for r in s.nodes.values())
    assert s.gone_nodes <= statelib.KEEP_GONE_NODES + statelib.PRUNE_SLACK
    assert s.pruned_nodes == 3 * statelib.KEEP_GONE_NODES + 1 - s.gone_nodes
    assert f"n{3 * statelib.KEEP_GONE_NODES - 1}" in s.nodes  # newest kept, oldest dropped
    assert "n0" not in s.nodes
    assert not math.isnan(float(s.ByteSize()))


def _stamped(e: ev.Event, seq: int) -> ev.Event:
    e.seq = seq
    return e


class LandsThenFails(InMemoryEventLog):
    """An append whose outcome the store never confirmed: it landed, the caller got an error."""

    lie = True

    async def append_many(self, events: Iterable[ev.Event]) -> list[ev.Event]:
        stored = await super().append_many(events)
        if self.lie:
            self.lie = False
            raise LogUnavailableError("etcd at test:0 did not confirm an append")
        return stored


@_sync
async def test_an_append_that_landed_despite_its_error_is_folded_before_the_next() -> None:
    store = InMemoryStore()
    elog = LandsThenFails(store, "job", store.elect("d1"))
    j = Journal(elog, statelib.initial("job"))
    with pytest.raises(LogUnavailableError):
        await j.record(_registered("a"))
    assert j.state.last_seq == 0  # not folded: the journal does not know it landed
    (b,) = await j.record(_registered("b"))
    assert b.seq == 2 and j.state.last_seq == 2
    assert j.state == await elog.replay()  # "a" was read back and folded first
