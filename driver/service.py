"""The driver's one gRPC servicer, and what outlives a leader's term.

`DriverService` holds what a driver keeps whether it leads or stands by: the live view,
the agents' sessions, the commit bookkeeping, the metrics, the observations an ended term
did not record (carried into the next). It hands the calls to handler objects built with
what they need: the agents' (Register, Session, LiveView: driver/agentapi.py), the
operators' (driver/operator.py) and the launchers' (driver/launcher_api.py). The sweeps
over the live view are driver/nodewatch.py; retention and the persistence interval
driver/retention.py; the configs driver/config.py. A term (driver/term.py) opens the
journal here with `lead` and closes it with `step_down`. Detections are observations for
the term's journal (driver/journal.py), the driver's one writer: faults never wait behind
log alerts and are never dropped, and what the live view knows (a silent node) is
recorded again whenever the log missed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import structlog

from unbroken.common import channel
from unbroken.driver import goodput as goodputlib
from unbroken.driver import loghealth
from unbroken.driver import state as statelib
from unbroken.driver.agentapi import AgentApi
from unbroken.driver.commits import Commits
from unbroken.driver.config import ServiceConfig
from unbroken.driver.decider import Decider
from unbroken.driver.eventkinds import FAULT_KINDS
from unbroken.driver.eventlog import EventLog, NotLeaderError, new_event_id
from unbroken.driver.journal import Journal, Pending
from unbroken.driver.launcher_api import LauncherApi
from unbroken.driver.leadership import Leadership
from unbroken.driver.liveview import LiveView
from unbroken.driver.metrics import DriverMetrics
from unbroken.driver.nodewait import NodeWait
from unbroken.driver.nodewatch import NodeWatch
from unbroken.driver.operator import OperatorApi
from unbroken.driver.retention import CheckpointKeeper
from unbroken.driver.server import LEADER_HEALTH, SERVICE_NAME, build_server
from unbroken.driver.sessions import Sessions
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

__all__ = [
    "LEADER_HEALTH",
    "SERVICE_NAME",
    "DriverService",
    "ServiceConfig",
    "build_server",
]
CARRY_LIMIT = 100_000  # unrecorded observations kept between terms


def _to(handler: str, name: str) -> Any:
    """An RPC of the servicer that its `handler` object answers."""

    async def call(self: DriverService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await getattr(getattr(self, handler), name)(request, context)

    call.__name__ = call.__qualname__ = name
    return call


class DriverService(dgrpc.DriverServicer):
    """The driver's gRPC service (leader or standby): agents' calls here, the rest delegated.

    Operator RPCs go to `self.operators` (`OperatorApi`), launcher RPCs to
    `self.launchers` (`LauncherApi`).
    """

    def __init__(
        self,
        config: ServiceConfig,
        *,
        driver_id: str,
        job_id: str,
        log_: EventLog | None = None,
        leader_address: str = "",
    ) -> None:
        self.config = config
        self.driver_id = driver_id
        self.job_id = job_id
        self.leadership = Leadership(driver_id, job_id, leader_address)
        self.view = LiveView(config.live)
        self.node_wait = NodeWait()  # below min_nodes: the wait for nodes (driver/nodewait.py)
        # observations of an ended term, for the next one (a failure once detected stays)
        self._carry: list[Pending] = []
        # fault event id -> (fault began, detected): latency histograms once it is durable
        self._detected: dict[str, tuple[float, float]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.appended = 0
        self.commits = Commits()
        self._tasks: list[asyncio.Task[None]] = []
        self.sessions = Sessions(
            self.view,
            driver_id,
            term=lambda: self.journal.term[0] if self.journal is not None else 0,
            scope=lambda: self.journal.term[1] if self.journal is not None else "",
        )
        self.stopping = asyncio.Event()
        self.keeper = CheckpointKeeper(config, self.leadership, self.view, self.commits, self.send)
        self.listeners: list[Callable[[ev.Event], None]] = [self.keeper.on_appended]
        self.metrics = DriverMetrics(self._metric_values)
        self.metrics.watch(self.view, self.listeners, time.monotonic)
        self.operators = OperatorApi(self.leadership, self, config)
        self.launchers = LauncherApi(self.leadership, self, self.commits, config)
        self.agents = AgentApi(
            config,
            self.leadership,
            self.view,
            self.sessions,
            self.commits,
            self.keeper,
            emit=self.emit,
            on_self_check=self.operators.on_self_check,
            appended=lambda: self.appended,
        )
        self.nodewatch = NodeWatch(config, self.leadership, self.view, self.emit)
        if log_ is not None:
            self.lead(log_, leader_address)

    # ------------------------------------------------------------ leadership
    @property
    def journal(self) -> Journal | None:
        """This term's only writer (None: standby)."""
        return self.leadership.journal

    @property
    def log(self) -> EventLog | None:
        """The leader's log, for reads (writes go through `journal`)."""
        journal = self.leadership.journal
        return journal.log if journal is not None else None

    @property
    def leader_address(self) -> str:
        """The current leader's address (maybe our own)."""
        return self.leadership.address

    @leader_address.setter
    def leader_address(self, address: str) -> None:
        self.leadership.address = address

    @property
    def diagnosis_running(self) -> str:
        """The id of an operator's diagnosis in progress ("" when none)."""
        return self.operators.diagnosis_running

    @property
    def leader(self) -> bool:
        return self.journal is not None

    @property
    def state(self) -> ev.JobState:
        """The leader's folded job state (from memory); an empty state on a standby."""
        if self.journal is None:
            return statelib.initial(self.job_id)
        return self.journal.state

    def lead(
        self,
        log_: EventLog,
        address: str,
        state: ev.JobState | None = None,
        *,
        decider: Decider | None = None,
        on_resync: Callable[[], None] | None = None,
        recent: Iterable[ev.Event] = (),
        term: tuple[int, str] | None = None,
    ) -> Journal:
        """Become the leader of a new term: `log_`'s journal records from now on.

        Args:
            log_: the log, fenced by this term's leadership.
            address: where agents reach this driver.
            state: `log_.replay()` (default: an empty job, for a fresh log).
            decider, on_resync: the journal's (driver/journal.py; a term's, driver/term.py).
            recent: the log's registrations of the last minute
                (`principalquota.read_recent`): the per-principal quotas start from them
                and from `state`, not from zero, before the first agent call is taken.
            term: the election's leader term and scope (driver/journal.py `Journal.term`).

        Returns:
            The term's journal (started; the previous term's unrecorded observations are
            queued in it).
        """
        state = state if state is not None else statelib.initial(self.job_id)
        self.agents.quotas.seed(state, recent, wall_ns=time.time_ns(), now=time.monotonic())
        journal = Journal(
            log_,
            state,
            config=self.config.journal,
            conditions=self.nodewatch.conditions,
            on_fenced=self._fenced,
            decider=decider,
            on_resync=on_resync,
            term=term,
        )
        journal.subscribers.append(self._on_recorded)
        self.leadership.journal = journal
        self.leader_address = address
        now = time.monotonic()
        for slot in self.view.nodes.values():
            # every node gets a full timeout (with no session yet: the registration grace)
            # to find this leader before it can be judged lost
            if slot.alive and slot.outbox is not None:
                self.view.mark_alive(slot, now)
            elif slot.alive:
                self.view.mark_registered(slot, now)
        journal.start()
        if self._carry and not self._closing:
            journal.carry_over(self._carry)
            self._carry = []
        return journal

    def step_down(self, leader_address: str = "") -> None:
        """Stop leading: agents are sent away to `leader_address`; the journal closes and
        what it did not record is kept for the next term."""
        journal, self.leadership.journal = self.journal, None
        self.leader_address = leader_address
        if journal is not None:
            task = asyncio.get_running_loop().create_task(self._end_term(journal))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.sessions.end_all(
            grpc.StatusCode.UNAVAILABLE,
            f"driver {self.driver_id} stepped down; the leader is at "
            f"{leader_address or 'unknown yet'}",
            ((channel.LEADER_KEY, leader_address),),
        )

    async def _end_term(self, journal: Journal) -> None:
        left = await journal.close()
        left = [p for p in left if p.done is None][:CARRY_LIMIT]
        if self.journal is not None:  # a new term began meanwhile
            self.journal.carry_over([*self._carry, *left])
            self._carry = []
        else:
            self._carry = [*self._carry, *left][:CARRY_LIMIT]
        if left:
            log.warning("observations carried into the next term", count=len(left))

    def _fenced(self, error: NotLeaderError) -> None:
        log.error("lost leadership while appending; stepping down", error=str(error))
        self.step_down()

    # ------------------------------------------------------------ background loops
    def start(self) -> None:
        """Start the detector sweeps (call inside the event loop)."""
        self.nodewatch.start()

    async def close(self) -> None:
        """Stop the sweeps and end every session."""
        self.stopping.set()
        await self.operators.close()
        await self.nodewatch.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.journal is not None:
            await self.journal.close()
            self.leadership.journal = None
        for task in list(self._closing):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.metrics.close()

    def emit(self, event: ev.Event, last_seen: float = math.nan) -> bool:
        """Hand a detection to the journal; False only when a log alert was shed.

        `last_seen`: when the fault began (a lost node's last heartbeat), for the
        detection-latency histogram (fault began -> durable). Without a term (stepping
        down), detections are kept for the next one.
        """
        event.cause = event.cause or "detector"
        if not event.event_id:
            event.event_id = new_event_id()
        now = time.monotonic()
        if event.WhichOneof("payload") in FAULT_KINDS and len(self._detected) < CARRY_LIMIT:
            self._detected[event.event_id] = (last_seen, now)
        return self.submit(event, now)

    def submit(self, item: Any, detected: float = math.nan) -> bool:
        """Queue an observation (an event or a recovery-loop progress report)."""
        if self.journal is not None:
            return self.journal.submit(item, detected)
        if len(self._carry) < CARRY_LIMIT and isinstance(item, ev.Event):
            self._carry.append(Pending(item, detected))
            return True
        log.warning("not leader; observation discarded", kind=_kind(item))
        return False

    def _on_recorded(self, event: ev.Event) -> None:
        self.appended += 1
        seen = self._detected.pop(event.event_id, None)
        if seen is not None:
            last_seen, detected = seen
            now = time.monotonic()
            if not math.isnan(last_seen):
                self.metrics.detect_latency.observe(now - last_seen)
            self.metrics.fault_durable.observe(now - detected)
        for fn in list(self.listeners):
            try:
                fn(event)
            except Exception:
                log.exception("event listener failed")

    # ------------------------------------------------------------ the RPCs, by handler
    Register = _to("agents", "Register")
    Session = _to("agents", "Session")
    LiveView = _to("agents", "LiveView")
    GetStatus = _to("operators", "GetStatus")
    ListNodes = _to("operators", "ListNodes")
    WatchEvents = _to("operators", "WatchEvents")
    Diagnose = _to("operators", "Diagnose")
    Evict = _to("operators", "Evict")
    ClearNode = _to("operators", "ClearNode")
    RunSelfCheck = _to("operators", "RunSelfCheck")
    InjectFault = _to("operators", "InjectFault")
    Resume = _to("operators", "Resume")
    RegisterJob = _to("launchers", "RegisterJob")
    ReportFailure = _to("launchers", "ReportFailure")
    ListCheckpoints = _to("launchers", "ListCheckpoints")
    RequestCheckpoint = _to("launchers", "RequestCheckpoint")

    # ------------------------------------------------------------ commands
    def send(self, node_id: str, msg: dpb.DriverMessage) -> str:
        """Queue a command for `node_id`'s agent (`Sessions.send`)."""
        return self.sessions.send(node_id, msg)

    async def request(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> dpb.AgentMessage:
        """Send a command and wait for its reply (`Sessions.request`)."""
        return await self.sessions.request(node_id, msg, timeout_s)

    def ask(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> asyncio.Future[dpb.AgentMessage]:
        """Send a command; the future of its reply (`Sessions.ask`)."""
        return self.sessions.ask(node_id, msg, timeout_s)

    @property
    def dropped_commands(self) -> int:
        return self.sessions.dropped_commands

    # ------------------------------------------------------------ stats
    def stats(self) -> dpb.LiveStats:
        return self.agents.stats()

    def reset_samples(self) -> None:
        """Forget latency samples (benchmarks call this between load levels)."""
        self.agents.reset_samples()

    def goodput(self) -> goodputlib.Goodput:
        """The job's goodput now (-1 ratio on a standby or before training began)."""
        j = self.journal
        if j is None:
            return goodputlib.Goodput(-1.0, 0.0)
        return goodputlib.goodput_now(j.state, self.view)

    def _metric_values(self) -> dict[str, Any]:
        alive = self.view.alive_count()
        j = self.journal
        return {
            "leader": j is not None,
            "heartbeats": sum(s.heartbeats for s in self.view.nodes.values()),
            "nodes": {"alive": alive, "lost": len(self.view.nodes) - alive},
            "events": self.appended,
            "dropped": self.dropped_commands,
            "alerts_shed": j.stats.alerts_shed if j else 0,
            "alerts_coalesced": j.stats.alerts_coalesced if j else 0,
            "faults_pending": j.faults_pending() if j else 0,
            **({"goodput": self.goodput(), "persist_every_s": self.persist_every_s()} if j else {}),
            "snapshots_too_large": getattr(j.log, "snapshots_too_large", 0) if j else 0,
            **({"phase": j.state.phase, "awaiting_nodes": j.state.awaiting_nodes} if j else {}),
            "newest_commit_age_s": self.newest_commit()[1],
            "event_log": loghealth.summary(j),
            "mass_silence": self.mass_silence(),
            "loop_busy": round(self.nodewatch.busy, 3),
        }

    def newest_commit(self) -> tuple[int, float]:
        return self.keeper.newest_commit()

    def mass_silence(self) -> tuple[int, float, float]:
        """The mass silence the node watch holds back now (nodes, held s, unheard s)."""
        return self.nodewatch.mass_silence(time.monotonic())

    def awaiting_nodes(self, state: ev.JobState) -> str:
        """What the open incident waits for below min_nodes, and how long it still may."""
        return self.node_wait.line(state, time.monotonic())

    def persist_failing(self) -> list[dpb.PersistFailure]:
        return self.keeper.persist_failing()

    def persistence(self) -> tuple[float, float, float]:
        return self.keeper.persistence()

    def persist_every_s(self) -> float:
        return self.keeper.persist_every_s()


def _kind(item: Any) -> str:
    return str(item.WhichOneof("payload")) if isinstance(item, ev.Event) else type(item).__name__
