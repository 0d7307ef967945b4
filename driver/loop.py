"""The recovery loop: the asyncio shell around the pure state machine (driver/machine.py).

The leader runs one `RecoveryLoop`. It starts the job itself: once `LoopConfig.nodes`
non-spare agents are registered (started with `--no-start`), it appends JobStarted and
TrainingResumed(step 0, world) and sends StartWorkers with each node's rank base and a
fresh master port. From then on every observation goes through `machine.decide`:

- detector events (WorkerFailed, NodeLost, HangSuspected, LogAlert, ...) and operator,
  launcher and diagnosis observations are queued in the term's journal
  (driver/journal.py); the loop is the journal's decider (driver/decider.py): its writer
  calls `RecoveryLoop.decide(state, observation)`, which returns the decision's events
  (the observation first), its actions and a callback that performs them once all are
  durable (one transaction);
- progress is observed here and queued the same way (`Observation`): every reachable agent
  acknowledged the stop (`machine.Paused`), every rank of the restarted world reports a
  step (RestoreFinished).

Every action the machine emits has a performer (`PERFORMERS`): StopWorkers -> StopWorkers
(workers flash-save every step into agent-owned memory, so stopping them loses nothing;
in the in-job mode only the faulty ranks stop and every other worker is held in its
process), then `Paused`; StartWorkers -> RestorePoint (before a restore) and StartWorkers
(new world size, rank bases, a fresh master port; in-job: held workers rejoin in place);
Restore -> the watch for every rank's step, then RestoreFinished (workers restore at start:
memory -> buddy -> storage); EvictNode -> Evict; ResumeAll -> Resume; StopAll ->
StopWorkers; RunDiagnosis -> the incident's diagnosis, then its verdict.
On becoming leader the loop calls `machine.settle` on the replayed state and performs the
pending actions again (each is idempotent); a RUNNING job whose world nodes run no workers
(the old leader died between JobStarted and StartWorkers) gets StartWorkers again.

Loss spikes: the loop feeds the live loss curve (`detectors.LossWatch`) and queues a
LossSpike while RUNNING; the machine decides the Rollback. Before the restarted world's
StartWorkers each agent gets a RestorePoint: the rollback's committed step and the batches
to skip (step 0 = the newest step every rank can obtain, for every other restore).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from unbroken.diagnostics.check import free_port
from unbroken.driver import (
    completion,
    machine,
    nodewait,
    replicapolicy,
    sdcwatch,
    spikewatch,
    worldplan,
)
from unbroken.driver import state as statelib
from unbroken.driver import worldprogress as progress
from unbroken.driver.buddies import (
    buddy_index,
    common_steps,
    replica_address,
    ring_buddies,
    ring_buddy_map,
    ring_order,
    start_messages,
)
from unbroken.driver.commits import Commits
from unbroken.driver.config import LoopConfig, ServiceConfig
from unbroken.driver.decider import Decision
from unbroken.driver.eventkinds import OBSERVED
from unbroken.driver.fanout import Fanout
from unbroken.driver.journal import Journal
from unbroken.driver.liveview import LiveView
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

__all__ = [
    "LoopConfig",
    "Observation",
    "RecoveryLoop",
    "common_steps",
    "replica_address",
    "ring_buddies",
    "ring_order",
    "timeline",
]

log = structlog.get_logger(__name__)

STARTUP_REPORT_S = 3600.0  # a first start's TrainingStepping comes within this or never
RING_SETTLE_S = 0.5  # after a stop, wait at most this for heartbeats with the final ring


@dataclass(frozen=True, slots=True)
class Settle:
    """Queued on becoming leader: finish a half-appended decision, resend its actions."""


@dataclass(frozen=True, slots=True)
class StartJob:
    """Queued once the world's nodes are registered: start the job at step 0."""

    node_ids: tuple[str, ...]


#: What the recovery loop decides on: a recorded fact (a detector's, an operator's, a
#: launcher's or its own progress event), every agent's stop acknowledged (`Paused`), a
#: takeover's settling, the job's start.
Observation = ev.Event | machine.Paused | Settle | StartJob


