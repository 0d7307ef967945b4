"""The scheduler bridge on the in-memory pool and an in-memory journal (no Slurm needed).

Evictions drain with `unbroken: <incident> <cause>`; a lost world node is drained and
replaced from the pool; the pool of spares is kept topped up; a scheduler that refuses is
recorded (ok=false) and does not stop the bridge; the scheduler's own faults (DOWN, a
foreign DRAIN) become observations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from unbroken.driver import state as statelib
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.journal import Journal
from unbroken.driver.scheduler import (
    BridgeConfig,
    InMemoryScheduler,
    NodeHealth,
    NodeInfo,
    SchedulerBridge,
    drain_reason,
)
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def run(
    body: Callable[[Journal, InMemoryScheduler, SchedulerBridge], Awaitable[None]],
    pool: InMemoryScheduler,
    config: BridgeConfig,
) -> list[ev.Event]:
    async def main() -> list[ev.Event]:
        store = InMemoryStore()
        elog = InMemoryEventLog(store, "j", store.elect("d"))
        journal = Journal(elog, statelib.initial("j"))
        journal.start()
        bridge = SchedulerBridge(pool, journal, config)
        bridge.start()
        try:
            await body(journal, pool, bridge)
        finally:
            await bridge.close()
            await journal.close()
        return await elog.read()

    return asyncio.run(main())


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def world(*nodes: str) -> list[ev.Event]:
    w = ev.WorldLayout(dp=len(nodes), pp=1, tp=1, node_ids=list(nodes), workers_per_node=1)
    return [
        *(ev.Event(node_registered=ev.NodeRegistered(node_id=n, epoch=1)) for n in nodes),
        ev.Event(job_started=ev.JobStarted(world=w)),
        ev.Event(training_resumed=ev.TrainingResumed(world=w)),
    ]


def calls(events: list[ev.Event]) -> list[ev.SchedulerCall]:
    return [e.scheduler_call for e in events if e.HasField("scheduler_call")]


def test_drain_reason_is_one_bounded_line() -> None:
    assert drain_reason("i4", "node a lost\n(x)") == "unbroken: i4 node a lost (x)"
    assert drain_reason("", "why") == "unbroken: - why"
    assert len(drain_reason("i1", "x" * 1000)) == 200


def test_an_eviction_drains_with_the_incident_and_the_answer_is_recorded() -> None:
    pool = InMemoryScheduler.of(["a", "b"], ["c"])

    async def body(j: Journal, pool: InMemoryScheduler, _: SchedulerBridge) -> None:
        await j.record(*world("a", "b"))
        await j.record(
            ev.Event(node_evicted=ev.NodeEvicted(node_id="b", reason="incident i9: bad matmul"))
        )
        await until(lambda: j.state.event_counts["scheduler_call"] >= 1)

    events = run(body, pool, BridgeConfig(poll_s=0))
    (drain,) = [c for c in calls(events) if c.action == "drain"]
    assert (drain.node_id, drain.ok, drain.scheduler) == ("b", True, "memory")
    assert drain.reason == "unbroken: i9 bad matmul"
    assert pool.nodes_["b"].health is NodeHealth.DRAINING
    assert pool.nodes_["b"].reason == "unbroken: i9 bad matmul"


def test_a_lost_node_is_drained_and_the_spare_pool_refilled() -> None:
    started: list[str] = []
    pool = InMemoryScheduler.of(["a", "b"], ["c", "d"])
    pool.start_agent = started.append

    async def body(j: Journal, pool: InMemoryScheduler, _: SchedulerBridge) -> None:
        await j.record(*world("a", "b"))
        await until(lambda: started == ["c"])  # one spare kept: its agent started
        await j.record(
            ev.Event(node_registered=ev.NodeRegistered(node_id="c", epoch=1, spare=True))
        )
        await j.record(
            ev.Event(node_lost=ev.NodeLost(node_id="b", epoch=1, reason="heartbeat timeout")),
            ev.Event(
                recovery_transition=ev.RecoveryTransition(
                    from_phase=ev.PHASE_RUNNING, to_phase=ev.PHASE_SUSPECTED, incident_id="i7"
                )
            ),
        )
        await until(lambda: pool.nodes_["b"].health.faulty)
        await j.record(
            ev.Event(spare_assigned=ev.SpareAssigned(spare_node_id="c", replaces_node_id="b"))
        )
        await until(lambda: started == ["c", "d"])  # the pool refilled
        await until(lambda: j.state.event_counts["scheduler_call"] >= 3)

    events = run(body, pool, BridgeConfig(poll_s=0, spares=1))
    got = calls(events)
    drain = next(c for c in got if c.action == "drain")
    assert drain.node_id == "b" and drain.reason == "unbroken: i7 node b lost (heartbeat timeout)"
    assert [c.detail for c in got if c.action == "replace"] == ["c", "d"]


def test_a_refusal_is_recorded_and_the_scheduler_s_faults_are_observations() -> None:
    pool = InMemoryScheduler.of(["a", "b", "c"])

    async def body(j: Journal, pool: InMemoryScheduler, _: SchedulerBridge) -> None:
        await j.record(*world("a", "b", "c"))
        # evicting a node the scheduler does not know: an error, recorded
        await j.record(ev.Event(node_evicted=ev.NodeEvicted(node_id="zz", reason="x")))
        await until(lambda: j.state.event_counts["scheduler_call"] >= 1)
        pool.nodes_["a"] = NodeInfo("a", NodeHealth.DOWN, "Not responding", "DOWN*")
        pool.nodes_["c"] = NodeInfo("c", NodeHealth.DRAINED, "bad fan", "IDLE+DRAIN")
        await until(
            lambda: (
                j.state.event_counts["node_lost"] >= 1
                and j.state.event_counts["operator_action"] >= 1
            )
        )

    events = run(body, pool, BridgeConfig(poll_s=0.02))
    got = calls(events)
    refused = next(c for c in got if c.node_id == "zz")
    assert not refused.ok and "unknown node" in refused.detail, refused
    # a lost node someone else took down keeps their reason; no spare is left to replace it
    kept = next(c for c in got if c.node_id == "a" and c.action == "drain")
    assert kept.ok and kept.detail == "a already DOWN*: Not responding", kept
    assert any(c.action == "replace" and not c.ok for c in got), got
    lost = next(e.node_lost for e in events if e.HasField("node_lost"))
    assert lost.node_id == "a" and lost.reason == "memory: DOWN*: Not responding", lost
    op = next(e.operator_action for e in events if e.HasField("operator_action"))
    assert (op.action, op.target) == ("evict", "c") and "bad fan" in op.who, op
