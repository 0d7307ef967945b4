"""An incident in a 10,240-node world: every event the machine decides fits the event cap.

bench-scale at 10,240 simulated nodes lost about 3,000 of them during the join; the
incident's RESHAPED transition named the whole new world in its reason (123 KB against the
64 KiB cap), the log refused it, the decision was dropped and the incident never went on.
"""

from __future__ import annotations

import pytest

from unbroken.driver import machine as m
from unbroken.driver import state as statelib
from unbroken.driver import worldsplit
from unbroken.driver.eventlog import DEFAULT_MAX_EVENT_BYTES
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

NODES, GONE, SPARES = 10_240, 200, 64


def _fits(d: m.Decision, state: ev.JobState) -> ev.JobState:
    """Every event as the log stores it (a layout split off, `worldsplit`) fits the cap."""
    for e in worldsplit.split(d.events, DEFAULT_MAX_EVENT_BYTES):
        size = e.ByteSize()
        assert size <= DEFAULT_MAX_EVENT_BYTES, (e.WhichOneof("payload"), size)
    return statelib.fold(d.events, state)


def test_an_incident_in_a_10240_node_world_decides_events_the_log_takes() -> None:
    ids = [f"rack-{i // 64:03d}-node-{i:05d}" for i in range(NODES)]
    world = ev.WorldLayout(dp=NODES, pp=1, tp=1, node_ids=ids, workers_per_node=1)
    s = statelib.initial("j")
    opening = [ev.Event(job_started=ev.JobStarted(trainer="gpt3d", min_nodes=1))]
    opening += [ev.Event(node_registered=ev.NodeRegistered(node_id=n, epoch=1, num_workers=1))
                for n in ids]  # fmt: skip
    opening += [
        ev.Event(
            node_registered=ev.NodeRegistered(
                node_id=f"spare-{i}", epoch=1, num_workers=1, spare=True
            )
        )
        for i in range(SPARES)
    ]
    opening.append(ev.Event(training_resumed=ev.TrainingResumed(at_step=0, world=world)))
    for i, e in enumerate(opening, 1):
        e.seq = i
    s = statelib.fold(opening, s)
    policy = m.Policy()
    for n in ids[:GONE]:
        lost = ev.Event(node_lost=ev.NodeLost(node_id=n, epoch=1, reason="heartbeat timeout"))
        lost.seq = s.last_seq + 1
        d = m.decide(s, lost, policy)
        s = _fits(d, s)
    assert s.phase == ev.PHASE_SUSPECTED
    d = m.decide(s, m.Paused(step=10, restorable_step=10), policy)
    s = _fits(d, s)
    kinds = [e.WhichOneof("payload") for e in d.events]
    assert "recovery_transition" in kinds, kinds
    assert s.phase in (ev.PHASE_RESTORING, ev.PHASE_RESHAPED), ev.Phase.Name(s.phase)
    reasons = [e.recovery_transition.reason for e in d.events if e.HasField("recovery_transition")]
    assert any("more)" in r for r in reasons), reasons  # the world named in part