def timeline(state: ev.JobState) -> int:
    """The job's timeline: rollbacks so far (each abandons the steps after its target)."""
    return int(state.event_counts.get("rollback", 0))


#: How long a start waits for a world node's first heartbeat to this leader before deciding
#: whether its workers already run the start (`_running_start`); then it starts them anyway.
ADOPT_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class _Started:
    """A world's start (by decision `gen`), for the restore that follows it to watch."""

    gen: int
    nodes: tuple[str, ...]
    marks: dict[str, int]  # each node's heartbeat count before the start
    t0: float
    errors: tuple[str, ...]
    deadline: float


class LoopHost(Protocol):
    """What the loop needs of the driver it runs in (the agent service): commands to the
    agents, the journal's intake, the commits' shard size and the persistence interval."""

    config: ServiceConfig
    commits: Commits
    view: LiveView  # what a diagnosis reads (driver/diagnose.py)
    node_wait: nodewait.NodeWait  # below min_nodes: the wait for nodes (`unbroken status`)

    def submit(self, item: Any, detected: float = ...) -> bool: ...

    def emit(self, event: ev.Event, last_seen: float = ...) -> bool: ...

    def send(self, node_id: str, msg: dpb.DriverMessage) -> str: ...

    async def request(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> dpb.AgentMessage: ...

    def ask(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> asyncio.Future[dpb.AgentMessage]: ...

    def persist_every_s(self) -> float: ...


class RecoveryLoop:
    """The leader's recovery loop (one per term)."""

    def __init__(
        self, config: LoopConfig, service: LoopHost, journal: Journal, view: LiveView
    ) -> None:
        self.config = config
        self.policy = config.policy
        self.service = service
        self.journal = journal
        self.view = view  # the live view: sessions, heartbeats, rings
        self._gen = 0  # bumped by every performed decision; older progress watchers stop
        self._tasks: set[asyncio.Task[None]] = set()
        self._point = dpb.RestorePoint()  # sent before the next restore's StartWorkers
        self._timeline = timeline(journal.state)  # sent with every StartWorkers
        self._diagnosis: tuple[str, asyncio.Task[None]] | None = None  # id, task
        # node -> the buddy this loop paired it with (StartWorkers.buddy); a node not in
        # it (paired by an earlier leader, or never) is believed about its registered one
        self._buddy: dict[str, str] = {}
        self._started: _Started | None = None  # the newest start, for its restore to watch
        self.fanout = Fanout(service, view, config.command_timeout_s)  # broadcasts, stops once

    @property
    def state(self) -> ev.JobState:
        """The journal's folded state: every recorded event, by anyone (while the journal
        decides, also its decisions earlier in the same transaction)."""
        return self.journal.deciding_state

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Watch the job and settle the replayed state (the term hands `decide` and
        `resettle` to the journal when it builds it, driver/term.py)."""
        self._spawn(spikewatch.watch(self))
        self._spawn(sdcwatch.watch(self))
        self._spawn(completion.watch(self))
        if self.policy.keep_training:
            self._spawn(replicapolicy.watch(self))
        if self.policy.await_nodes_s:
            self._spawn(nodewait.watch(self))
        if self.state.phase == ev.PHASE_STARTING:
            self._spawn(self._wait_for_world())
        else:
            self.service.submit(Settle())

    def resettle(self) -> None:
        """Events landed unseen (an append that reported failure): finish their decision."""
        self.journal.submit(Settle())

    async def close(self) -> None:
        """Stop watching (the service keeps running as a standby)."""
        self.fanout.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ deciding (the journal's writer)
    recovers = True  # the Decider seam (driver/decider.py): this one runs the recovery

    def decide(self, state: ev.JobState, observation: Observation) -> Decision:
        """The events to record for a queued observation, and the actions to run after them
        (the journal's writer asks; `state` is its deciding state, `self.state`)."""
        if isinstance(observation, ev.Event):
            return self._on_event(state, observation)
        if isinstance(observation, machine.Paused):
            return self._on_paused(state, observation)
        if isinstance(observation, Settle):
            return self._on_settle(state)
        return self._start_job(state, observation)

    def _on_event(self, s: ev.JobState, item: ev.Event) -> Decision:
        kind = item.WhichOneof("payload")
        if kind not in OBSERVED:
            return Decision([item])
        if machine.reconnect(s, item):
            # the node's own agent again (a failover's herd of 10,000): recorded as it
            # is, without the decision's draft (a copy of the whole state each)
            return Decision([item])
        d = machine.decide(s, item, self.policy)
        if d.note:  # a registration's note says little: 10,000 lines at a join
            (log.debug if kind == "node_registered" else log.info)(
                "observation", kind=kind, note=d.note
            )
        if len(d.events) == 1:  # recorded only: nothing to do
            return Decision(list(d.events))
        return self._then(d)

    def _on_paused(self, s: ev.JobState, item: machine.Paused) -> Decision:
        d = machine.decide(s, item, self.policy)
        if d.note:
            log.info("paused report", note=d.note)
            return Decision([])
        return self._then(d)

    def _on_settle(self, s: ev.JobState) -> Decision:
        d = machine.settle(s, self.policy)
        log.info("settled after replay", phase=ev.Phase.Name(d.phase), events=len(d.events))
        if d.phase == ev.PHASE_RUNNING:
            self._spawn(self._start_if_idle(self._gen + 1))
        return self._then(d)

    def _start_job(self, s: ev.JobState, item: StartJob) -> Decision:
        if s.phase != ev.PHASE_STARTING:
            return Decision([])
        world = self.config.world(list(item.node_ids))
        again = bool(s.world.node_ids)  # JobStarted is in: its leader died before resuming
        if again:
            world = ev.WorldLayout()
            world.CopyFrom(s.world)
        started = ev.Event(
            cause="driver",
            job_started=ev.JobStarted(
                trainer=self.config.trainer,
                world=world,
                min_nodes=self.policy.min_nodes,
                max_nodes=self.policy.max_nodes,
                reports_startup=True,  # _start_workers appends TrainingStepping
            ),
        )
        resumed = ev.Event(cause="driver", training_resumed=ev.TrainingResumed(world=world))
        layout = machine.Layout.of(world)
        wpn = layout.workers_per_node
        action = machine.StartWorkers(
            layout, tuple((n, i * wpn) for i, n in enumerate(layout.node_ids))
        )
        log.info("starting the job", world=worldplan.few(world.node_ids), dp=world.dp)
        events = [resumed] if again else [started, resumed]
        return Decision(events, (action,), lambda: self._perform((action,)))

    def _then(self, d: machine.Decision) -> Decision:
        phases = machine.phases(d.events)
        if phases:
            log.info("recovery", phases=phases, actions=[type(a).__name__ for a in d.actions])
        restore = next((a for a in d.actions if isinstance(a, machine.Restore)), None)
        point = None
        if restore is not None:  # the state after the decision: a copy, so only when needed
            after = statelib.fold(d.events, self.state)  # (2-3 MB at 10,240 nodes)
            point = worldplan.restore_point(after, restore, self.policy)
        rollbacks = sum(e.WhichOneof("payload") == "rollback" for e in d.events)
        line = timeline(self.state) + rollbacks  # = timeline(after)

        def then() -> None:
            if point is not None:  # read only by this decision's restore
                self._point = point
            self._timeline = line
            self._perform(d.actions)

        return Decision(list(d.events), d.actions, then)

    # ------------------------------------------------------------ acting
    def _perform(self, actions: tuple[machine.Action, ...]) -> None:
        self._gen += 1
        self._spawn(self._act(self._gen, actions))

    async def _act(self, gen: int, actions: tuple[machine.Action, ...]) -> None:
        restore = next((a for a in actions if isinstance(a, machine.Restore)), None)
        try:
            for a in actions:
                if gen != self._gen:
                    return  # a newer decision took over
                await PERFORMERS[type(a)](self, gen, a, restore)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("recovery action failed; the next observation retries")

    async def _stop_workers(
        self, gen: int, a: machine.StopWorkers, restore: machine.Restore | None
    ) -> None:
        """Stop the world's workers (in-job: each node only its faulty ranks, the others
        held in their processes), then report `Paused` with the steps every rank holds."""
        cfg = self.config
        acks: dict[str, dpb.CommandAck] = {}
        t0 = time.monotonic()
        if a.in_job:
            replace: dict[str, list[int]] = {}  # once: per node it was O(world x ranks)
            for m, lr in a.replace:
                replace.setdefault(m, []).append(lr)
            await self.fanout.broadcast(
                a.nodes,
                lambda n: dpb.DriverMessage(
                    stop_workers=dpb.StopWorkers(
                        grace_s=cfg.stop_grace_s,
                        in_job=True,
                        replace_local_ranks=replace.get(n, []),
                    )
                ),
                acks=acks,
                current=lambda: gen == self._gen,
            )
        else:
            await self.fanout.broadcast(
                a.nodes,
                dpb.DriverMessage(stop_workers=dpb.StopWorkers(grace_s=cfg.stop_grace_s)),
                acks=acks,
                current=lambda: gen == self._gen,
            )
        if gen == self._gen:
            fresh = {n for n, ack in acks.items() if ack.ok and ack.ring_fresh}
            held = await self._ring_common(a.nodes, fresh)
            log.info(
                "workers paused",
                rings_fresh=sorted(fresh)[:16],  # (the first few: a world is 10,240)
                fresh=len(fresh),
                held=sorted(held or ()),
                acked_ms=round((time.monotonic() - t0) * 1e3),
            )
            newest = max(held) if held else None
            # every rank's ring holds `newest`: the workers reached it even when the report
            # of that step was lost (a step report is a datagram; a rank that exits right
            # after its last step may never have it read: CI once restored 11 of 12 steps)
            self.service.submit(
                machine.Paused(
                    step=max(self._live_step(a.nodes), newest or 0),
                    restorable_step=newest,
                    memory_steps=frozenset(held or ()),
                )
            )

    async def _evict(self, gen: int, a: machine.EvictNode, restore: machine.Restore | None) -> None:
        self.view.mark_leaving(a.node_id)
        await self.fanout.broadcast(
            (a.node_id,), dpb.DriverMessage(evict=dpb.Evict(reason=a.reason)), wait=False
        )

    async def _resume(
        self, gen: int, a: machine.ResumeAll, restore: machine.Restore | None
    ) -> None:
        for n in a.nodes:
            self.fanout.forget(n)
        await self.fanout.broadcast(
            a.nodes, dpb.DriverMessage(resume=dpb.Resume(at_step=a.step)), wait=False
        )

    async def _stop_all(
        self, gen: int, a: machine.StopAll, restore: machine.Restore | None
    ) -> None:
        stop = dpb.StopWorkers(grace_s=self.config.stop_grace_s)
        await self.fanout.broadcast(a.nodes, dpb.DriverMessage(stop_workers=stop))

    async def _diagnose(
        self, gen: int, a: machine.RunDiagnosis, restore: machine.Restore | None
    ) -> None:
        self._start_diagnosis(a)

    def _start_diagnosis(self, a: machine.RunDiagnosis) -> None:
        """Run the incident's diagnosis in the background; its verdict is an observation.

        The workers are already stopped (PAUSED). The suspects are checked against
        known-good partners: the world's other healthy, connected nodes and connected
        spares. Each round is appended as DiagnosisRound, then the DiagnosisVerdict is
        queued like a detector event, so the machine evicts the named nodes and reshapes.
        Idempotent: the same diagnosis id already running is left alone; another id (the
        suspects changed) replaces it; a new leader that replays an unfinished diagnosis
        runs it again under its id. It cannot wedge the loop: a diagnosis that fails or
        runs out of time gives a verdict naming every suspect bad, unconfirmed (the
        suspects are evicted; `diagnose.diagnose_incident`).
        """
        from unbroken.driver.diagnose import diagnose_incident

        running = self._diagnosis
        if running is not None and not running[1].done():
            if running[0] == a.diagnosis_id:
                return
            running[1].cancel()
        s = self.state
        up = [n for n in a.suspects if self._connected(n)]
        spares = [
            r.node_id
            for r in s.nodes.values()
            if r.state == ev.NODE_STATE_SPARE and r.node_id not in s.world.node_ids
        ]
        good = [
            n for n in (*a.nodes, *sorted(spares)) if n not in a.suspects and self._connected(n)
        ]
        cfg = self.service.config.diagnose
        did = a.diagnosis_id
        log.info("diagnosing the incident", diagnosis_id=did, suspects=up, known_good=good)

        async def run() -> None:
            verdict = await diagnose_incident(
                self.service,
                did,
                up,
                good,
                config=cfg,
                deadline_s=4 * cfg.runner.round_timeout_s,
                unreachable=[n for n in a.suspects if n not in up],
                on_round=lambda r: self.service.emit(ev.Event(cause=did, diagnosis_round=r)),
            )
            self.service.emit(ev.Event(cause=did, diagnosis_verdict=verdict))

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._diagnosis = (did, task)

    async def _ring_common(
        self, nodes: tuple[str, ...], fresh: set[str] | frozenset[str] = frozenset()
    ) -> set[int] | None:
        """The steps every rank of the world holds in its node's flash ring, from the
        heartbeats that follow the stop (each rank's last copy is in them by then).

        `fresh`: nodes whose stop ack said its heartbeat just before it carried their rings
        rescanned after the stop (`CommandAck.ring_fresh`): not waited for. The others
        (an older agent, one behind a relay) get two more heartbeats, ~200 ms."""
        waiting = [n for n in nodes if n not in fresh]
        marks = {n: self._beats(n) for n in waiting}
        deadline = time.monotonic() + RING_SETTLE_S
        while time.monotonic() < deadline and any(self._beats(n) < marks[n] + 2 for n in waiting):
            await self.view.next_beat(0.02)
        return self._ring_held(nodes)

    def _ring_held(self, nodes: tuple[str, ...]) -> set[int] | None:
        """The steps every rank of the world holds in memory now: in its own node's ring, or,
        for the ranks of a node that is gone or being evicted, in the copies its buddy holds
        (the buddies' heartbeats list them); None when some rank is held nowhere (then the
        commits decide)."""
        w = self.state.world
        # a node the incident evicts is replaced by a spare that reads its copies from its
        # buddy, not from the node's own ring: count what the buddy holds for it
        leaving = set(self.state.bad_nodes)
        own: dict[int, set[int]] = {}
        for n in nodes:
            slot = self.view.nodes.get(n)
            if slot is None or not slot.alive or n in leaving:
                continue
            for ws in slot.hb.workers:
                if ws.global_rank >= 0:
                    own[ws.global_rank] = set(ws.ring_steps)
        world = len(w.node_ids) * w.workers_per_node
        buddies: dict[int, set[int]] = {}
        if world and len(own) < world:  # a node's ranks are missing: who holds their copies
            alive = self._alive_nodes()
            gone = {n for n in (*w.node_ids, *nodes) if n not in alive} | leaving
            # only the node each gone node registered as its buddy is believed: another
            # node's claim to hold its copies would move the restore to a step nobody has
            paired = self._ring_map()  # once: a gone node at a time was O(world) each
            buddy_of = {n: b for n in gone if (b := self._buddy_of(n, paired))}
            held_by = buddy_index(buddy_of)
            for slot in self.view.nodes.values():
                if slot.alive and slot.hb.replicas:
                    trusted = held_by(slot)
                    for h in slot.hb.replicas:
                        if h.node in trusted:
                            buddies.setdefault(h.rank, set()).update(h.steps)
        return common_steps(world, own, buddies)

    def _alive_nodes(self) -> set[str]:
        return {n for n, s in self.view.nodes.items() if s.alive}

    def _live_step(self, nodes: tuple[str, ...]) -> int:
        """The newest step any worker of `nodes` reported (the step the job stopped at)."""
        step = self.state.step
        for n in nodes:
            slot = self.view.nodes.get(n)
            if slot is not None:
                step = max([step, *(w.step for w in slot.hb.workers)])
        return step

    def _buddy_of(self, node: str, paired: dict[str, str] | None = None) -> str:
        """The replica server holding `node`'s copies: the buddy this loop paired it with;
        for a new leader, which paired nothing yet, the buddy its predecessor paired (the
        same ring of the incident's world, `ring_buddy_of`); else the one it registered
        ("": unknown). Without the middle step a node lost after a failover was looked for
        at its registered --buddy, which the ring had long replaced: the spare found
        nothing there and the job restored a persisted step, ~600 steps back (bench-recovery,
        MTBF 20 s: both such losses came 0.5 s and 13 s after a driver kill)."""
        if node in self._buddy:
            return self._buddy[node]
        if ring := (self._ring_map() if paired is None else paired).get(node, ""):
            return ring
        rec = self.state.nodes.get(node)
        return rec.replica_buddy if rec is not None else ""

    def _ring_map(self) -> dict[str, str]:
        """`ring_buddy_map` of the incident's world (else the world's)."""
        w = self.state.incident_world if self.state.incident_world.node_ids else self.state.world
        return ring_buddy_map(list(w.node_ids), self.view.nodes)

    async def _start_workers(
        self, gen: int, a: machine.StartWorkers, restore: machine.Restore | None
    ) -> None:
        """Start the world's workers: each node its rank base, the master, the new buddy
        ring and the persistence interval; before a restore each agent first gets the
        RestorePoint (an agent without one restores the newest step). A first start (no
        restore) reports TrainingStepping once every rank stepped; a restart's progress is
        watched by the `Restore` that follows it (`_restore`)."""
        nodes = a.world.node_ids
        deadline = time.monotonic() + self.config.restore_timeout_s
        if not await self._await_sessions(gen, nodes, deadline):
            return
        start_id = f"{restore.incident_id}/{restore.attempt}" if restore is not None else ""
        if start_id and await self._running_start(gen, nodes, start_id, a.world.workers_per_node):
            # A leader that took over a restore its predecessor had already started: the
            # ranks run it, so they are kept, and the Restore that follows watches them. A
            # restart here cost the recovery bench 5 s (MTBF 60 s: a driver killed 1.8 s
            # into an incident; its successor killed the just-resumed ranks and began again).
            log.info(
                "workers already started: adopted", world=worldplan.few(nodes), start_id=start_id
            )
            marks = {n: self._beats(n) for n in nodes}
            self._started = _Started(gen, nodes, marks, time.monotonic(), (), deadline)
            return
        port = free_port()
        marks = {n: self._beats(n) for n in nodes}
        t0 = time.monotonic()
        messages = self._start_messages(a, port, start_id)
        point = self._point if restore is not None else None
        bad, sent = await self.fanout.start(
            nodes, messages, point, current=lambda: gen == self._gen
        )
        if gen != self._gen:
            log.info(
                "workers start superseded by a newer decision", sent_before=worldplan.few(sent)
            )
            return
        for n in nodes:
            if n not in bad and messages[n].start_workers.buddy:
                self._buddy[n] = messages[n].start_workers.buddy
        errors = [f"{n}: {e}" for n, e in bad.items()]
        log.info(
            "workers started",
            world=worldplan.few(nodes),
            nodes=len(nodes),
            master_port=port,
            errors=worldplan.few(errors),
            acked_ms=round((time.monotonic() - t0) * 1e3),
        )
        self._started = _Started(gen, nodes, marks, t0, tuple(errors), deadline)
        if restore is None and not errors and self.state.goodput.startup_open:
            await self._report_stepping(gen, nodes, marks, t0, t0 + STARTUP_REPORT_S)

    async def _running_start(
        self, gen: int, nodes: tuple[str, ...], start_id: str, per_node: int
    ) -> bool:
        """Whether every node's workers (all `per_node` of them) run the start `start_id`,
        by each node's heartbeat; a node this leader has not heard from yet is waited for
        a few heartbeat intervals (a new leader's sessions have just opened)."""
        until = time.monotonic() + ADOPT_WAIT_S
        while any(self._beats(n) == 0 for n in nodes) and time.monotonic() < until:
            if gen != self._gen:
                return False
            await asyncio.sleep(0.02)
        return gen == self._gen and progress.runs_start(self.view, nodes, start_id, per_node)

    async def _await_sessions(self, gen: int, nodes: tuple[str, ...], deadline: float) -> bool:
        """Wait until every world node has a session (it is coming back, or about to be
        declared lost: then a newer decision replaces this one), up to `deadline`. False:
        a newer decision took over."""
        # only the nodes still missing are looked at each turn, and the whole world once
        # more at the end (all at once every 50 ms, a failover's 10,240 reconnecting nodes
        # were 10 % of the new leader's samples)
        missing = list(nodes)
        while True:
            missing = [n for n in missing if not self._connected(n)]
            if not missing:
                missing = [n for n in nodes if not self._connected(n)]
                if not missing:
                    break
            if gen != self._gen:
                return False
            if time.monotonic() > deadline:
                log.error(
                    "world nodes without a session",
                    nodes=worldplan.few(missing),
                    missing=len(missing),
                )
                break
            await asyncio.sleep(0.05)
        return gen == self._gen

    def _start_messages(
        self, a: machine.StartWorkers, port: int, start_id: str
    ) -> Mapping[str, dpb.DriverMessage]:
        """Each world node's StartWorkers, built as it is sent (`buddies.start_messages`)."""
        return start_messages(
            a,
            port,
            self.config,
            self.view,
            old=list(self.state.incident_world.node_ids),
            # the ring paired once: each replaced node's asked for it again (O(world) each)
            buddy_of=functools.partial(self._buddy_of, paired=self._ring_map()),
            records=self.state.nodes,
            timeline=self._timeline,
            persist_every_s=self.service.persist_every_s(),
            shard_bytes=self.service.commits.shard_bytes,
            sitting_out=[n for n in self.state.sitting_out if self._connected(n)],
            start_id=start_id,
        )

    async def _restore(self, gen: int, a: machine.Restore, restore: machine.Restore | None) -> None:
        """The restarted world's restore: once every rank reports a step (or the deadline
        passed, or a start failed), RestoreFinished is observed (the machine matches it to
        the restore it planned)."""
        st = self._started
        if st is None or st.gen != gen:
            return  # its start did not happen (superseded): nothing to watch
        error = "; ".join(st.errors)
        while not error and not progress.all_stepping(self.view, st.nodes, st.marks):
            if gen != self._gen:
                return
            if time.monotonic() > st.deadline:
                error = f"not every rank reported a step within {self.config.restore_timeout_s} s"
            await self.view.next_beat(0.05)  # the last rank's first step: at once
        if gen != self._gen:
            return
        nodes, t0 = st.nodes, st.t0
        self.service.submit(
            ev.Event(
                cause="driver",
                restore_finished=ev.RestoreFinished(
                    step=a.step,
                    restored_step=progress.restored_step(self.view, nodes),
                    trained_s=progress.trained_s(self.view, nodes, t0, restored=True),
                    storage_ranks=progress.storage_ranks(self.view, nodes),
                    duration_s=time.monotonic() - t0,
                    ok=not error,
                    error=error,
                ),
            )
        )

    async def _report_stepping(
        self, gen: int, nodes: tuple[str, ...], marks: dict[str, int], t0: float, deadline: float
    ) -> None:
        """Append TrainingStepping once every rank of the job's first start stepped: the
        goodput ledger charges the start-up until then."""
        while not progress.all_stepping(self.view, nodes, marks):
            if gen != self._gen or time.monotonic() > deadline:
                return  # an incident came first: it closes the start-up
            await asyncio.sleep(0.05)
        if gen != self._gen or not self.state.goodput.startup_open:
            return
        slots = [self.view.nodes.get(n) for n in nodes]
        steps = [w.step for slot in slots if slot is not None for w in slot.hb.workers]
        self.service.submit(
            ev.Event(
                cause="driver",
                training_stepping=ev.TrainingStepping(
                    step=min(steps, default=0),
                    startup_s=time.monotonic() - t0,
                    trained_s=progress.trained_s(self.view, nodes, t0, restored=False),
                ),
            )
        )

    def _connected(self, node_id: str) -> bool:
        slot = self.view.nodes.get(node_id)
        return slot is not None and slot.alive and slot.outbox is not None

    def _beats(self, node_id: str) -> int:
        slot = self.view.nodes.get(node_id)
        return slot.heartbeats if slot is not None else 0

    # ------------------------------------------------------------ idle worlds
    async def _start_if_idle(self, gen: int) -> None:
        """After a takeover: start the world's workers when some world node runs none.

        The old leader may have died between appending JobStarted (or a TrainingResumed)
        and sending StartWorkers. Waits (up to `start_timeout_s`) for every world node to
        reconnect and heartbeat to this driver; a node whose agent reports no worker at all
        was never started, and StartWorkers (idempotent) restarts the whole world.
        """
        cfg = self.config
        deadline = time.monotonic() + cfg.start_timeout_s
        nodes = tuple(self.state.world.node_ids)
        while any(not self._connected(n) or self._beats(n) < 2 for n in nodes):
            if time.monotonic() > deadline or gen < self._gen or not nodes:
                return
            await asyncio.sleep(0.1)
        if gen < self._gen or self.state.phase != ev.PHASE_RUNNING:
            return  # a newer decision acts on the world
        idle = [n for n in nodes if not self.view.nodes[n].hb.workers]
        if not idle:
            return
        layout = machine.Layout.of(self.state.world)
        wpn = layout.workers_per_node
        action = machine.StartWorkers(
            layout, tuple((n, i * wpn) for i, n in enumerate(layout.node_ids))
        )
        log.warning("world nodes run no workers after the takeover; starting them", idle=idle)
        self._perform((action,))

    # ------------------------------------------------------------ starting the job
    async def _wait_for_world(self) -> None:
        """Wait for the world's nodes to register, then queue the job's start."""
        cfg = self.config
        deadline = time.monotonic() + cfg.start_timeout_s
        while True:
            ready = self._ready_nodes()
            if len(ready) >= cfg.nodes:
                self.service.submit(StartJob(tuple(ready[: cfg.nodes])))
                return
            if time.monotonic() > deadline:
                reason = (
                    f"only {len(ready)} of {cfg.nodes} nodes registered within "
                    f"{cfg.start_timeout_s} s (--nodes); start more agents or lower --nodes"
                )
                log.error("job not started", reason=reason)
                self.service.emit(ev.Event(job_finished=ev.JobFinished(ok=False, reason=reason)))
                return
            await asyncio.sleep(0.1)

    def _ready_nodes(self) -> list[str]:
        """Non-spare nodes with an open session, oldest registration first."""
        out = []
        for slot in self.view.nodes.values():
            if slot.alive and slot.outbox is not None and slot.info.node_id and not slot.info.spare:
                out.append(slot.node_id)
        return out


_Performer = Callable[[RecoveryLoop, int, Any, "machine.Restore | None"], Awaitable[None]]
#: Who performs each action the machine emits (every `machine.Action`; a test walks them).
PERFORMERS: dict[type, _Performer] = {
    machine.StopWorkers: RecoveryLoop._stop_workers,
    machine.RunDiagnosis: RecoveryLoop._diagnose,
    machine.EvictNode: RecoveryLoop._evict,
    machine.StartWorkers: RecoveryLoop._start_workers,
    machine.Restore: RecoveryLoop._restore,
    machine.ResumeAll: RecoveryLoop._resume,
    machine.StopAll: RecoveryLoop._stop_all,
}
