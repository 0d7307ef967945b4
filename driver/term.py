"""A leader's term: what begins when this driver is elected and ends when it steps down.

`Term` is the one place a term is assembled. `begin()` replays the log (and reads its last
minute's registrations, where the per-principal quotas go on from), opens the term's
journal with its decider (the recovery loop's when a job is configured, else record-only),
expects the log's nodes back, records LeaderElected, then starts the scheduler bridge and
the recovery loop. `end()` undoes it in reverse: the loop stops, the bridge closes, the
journal closes (its unrecorded observations are carried into the next term). Every
collaborator is handed in by the constructor; nothing is found back at run time.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from unbroken.driver import principalquota
from unbroken.driver.decider import Decision, RecordOnly
from unbroken.driver.eventlog import EventLog, Leadership
from unbroken.driver.journal import Journal
from unbroken.driver.liveview import LiveView, NodeSlot
from unbroken.driver.loop import LoopConfig, RecoveryLoop, timeline
from unbroken.driver.scheduler import BridgeConfig, Scheduler, SchedulerBridge
from unbroken.driver.service import DriverService
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)


class Term:
    """One leader term of this driver.

    Args:
        host: the driver's agent service (its live view, commits and sessions outlive terms).
        log_: the event log, fenced by this term's `leadership`.
        leadership: the election's grant (driver id, lease, term number, scope).
        address: where agents reach this driver.
        loop: the job the driver starts and recovers (`nodes` 0: none; launcher mode).
        scheduler: the cluster scheduler (None: none); `bridge` configures its bridge.
        grace_s: how long a node the log knows has to find this leader (the registration
            grace twice over: agents need a few backoff rounds to find a new leader).
    """

    def __init__(
        self,
        host: DriverService,
        log_: EventLog,
        leadership: Leadership,
        address: str,
        *,
        loop: LoopConfig,
        scheduler: Scheduler | None = None,
        bridge: BridgeConfig | None = None,
        grace_s: float = 0.0,
    ) -> None:
        self.host = host
        self.log = log_
        self.leadership = leadership
        self.address = address
        self.loop_config = loop
        self.scheduler = scheduler
        self.bridge_config = bridge
        self.grace_s = grace_s
        self.journal: Journal | None = None
        self.loop: RecoveryLoop | None = None
        self.bridge: SchedulerBridge | None = None
        self._deciding = False  # the loop decides once it started (before: recorded as is)
        self._early = RecordOnly()

    async def begin(self) -> Journal:
        """Replay, open the journal, record LeaderElected, start the bridge and the loop."""
        state = await self.log.replay()
        # the per-principal quotas go on from the log's last minute, not from zero
        recent = await principalquota.read_recent(self.log, state.last_seq, time.time_ns())
        host = self.host
        host.commits.timeline = timeline(state)  # rollbacks so far: older shards are stale
        recovers = bool(self.loop_config.nodes)
        journal = host.lead(
            self.log,
            self.address,
            state,
            decider=self if recovers else RecordOnly(),
            on_resync=self._resync if recovers else None,
            recent=recent,
            term=(self.leadership.term, self.leadership.scope),
        )
        self.journal = journal
        if recovers:
            self.loop = RecoveryLoop(self.loop_config, host, journal, host.view)
            # before the first await: an agent that finds this leader while LeaderElected is
            # being written must meet its node as the log knows it (a reconnect), not as a
            # stranger (a new NodeRegistered; seen after a failover in bench-recovery)
            expect_known_nodes(host.view, state, self.grace_s)
        lead = self.leadership
        try:
            await journal.record(
                ev.Event(
                    cause="election",
                    leader_elected=ev.LeaderElected(
                        driver_id=lead.driver_id,
                        lease_id=lead.lease_id,
                        term=lead.term,
                        address=self.address,
                        scope=lead.scope,
                    ),
                )
            )
        except BaseException:
            self.loop = None
            host.step_down()
            raise
        log.info("leading", term=lead.term, last_seq=state.last_seq, nodes=len(state.nodes))
        if self.scheduler is not None:
            # evictions reach the scheduler; its faults reach the loop
            self.bridge = SchedulerBridge(self.scheduler, journal, self.bridge_config)
            self.bridge.start()
            host.leadership.bridge = self.bridge
        if self.loop is not None:
            self._deciding = True
            self.loop.start()
        return journal

    async def end(self, leader_address: str = "", *, step_down: bool = True) -> None:
        """Stop the loop, close the bridge, step down (in reverse of `begin`).

        `step_down` False: the driver is stopping and its service closes the journal (the
        agents' streams end with the server, after its grace)."""
        if self.loop is not None:
            self._deciding = False
            await self.loop.close()
            self.loop = None
        if self.bridge is not None:
            if self.host.leadership.bridge is self.bridge:
                self.host.leadership.bridge = None
            await self.bridge.close()
            self.bridge = None
        if step_down and self.journal is not None and self.host.leadership.journal is self.journal:
            self.host.step_down(leader_address)
        self.journal = None

    @property
    def recovers(self) -> bool:
        """The term's decider is the job's recovery (only built when it has one)."""
        return True

    def decide(self, state: ev.JobState, observation: Any) -> Decision:
        """The recovery loop's decision once it started (before: recorded as it is)."""
        if self._deciding and self.loop is not None:
            return self.loop.decide(state, observation)
        return self._early.decide(state, observation)

    def _resync(self) -> None:
        if self._deciding and self.loop is not None:
            self.loop.resettle()


def expect_known_nodes(view: LiveView, state: ev.JobState, grace_s: float) -> None:
    """Track the log's active and spare nodes as registered, before they find this leader.

    A node that died during the failover never registers with the new leader; without a
    slot in the live view it would never be declared lost, and a restart of its world
    would wait for its session forever. Each gets `grace_s` beyond the registration grace to
    come back (agents need a few backoff rounds to find the new leader). So does a node this
    driver already tracked from an earlier term of its own whose session the step-down
    ended: it was measured by the miss limit alone and, seconds into its backoff, declared
    lost (a spare so lost, the chaos suite's stopped etcd shrank the world instead of
    taking it). A node that asked this driver for the leader during the election retries
    fast: once the others are back and quiet, it is lost after `failover_grace_ms`
    (`LiveView.await_nodes`, `detectors.silent`).
    """
    awaited: list[NodeSlot] = []
    for node_id, rec in state.nodes.items():
        if rec.state not in (ev.NODE_STATE_ACTIVE, ev.NODE_STATE_SPARE):
            continue
        known = view.nodes.get(node_id)
        if known is not None:
            if not known.connected and known.alive:
                awaited.append(known)  # back within the same grace
            continue
        slot = view.slot(node_id)
        slot.epoch = rec.epoch
        slot.info = dpb.RegisterRequest(
            node_id=node_id,
            epoch=rec.epoch,
            hostname=rec.hostname,
            ip=rec.ip,
            num_workers=rec.num_workers,
            spare=rec.spare,
        )
        awaited.append(slot)
    view.await_nodes(awaited, time.monotonic(), grace_s)
