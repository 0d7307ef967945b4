"""The driver's gRPC service for agents: registration, the heartbeat stream, commands.

The heartbeat handler is the hot path of the whole system (2,000 nodes x 10/s): per
message it takes one monotonic timestamp, stores the message by reference in the node's
slot and moves the node to the end of the deadline order (driver/liveview.py). Detectors
run on timers (node lost every interval/5, stragglers every `straggler.sweep_ms` over the
world's nodes), or on the rare heartbeat that carries flags: hangs are judged by the agents
and reach the driver only as a STALLED flag, so no sweep looks at every rank. Agents'
verified-shard reports feed the commit bookkeeping (driver/commits.py): a step's
CheckpointCommitted is appended once every rank's shard is in. Detections are observations
for the term's journal (driver/journal.py), the driver's one writer: faults never wait
behind log alerts and are never dropped, and what the live view knows (a silent node) is
recorded again whenever the log missed it.

A driver that is not the leader answers every agent call with UNAVAILABLE and the
leader's address in the `x-unbroken-leader` trailer, so agents move on to it.
`DriverService` is the one gRPC servicer of the `Driver` service; it handles the agents'
calls itself and hands the operators' (driver/operator.py) and the launchers'
(driver/launcher_api.py) to handler objects built with what they need: `Leadership` (who
leads, driver/leadership.py), this object's sessions and live view, the config.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from unbroken.common import channel, reportmac
from unbroken.common.serving import MalformedRequests
from unbroken.common.tls import TlsConfig, server_credentials
from unbroken.driver import commits as commits_mod
from unbroken.driver import detectors, loghealth, paging
from unbroken.driver import goodput as goodputlib
from unbroken.driver import state as statelib
from unbroken.driver.commits import Commits
from unbroken.driver.diagnose import DriverDiagnoseConfig
from unbroken.driver.eventlog import EventLog, NotLeaderError, new_event_id
from unbroken.driver.journal import FAULT_KINDS, Batch, Decider, Journal, JournalConfig, Pending
from unbroken.driver.launcher_api import LauncherApi
from unbroken.driver.leadership import Leadership
from unbroken.driver.liveview import Group, LiveView, LiveViewConfig, NodeSlot
from unbroken.driver.metrics import DriverMetrics
from unbroken.driver.operator import OperatorApi
from unbroken.driver.principalquota import PrincipalQuotas, QuotaBook
from unbroken.driver.rpc import abort
from unbroken.driver.security import AuthInterceptor, RoleTokens, caller
from unbroken.driver.sessions import RelayOutbox, Sessions
from unbroken.driver.straggler import Sample, StragglerConfig, StragglerWatch, sample
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev
from unbroken.recovery import lifecycle
from unbroken.recovery.lifecycle import PersistPolicy

log = structlog.get_logger(__name__)

SERVICE_NAME = "unbroken.driver.v1.Driver"
LEADER_HEALTH = "unbroken.driver.v1.Driver.leader"  # health: SERVING on the leader only
LEADER_HEALTH_NAMES = ("", LEADER_HEALTH)  # the plain check too: load balancers ask it
__all__ = ["Batch", "DriverService", "ServiceConfig", "build_server"]
CARRY_LIMIT = 100_000  # unrecorded observations kept between terms
RING = 1 << 16  # latency samples kept for p50/p99


MAX_SHARDS_PER_REPORT = 4096  # shards read from one ShardsPersisted (a node's ranks, many steps)
LIVE_VIEW_MAX_PAGE = 10_000  # LiveView page_size cap
SWEEP_CHUNK = 512  # nodes a straggler sweep samples between yields to the event loop
HELD_LOGS = 16  # late nodes logged by name per sweep (the rest: one line with the count)


@dataclass(frozen=True, kw_only=True, slots=True)
class ServiceConfig:
    """Everything the agent-facing service needs to know."""

    live: LiveViewConfig = field(default_factory=LiveViewConfig)
    straggler: StragglerConfig = field(
        default_factory=StragglerConfig, metadata={"prefix": "straggler-"}
    )
    stream_buffer: int = field(
        default=64,
        metadata={"help": "commands queued per stream before the consumer is dropped"},
    )
    journal: JournalConfig = field(
        default_factory=JournalConfig,
        metadata={"flag": None, "why": "bounds and cadences of the journal (driver/journal.py)"},
    )
    register_backlog: int = field(
        default=10_000,
        metadata={"help": "observations waiting: Register answers busy past this"},
    )
    slot_retention_s: float = field(
        default=600.0, metadata={"help": "live-view slots of nodes gone this long are freed"}
    )
    max_message_bytes: int = field(
        default=channel.MAX_MESSAGE_BYTES, metadata={"help": "largest gRPC message accepted"}
    )
    reflection: bool = field(default=False, metadata={"help": "enable gRPC reflection"})
    tls: TlsConfig = field(
        default_factory=TlsConfig,
        metadata={"flag": None, "why": "--tls-cert/--tls-key/--tls-ca"},
    )
    tokens: RoleTokens | None = field(
        default=None, metadata={"flag": None, "why": "read from --token-file ROLE=PATH"}
    )
    allow_fault_injection: bool = field(
        default=False,
        metadata={"help": "accept InjectFault from operators (drills; `unbroken up` sets it)"},
    )
    persist_roots: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "--persist-root",
            "append": True,
            "metavar": "URL",
            "help": "storage root the agents persist to; ListCheckpoints reads shards only "
            "under it (repeat; none: local paths only)",
        },
    )
    diagnose: DriverDiagnoseConfig = field(
        default_factory=DriverDiagnoseConfig,
        metadata={"flag": None, "why": "diagnosis tuning (driver/diagnose.py)"},
    )
    read_timeout_s: float = field(
        default=10.0, metadata={"help": "deadline of event-log reads behind operator calls"}
    )
    max_watchers: int = field(default=64, metadata={"help": "WatchEvents calls streaming at once"})
    quotas: PrincipalQuotas = field(
        default_factory=PrincipalQuotas,
        metadata={"flag": None, "why": "per-principal quotas (driver/principalquota.py)"},
    )
    keep_checkpoints: int = field(
        default=3,
        metadata={
            "group": "checkpoint lifecycle (recovery/lifecycle.py)",
            "help": "committed steps storage keeps (the rollback target and a restore's step too)",
        },
    )
    persist: PersistPolicy = field(
        default_factory=PersistPolicy,
        metadata={"prefix": "persist-", "group": "checkpoint lifecycle (recovery/lifecycle.py)"},
    )

    def __post_init__(self) -> None:
        if self.max_watchers < 1:
            raise ValueError(f"max_watchers must be >= 1, got {self.max_watchers}")
        if self.keep_checkpoints < 1:
            raise ValueError(
                f"keep_checkpoints must be >= 1 (--keep-checkpoints), got {self.keep_checkpoints}"
            )
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if not 1 <= self.stream_buffer <= 100_000:
            raise ValueError(f"stream_buffer must be in [1, 100000], got {self.stream_buffer}")
        if self.register_backlog < 16:
            raise ValueError(f"register_backlog must be >= 16, got {self.register_backlog}")
        if not self.slot_retention_s > 0:
            raise ValueError(f"slot_retention_s must be > 0, got {self.slot_retention_s}")
        if not 1024 <= self.max_message_bytes <= 64 * 1024 * 1024:
            raise ValueError(
                f"max_message_bytes must be in [1 KiB, 64 MiB], got {self.max_message_bytes}"
            )


class _Ring:
    """A fixed-size ring of float samples (no allocation on the hot path)."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = [0.0] * RING
        self.n = 0

    def add(self, x: float) -> None:
        self.buf[self.n & (RING - 1)] = x
        self.n += 1

    def percentiles(self) -> tuple[float, float]:
        k = min(self.n, RING)
        if k == 0:
            return 0.0, 0.0
        s = sorted(self.buf[:k])
        return s[int(0.5 * (k - 1))], s[int(0.99 * (k - 1))]

    def clear(self) -> None:
        self.n = 0


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
        # observations of an ended term, for the next one (a failure once detected stays)
        self._carry: list[Pending] = []
        # fault event id -> (fault began, detected): latency histograms once it is durable
        self._detected: dict[str, tuple[float, float]] = {}
        self.stragglers = StragglerWatch(config.straggler)
        self._closing: set[asyncio.Task[None]] = set()
        self.appended = 0
        self.delivery = _Ring()
        self.handler = _Ring()
        self.listeners: list[Callable[[ev.Event], None]] = [self._on_appended]
        self.commits = Commits()
        # the unbroken node ids of the newest torchrun round's participants, in rank order
        # (None: no round seen, or one with a participant the rendezvous could not name)
        self.rdzv_members: list[str] | None = None
        self.metrics = DriverMetrics(self._metric_values)
        self.metrics.watch(self.view, self.listeners, time.monotonic)
        self._tasks: list[asyncio.Task[None]] = []
        self.sessions = Sessions(
            self.view,
            driver_id,
            term=lambda: self.journal.state.leader_term if self.journal is not None else 0,
            scope=lambda: self.journal.state.leader_scope if self.journal is not None else "",
        )
        self._mass_since = 0.0  # monotonic time a mass silence was first held back
        self.relayed: dict[str, set[str]] = {}  # relay node id -> members attached through it
        self.relay_refused = 0  # batch entries for nodes that did not name the relay
        self.quotas = QuotaBook(config.quotas)  # registrations and relay members, per principal
        self.relay_held = 0  # sweeps that held back a relayed node whose relay was lost
        self._starved_held: dict[str, float] = {}  # late nodes held as starved, since
        self.starved_saved = 0  # ...that came back within their grace (losses avoided)
        self._told_to_register: set[str] = set()  # relayed nodes sent away (until Register)
        self.stopping = asyncio.Event()
        self.operators = OperatorApi(self.leadership, self, config)
        self.launchers = LauncherApi(self.leadership, self, self.commits, config)
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

    @property
    def decider(self) -> Any:
        """The recovery loop's decider when a job is configured (None: record as is)."""
        return self.journal.decider if self.journal is not None else None

    def lead(
        self,
        log_: EventLog,
        address: str,
        state: ev.JobState | None = None,
        *,
        decider: Decider | None = None,
        on_resync: Callable[[], None] | None = None,
    ) -> Journal:
        """Become the leader of a new term: `log_`'s journal records from now on.

        Args:
            log_: the log, fenced by this term's leadership.
            address: where agents reach this driver.
            state: `log_.replay()` (default: an empty job, for a fresh log).
            decider, on_resync: the journal's (driver/journal.py; a term's, driver/term.py).

        Returns:
            The term's journal (started; the previous term's unrecorded observations are
            queued in it).
        """
        journal = Journal(
            log_,
            state if state is not None else statelib.initial(self.job_id),
            config=self.config.journal,
            conditions=self.conditions,
            on_fenced=self._fenced,
            decider=decider,
            on_resync=on_resync,
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

    def conditions(self, state: ev.JobState) -> list[ev.Event]:
        """What the live view knows that `state` does not: nodes declared lost (the level
        check of driver/journal.py). Also frees the slots of nodes gone for good."""
        out = []
        now = time.monotonic()
        retention = self.config.slot_retention_s
        for slot in list(self.view.nodes.values()):
            if slot.alive or not slot.epoch:
                continue
            rec = state.nodes.get(slot.node_id)
            if (
                rec is not None
                and rec.epoch == slot.epoch
                and rec.state in (ev.NODE_STATE_ACTIVE, ev.NODE_STATE_SPARE)
            ):
                out.append(detectors.node_lost(slot, now, "heartbeat timeout"))
            elif now - slot.last_seen > retention and slot.outbox is None:
                del self.view.nodes[slot.node_id]  # its history stays in the log
        return out

    async def _not_leader(self, context: grpc.aio.ServicerContext) -> NoReturn:
        where = self.leader_address or "unknown yet"
        await abort(
            context,
            grpc.StatusCode.UNAVAILABLE,
            f"driver {self.driver_id} is not the leader; the leader is at {where}",
            trailing_metadata=((channel.LEADER_KEY, self.leader_address),),
        )

    # ------------------------------------------------------------ background loops
    def start(self) -> None:
        """Start the detector sweeps (call inside the event loop)."""
        self._tasks.append(asyncio.create_task(self._lost_loop()))
        st = self.config.straggler
        if st.policy != "off":
            period = st.sweep_ms / 1000.0
            self._tasks.append(
                asyncio.create_task(self._loop("straggler", self._sweep_stragglers, period))
            )

    async def close(self) -> None:
        """Stop the loops and end every session."""
        self.stopping.set()
        await self.operators.close()
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

    async def _loop(self, name: str, body: Callable[[], Awaitable[None]], period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                if self.leader:
                    await body()
            except Exception:
                log.exception("detector sweep failed; continuing", detector=name)

    async def _lost_loop(self) -> None:
        """The node-lost sweep, every interval/5, and the event-loop stall watchdog.

        The lateness of this loop's own wake-ups is the driver's stall; the largest one
        within the last timeout window is passed to the detector as slack, so a driver that
        stalled (GC, a registration storm, a slow disk) does not blame its nodes.
        """
        period = self.config.live.heartbeat_interval_ms / 5000.0
        window = int(self.config.live.timeout_s / period) + 2
        lags: collections.deque[float] = collections.deque([0.0], maxlen=window)
        due = time.monotonic() + period
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            lag = now - due
            lags.append(lag)
            if lag > 0.1:
                log.warning("driver event loop stalled", stall_ms=round(lag * 1000))
            due = now + period
            try:
                if self.leader:
                    self._sweep_lost(now, max(lags))
            except Exception:
                log.exception("node-lost sweep failed; continuing")

    def _sweep_lost(self, now: float, slack_s: float) -> None:
        held: list[NodeSlot] = []
        lost = detectors.silent(self.view, now, slack_s, held)
        self._note_held(held, now)
        if lost and self.relayed:
            kept = [x for x in lost if not self._held_for_relay(x[0], now)]
            self.relay_held += len(lost) - len(kept)
            lost = kept
        if lost:  # an evicted node's agent exits: its silence is its departure
            left = [slot for slot, _ in lost if slot.leaving]
            for slot in left:
                self.view.mark_lost(slot)
                log.info("evicted node's agent left", node=slot.node_id)
            if left:
                lost = [x for x in lost if not x[0].leaving]
        if not lost:
            self._mass_since = 0.0
            return
        hold_s = self.config.live.mass_loss_hold_ms / 1000.0
        if len(lost) > detectors.mass_limit(self.view):
            if not self._mass_since:
                self._mass_since = now
                log.error(
                    "mass silence: holding NodeLost back (driver overloaded or partitioned?)",
                    silent=len(lost),
                    hold_ms=hold_s * 1000,
                )
            if now - self._mass_since <= hold_s:
                return
        self._mass_since = 0.0
        for e in detectors.declare(self.view, lost, now):
            self.emit(e, now - e.node_lost.silent_ms / 1000.0)
            log.warning(
                "node lost", node=e.node_lost.node_id, silent_ms=round(e.node_lost.silent_ms, 1)
            )

    def _note_held(self, held: list[NodeSlot], now: float) -> None:
        """Log a late node held as starved once, and once more when it came back (a false
        loss avoided) or was lost after all: each of the first HELD_LOGS of a sweep by
        name, the rest in one line (a whole relay group late together is 64 nodes, a
        stalled simulator or network thousands: a line each stalled the loop seconds)."""
        fresh = 0
        for slot in held:
            if slot.node_id not in self._starved_held:
                self._starved_held[slot.node_id] = slot.last_seen
                fresh += 1
                if fresh > HELD_LOGS:
                    continue
                hb = slot.hb
                log.warning(
                    "node late while starved: held",
                    node=slot.node_id,
                    silent_ms=round((now - slot.last_seen) * 1000),
                    loop_lag_ms=round(hb.loop_lag_ms),
                    late_ms=round(hb.late_ms),
                    cpu_pressure_pct=hb.cpu_pressure_pct,
                    runnable_per_cpu=round(hb.runnable_per_cpu, 2),
                )
        if fresh > HELD_LOGS:
            log.warning("more nodes late while starved: held", nodes=fresh - HELD_LOGS)
        ids = {s.node_id for s in held}
        if len(ids) == len(self._starved_held):
            return  # every one held is still held
        done = {"held node came back": 0, "held node lost after its grace": 0}
        for node_id, since in list(self._starved_held.items()):
            if node_id in ids:
                continue
            del self._starved_held[node_id]
            now_slot = self.view.nodes.get(node_id)
            back = now_slot is not None and now_slot.alive and now_slot.last_seen > since
            if back:
                self.starved_saved += 1
            what = "held node came back" if back else "held node lost after its grace"
            done[what] += 1
            if done[what] <= HELD_LOGS:
                log.info(what, node=node_id)
        for what, n in done.items():
            if n > HELD_LOGS:
                log.info(what.replace("held node", "more held nodes"), nodes=n - HELD_LOGS)

    def _held_for_relay(self, slot: NodeSlot, now: float) -> bool:
        """Whether `slot`'s silence began with its relay's loss (and is still young enough
        to wait for the node to come to us directly)."""
        if not slot.relay or not isinstance(slot.outbox, RelayOutbox | None):
            return False
        relay = self.view.nodes.get(slot.relay)
        if relay is None:
            return False
        live = self.view.config
        down = not relay.connected or now - relay.last_seen > 2 * live.heartbeat_interval_ms / 1e3
        return down and now - slot.last_seen <= live.timeout_s + live.relay_hold_ms / 1e3

    async def _sweep_stragglers(self) -> None:
        """StragglerSuspected for a world node persistently slower (driver/straggler.py).

        O(world ranks) every `sweep_ms` (2 s), only while the job trains. The sampling
        yields to the event loop every `SWEEP_CHUNK` nodes, so at 10,000 nodes heartbeats and
        operator calls wait for a chunk, not the whole sweep.
        """
        journal = self.journal
        if journal is None or journal.state.phase != ev.PHASE_RUNNING:
            self.stragglers.tracks.clear()  # a recovery restarts the workers: new baselines
            return
        samples: list[Sample] = []
        for i, node_id in enumerate(list(journal.state.world.node_ids)):
            if i and i % SWEEP_CHUNK == 0:
                await asyncio.sleep(0)
                if self.journal is not journal or journal.state.phase != ev.PHASE_RUNNING:
                    return  # the term or the world changed under the sweep: next period
            slot = self.view.nodes.get(node_id)
            if slot is not None and slot.alive:
                got = sample(node_id, slot.hb)
                if got is not None:
                    samples.append(got)
        for e in self.stragglers.sweep(samples):
            self.emit(e)
            s = e.straggler_suspected
            log.warning(
                "straggler suspected",
                node=s.node_id,
                slowdown=round(s.slowdown, 3),
                z=round(s.z, 1),
                policy=s.policy,
            )

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

    # ------------------------------------------------------------ RPCs
    async def Register(
        self, request: dpb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RegisterResponse:
        if not self.leader:
            await self._not_leader(context)
        problem = detectors.validate_register(request)
        if problem:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        who = caller()
        if not who.is_node(request.node_id):
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{who} may not register as node {request.node_id!r}: a node registers only "
                "under its own id (the node:<id> of its certificate or named token)",
            )
        journal = self.journal
        if journal is not None and journal.pending() >= self.config.register_backlog:
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "driver busy writing events; retry with backoff",
            )
        now = time.monotonic()
        reason, event = detectors.admit(self.view, request, now)
        if reason:
            if event is None:
                await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            assert event is not None  # abort raised otherwise
            self.emit(event)
            log.warning("registration refused", node=request.node_id, reason=reason)
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, reason)
        relay = ""
        for k, v in context.invocation_metadata() or ():
            if k == channel.RELAY_KEY:
                relay = str(v)[:128]
        relay = relay if relay != request.node_id else ""
        why = self._over_quota(
            str(who) if who.identified else "", request.node_id, relay, event is not None, now
        )
        if why:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        slot = self.view.slot(request.node_id)
        if slot.relay and relay != slot.relay:
            # a relayed node coming to us directly (its relay is gone): it has the session
            # grace to open its own stream, rather than its relay's silence against it
            self.view.mark_registered(slot, now)
        slot.relay = relay
        self._told_to_register.discard(request.node_id)
        if slot.epoch != request.epoch or not slot.report_key:
            slot.report_key = secrets.token_bytes(reportmac.KEY_BYTES)  # one per epoch
        if event is not None:
            if slot.epoch != request.epoch:
                slot.reported_exits.clear()
                slot.hung_at.clear()
                slot.last_step.clear()
                slot.hb = dpb.Heartbeat()
            slot.epoch = request.epoch
            slot.leaving = False
            self.emit(event)
            log.info(
                "node registered",
                node=request.node_id,
                epoch=request.epoch,
                workers=request.num_workers,
            )
        # what it registered, also when it only reconnects (no new event): a leader that took
        # over built its view from the log, which keeps no --replica-listen; without it the
        # world's buddy ring was empty after every failover and the buddies' copies untrusted
        slot.info = request
        slot.peer_host = peer_host(context.peer())
        if not self.view.tracked(slot):
            self.view.mark_registered(slot, now)
        return dpb.RegisterResponse(
            driver_id=self.driver_id,
            job_id=self.job_id,
            heartbeat_interval_ms=self.config.live.heartbeat_interval_ms,
            miss_limit=self.config.live.miss_limit,
            leader_term=self.journal.state.leader_term if self.journal is not None else 0,
            term_scope=self.journal.state.leader_scope if self.journal is not None else "",
            report_key=slot.report_key,
        )

    def _over_quota(self, who: str, node_id: str, relay: str, new: bool, now: float) -> str:
        """Why `who`'s registration of `node_id` (through `relay`; `new`: a new epoch) is
        past a per-principal quota ("": it is not; `who` "": no identified principal)."""

        def still(n: str) -> bool:
            m = self.view.nodes.get(n)
            return m is not None and m.relay == relay and m.alive

        why = self.quotas.relay_member(node_id, relay, still)
        if not why and new and who:
            why = self.quotas.registration(who, now)
        if why:
            log.warning("registration over quota", node=node_id, reason=why)
        return why

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        if not self.leader:
            await self._not_leader(context)
        node_id, epoch = "", 0
        for k, v in context.invocation_metadata() or ():
            if k == channel.NODE_KEY:
                node_id = str(v)
            elif k == channel.EPOCH_KEY:
                epoch = int(v) if str(v).isdigit() else -1
        who = caller()
        if not who.is_node(node_id):
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{who} may not open a session as node {node_id[:128]!r}",
            )
        slot = self.view.nodes.get(node_id)
        if slot is None or slot.epoch != epoch or not slot.alive:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id[:128]!r} epoch {epoch} is not registered with this driver "
                "(or was declared lost); call Register first",
            )
        assert slot is not None
        slot.session += 1
        mine = slot.session
        slot.connected = True
        self.view.mark_alive(slot, time.monotonic())
        outbox: asyncio.Queue[dpb.DriverMessage] = asyncio.Queue(self.config.stream_buffer)
        slot.outbox = outbox
        ending = self.sessions.opened(node_id)
        pump = asyncio.create_task(self.sessions.pump(outbox, context, ending))
        reader = asyncio.create_task(self._read_loop(slot, context))
        stop = asyncio.create_task(ending.event.wait())
        try:
            await asyncio.wait({reader, stop}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()  # re-raise an abort or error of the read loop
            elif ending.status is not None:
                # a write cancelled mid-flight would hold back the status: let it finish
                if ending.writing:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(pump), 2.0)
                pump.cancel()
                code, details, trailing = ending.status
                await abort(context, code, details, trailing_metadata=trailing)
        finally:
            for t in (pump, reader, stop):
                t.cancel()
            if slot.session == mine:
                slot.connected = False
                slot.outbox = None
                self.sessions.closed(node_id, ending)
                self._detach_members(node_id)

    async def _read_loop(self, slot: NodeSlot, context: grpc.aio.ServicerContext) -> None:
        read = context.read
        beat = self.view.beat
        mono = time.monotonic
        mono_ns = time.monotonic_ns
        perf = time.perf_counter_ns
        delivery, handler = self.delivery, self.handler
        eof = grpc.aio.EOF
        while True:
            msg = await read()
            if msg is eof:
                return
            t0 = perf()
            if msg.WhichOneof("kind") == "heartbeat":
                hb = msg.heartbeat
                if not slot.alive:
                    await abort(
                        context,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"node {slot.node_id} was declared lost; call Register again",
                    )
                beat(slot, hb, mono())
                if hb.flags:
                    for e in detectors.flagged(slot, hb):
                        self.emit(e)
                        if e.HasField("hang_suspected"):
                            h = e.hang_suspected
                            log.warning(
                                "hang suspected",
                                node=h.node_id,
                                ranks=list(h.hung_ranks),
                                step=h.stuck_at_step,
                                silent_ms=round(h.silent_ms),
                                threshold_ms=round(h.threshold_ms),
                                phase=h.phase,
                            )
                if hb.sent_mono_ns:
                    delivery.add((mono_ns() - hb.sent_mono_ns) / 1e6)
                handler.add((perf() - t0) / 1e3)
            elif msg.WhichOneof("kind") == "relay_batch":
                batch = msg.relay_batch
                if batch.HasField("own"):
                    if not slot.alive:
                        await abort(
                            context,
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"node {slot.node_id} was declared lost; call Register again",
                        )
                    own = batch.own
                    beat(slot, own, mono())
                    if own.flags:
                        for e in detectors.flagged(slot, own):
                            self.emit(e)
                self._relay_batch(slot, batch, t0)
            elif msg.WhichOneof("kind") == "relayed":
                up = msg.relayed
                member = self._member(slot, up.node_id, up.epoch)
                if member is not None:
                    self._on_message(member, up.message, relayed=True)
            else:
                self._on_message(slot, msg)

    def _on_message(self, slot: NodeSlot, msg: dpb.AgentMessage, *, relayed: bool = False) -> None:
        """A node's message other than a heartbeat (direct or `relayed`: then a shard
        report counts only when the node signed it, common/reportmac.py)."""
        kind = msg.WhichOneof("kind")
        if kind == "signed_report":
            shards = reportmac.verify(slot.report_key, slot.epoch, msg.signed_report)
            if shards is None:
                self.relay_refused += relayed
                log.warning("shard report with a bad signature refused", node=slot.node_id)
                return
            for shard in shards.shards[:MAX_SHARDS_PER_REPORT]:
                self._on_shard(slot.node_id, shard)
        elif relayed and kind in ("shard_persisted", "shards_persisted"):
            self.relay_refused += 1  # a relay may not speak for a member's checkpoints
            log.warning("unsigned shard report through a relay refused", node=slot.node_id)
        elif kind == "shard_persisted":
            self._on_shard(slot.node_id, msg.shard_persisted)
        elif kind == "shards_persisted":
            for shard in msg.shards_persisted.shards[:MAX_SHARDS_PER_REPORT]:
                self._on_shard(slot.node_id, shard)
        elif kind in ("check_result", "ack", "self_check_report"):
            self._on_reply(slot, msg)
        else:
            log.warning("unexpected message refused", node=slot.node_id, kind=kind)

    # ------------------------------------------------------------ relays
    def _member(self, relay: NodeSlot, node_id: str, epoch: int) -> NodeSlot | None:
        """`node_id`'s slot when `relay` may speak for it (its own registration named this
        relay, same epoch, not declared lost), attached to the relay's stream; else None."""
        m = self.view.nodes.get(node_id)
        if m is not None and m.relay == relay.node_id and not m.alive:
            self._send_away(relay, node_id)  # declared lost: it must register again
            return None
        if m is None or m.relay != relay.node_id or (epoch and m.epoch != epoch):
            self.relay_refused += 1
            return None
        if m.outbox is None and isinstance(relay.outbox, asyncio.Queue):
            m.outbox = RelayOutbox(relay.node_id, relay.outbox, node_id)
            m.connected = True
            self.relayed.setdefault(relay.node_id, set()).add(node_id)
            self.view.mark_alive(m, time.monotonic())
        elif not isinstance(m.outbox, RelayOutbox):
            self.relay_refused += 1  # it holds its own session with us now
            return None
        return m

    def _relay_batch(self, relay: NodeSlot, batch: dpb.RelayBatch, t0: int) -> None:
        """One relay's batch: each member entry costs what a direct heartbeat does, minus
        the gRPC message; the members a vouching relay does not name cost nothing each
        (their group's one timestamp moves)."""
        now = time.monotonic()
        view = self.view
        nodes = view.nodes
        rid = relay.node_id
        delivery, mono_ns = self.delivery, time.monotonic_ns
        n = 0
        group = view.groups.get(rid)
        vouching = batch.group_alive
        if vouching:
            group = view.vouched(rid, now)  # one heartbeat of each member already in it
            n += len(group.members)
            if group.parked:
                self._vouch_parked(relay, group, now)
        for b in batch.beats:
            m = nodes.get(b.node_id)
            if m is None or m.relay != rid or m.epoch != b.epoch or not m.alive or m.outbox is None:
                m = self._member(relay, b.node_id, b.epoch)
                if m is None:
                    continue
            hb = b.heartbeat
            m.hb = hb
            if group is None:
                m.heartbeats += 1
                view.refresh(m, now)
                n += 1
            elif not (vouching and m.group is group):  # else its vouch counted it
                m.heartbeats += 1
                view.join(m, group, now)
                n += 1
            else:
                view.join(m, group, now)
            if hb.flags:
                for e in detectors.flagged(m, hb):
                    self.emit(e)
            if hb.sent_mono_ns:
                delivery.add((mono_ns() - hb.sent_mono_ns) / 1e6)
        for node_id in batch.alive:
            m = nodes.get(node_id)
            if m is None or m.relay != rid or not m.alive or m.outbox is None:
                m = self._member(relay, node_id, 0)
                if m is None:
                    continue
            if group is None:
                m.heartbeats += 1
                view.refresh(m, now)
                n += 1
            elif not (vouching and m.group is group):
                m.heartbeats += 1
                view.join(m, group, now)
                n += 1
        for s in batch.late:
            m = nodes.get(s.node_id)
            if m is None or m.relay != rid or m.epoch != s.epoch or not m.alive:
                self.relay_refused += m is None or m.relay != rid or m.epoch != s.epoch
                continue
            view.late(m, now - max(0.0, s.silent_ms) / 1000.0)
        for s in batch.silent:
            m = nodes.get(s.node_id)
            if m is None or m.relay != rid or m.epoch != s.epoch or not m.alive:
                self.relay_refused += m is None or m.relay != rid or m.epoch != s.epoch
                continue
            for e in detectors.declare(self.view, [(m, "silent at its relay")], now):
                e.node_lost.silent_ms = s.silent_ms
                self.emit(e, now - s.silent_ms / 1000.0)
                log.warning("node lost (its relay)", node=m.node_id, relay=rid)
        if n:
            self.handler.add((time.perf_counter_ns() - t0) / 1e3 / n)

    def _vouch_parked(self, relay: NodeSlot, group: Group, now: float) -> None:
        """The relay vouches again after its group went quiet: its members the sweep took
        out rejoin it; one declared lost meanwhile is told to register again (the relay
        would not name it)."""
        for node_id, m in group.parked.items():
            if m.alive and m.relay == relay.node_id and m.group is None and m.outbox is not None:
                self.view.join(m, group, now)
            elif not m.alive and m.relay == relay.node_id:
                self._send_away(relay, node_id)
        group.parked.clear()

    def _send_away(self, relay: NodeSlot, node_id: str) -> None:
        """Tell `relay` to end `node_id`'s stream: the driver declared it lost, and a
        member learns that only this way (it registers again)."""
        if node_id in self._told_to_register or not isinstance(relay.outbox, asyncio.Queue):
            return
        self._told_to_register.add(node_id)
        end = f"node {node_id} was declared lost; call Register again"
        with contextlib.suppress(asyncio.QueueFull):
            relay.outbox.put_nowait(
                dpb.DriverMessage(relayed=dpb.RelayedDown(node_id=node_id, end=end))
            )

    def _detach_members(self, relay_id: str) -> None:
        """The relay's session ended: its members have no command path until they come
        back (through it, or to us directly); their silence is held back meanwhile."""
        self.view.drop_group(relay_id)
        for node_id in self.relayed.pop(relay_id, ()):
            m = self.view.nodes.get(node_id)
            if m is not None and isinstance(m.outbox, RelayOutbox) and m.outbox.relay == relay_id:
                m.outbox = None
                m.connected = False

    def _on_shard(self, node_id: str, msg: dpb.ShardPersisted) -> None:
        """One verified shard: checked to be the node's own, then counted toward a commit."""
        problem = self._not_its_shard(node_id, msg)
        if problem:
            self.commits.ignored += 1
            log.warning("shard report refused", node=node_id, problem=problem)
            return
        commit = self.commits.record(node_id, msg)
        if commit is not None:
            self.emit(commit)

    def _not_its_shard(self, node_id: str, msg: dpb.ShardPersisted) -> str:
        """Why `node_id` may not report this shard ("" when it may).

        A node reports only its own ranks of the current world. In a world the driver
        laid out (or a launcher registered): ranks [i * workers_per_node, (i + 1) *
        workers_per_node) of the i-th node, and a node outside it (a spare, a stranger)
        reports nothing. In a torchrun world: the i-th participant of the newest
        rendezvous round holds the i-th equal slice of the ranks, and a node outside the
        round reports nothing. Only when neither is known (a launcher that told us
        nothing) does a rank belong to the first node that reported it at that size.
        """
        journal = self.journal
        world = journal.state.world if journal is not None else None
        if world is not None and world.node_ids and world.workers_per_node:
            size = len(world.node_ids) * world.workers_per_node
            if msg.world_size != size:
                return f"world size {msg.world_size} is not the current world's {size}"
            return commits_mod.rank_slice_problem(
                node_id, list(world.node_ids), size, msg.rank, "the current world"
            )
        if self.rdzv_members is not None:
            return commits_mod.rank_slice_problem(
                node_id,
                self.rdzv_members,
                msg.world_size,
                msg.rank,
                "the newest rendezvous round",
            )
        return self.commits.claim(node_id, msg.world_size, msg.rank, self._can_report)

    def _can_report(self, node_id: str) -> bool:
        """Whether `node_id` can still report its ranks' shards: alive, not leaving, and
        its session open (a SIGKILLed agent's stream closes at once, long before its
        silence reaches the miss limit; its replacement's reports must count meanwhile)."""
        slot = self.view.nodes.get(node_id)
        return slot is not None and slot.alive and slot.connected and not slot.leaving

    def _on_appended(self, event: ev.Event) -> None:
        """Bookkeeping that follows the log: a rollback reopens the steps after it; a
        commit or a rollback updates what storage keeps."""
        kind = event.WhichOneof("payload")
        if kind == "rollback":
            self.commits.rollback(event.rollback.to_step)
        if kind == "rendezvous_round" and not event.rendezvous_round.closed:
            self.rdzv_members = commits_mod.round_members(list(event.rendezvous_round.participants))
        if kind in ("checkpoint_committed", "rollback", "step_verified"):
            self._send_retention(event)

    def retention(self, event: ev.Event | None = None) -> dpb.Retention | None:
        """What storage keeps, from the log (None before the first commit).

        The newest `keep_checkpoints` committed steps, the rollback target (pending or
        last), the newest verified commit (docs/sdc.md) and the step the open incident
        restores; `below` is the newest commit.
        A commit above the newest step the live world reached (by the lower median of
        its nodes' heartbeats) is not believed: storage never loses a step the workers
        could still need for a commit nobody's workers made.
        """
        journal = self.journal
        if journal is None:
            return None
        st = journal.state
        committed = [c.step for c in st.checkpoints]
        if event is not None and event.WhichOneof("payload") == "checkpoint_committed":
            committed.append(event.checkpoint_committed.step)
        reached = self.reached_step()
        if reached is not None:
            beyond = [c for c in committed if c > reached]
            if beyond:
                log.warning(
                    "retention ignores commits beyond the live world's step",
                    reached=reached,
                    commits=beyond[-8:],
                )
            committed = [c for c in committed if c <= reached]
        if not committed:
            return None
        protect = [st.restore_step, st.last_rollback_to]
        # the newest verified commit: where a rollback after silent data corruption goes
        verified = [c.step for c in st.checkpoints if c.verified and c.step in committed]
        if verified:
            protect.append(max(verified))
        if st.HasField("rollback_to"):
            protect.append(st.rollback_to)
        keep = lifecycle.retained(
            committed, self.config.keep_checkpoints, (p for p in protect if p)
        )
        return dpb.Retention(keep_steps=sorted(keep), below=max(committed))

    def reached_step(self) -> int | None:
        """The newest step the live world reached (None when no node of it said): the
        lower median over its alive nodes (the current world's when there is one) of each
        node's step (its workers' in its newest heartbeat, or higher ones seen before)."""
        journal = self.journal
        world = journal.state.world if journal is not None else None
        ids = list(world.node_ids) if world is not None and world.node_ids else None
        steps = []
        for node_id, slot in self.view.nodes.items():
            if (ids is None or node_id in ids) and slot.alive:
                seen = [w.step for w in slot.hb.workers] + list(slot.last_step.values())
                step = max(seen, default=0)
                if step > 0:  # 0: its workers report no steps (nothing known)
                    steps.append(step)
        return commits_mod.reached_step(steps)

    def _send_retention(self, event: ev.Event) -> None:
        """Tell one connected agent per storage root to apply the retention."""
        r = self.retention(event)
        if r is None:
            return
        done: set[str] = set()
        for node_id, url in list(self.commits.url_of.items()):
            if url in done:
                continue
            with contextlib.suppress(KeyError):  # not connected now: another node, or later
                self.send(node_id, dpb.DriverMessage(retention=r))
                done.add(url)

    def storage_mtbf_s(self) -> float:
        """The MTBF of the failures only storage could serve (the job's incidents whose
        restore read storage), with the policy's prior."""
        journal = self.journal
        if journal is None:
            return self.config.persist.prior_mtbf_s
        g = journal.state.goodput
        wall = max(0.0, (time.time_ns() - g.started_ns) / 1e9) if g.started_ns else 0.0
        return lifecycle.mtbf_estimate_s(
            wall, g.storage_incidents, self.config.persist.prior_mtbf_s
        )

    def persist_every_s(self) -> float:
        """The persistence interval for the next StartWorkers (Young/Daly, bounded): the
        measured cost of persisting a checkpoint (folded from the commits) against the
        MTBF of the failures the memory tier (rings, buddies) could not serve
        (recovery/lifecycle.py)."""
        journal = self.journal
        cost = journal.state.persist_cost_s if journal is not None else 0.0
        if cost <= 0:
            return 0.0  # nothing measured yet: the agents' own --persist-every-s
        return lifecycle.persist_interval_at_s(cost, self.storage_mtbf_s(), self.config.persist)

    def persistence(self) -> tuple[float, float, float]:
        """(the interval sent now or 0, the cost of persisting a checkpoint, the storage MTBF)."""
        cost = self.journal.state.persist_cost_s if self.journal is not None else 0.0
        return self.persist_every_s(), cost, self.storage_mtbf_s()

    def _on_reply(self, slot: NodeSlot, msg: dpb.AgentMessage) -> None:
        kind = msg.WhichOneof("kind")
        cid = msg.check_result.command_id if kind == "check_result" else msg.ack.command_id
        if kind == "self_check_report":  # recorded as SelfCheckReported (driver/operator.py)
            cid = self.operators.on_self_check(slot.node_id, msg.self_check_report)
            if not cid:
                return
        if self.sessions.reply(cid, msg):
            return
        # Fire-and-forget commands (retention, one per commit) are acked too: a success is
        # expected and not worth a line per commit; a failure is the only news they bring.
        if kind == "ack" and msg.ack.ok:
            log.debug("ack", node=slot.node_id, command_id=cid[:64])
        elif kind == "ack":
            log.warning(
                "command failed", node=slot.node_id, command_id=cid[:64],
                detail=msg.ack.detail[:500],
            )  # fmt: skip
        else:
            log.info("unsolicited reply", node=slot.node_id, kind=kind, command_id=cid[:64])

    async def LiveView(
        self, request: dpb.LiveViewRequest, context: grpc.aio.ServicerContext
    ) -> dpb.LiveViewResponse:
        out = dpb.LiveViewResponse(driver_id=self.driver_id, leader=self.leader, stats=self.stats())
        if request.page_size > LIVE_VIEW_MAX_PAGE:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"page_size {request.page_size} is over {LIVE_VIEW_MAX_PAGE}",
            )
        if not request.summary_only:
            limit = paging.page_size(request.page_size)
            nodes = self.view.snapshot(after=request.after, limit=limit + 1)
            page, out.next_after = paging.bounded(nodes, limit, more=False)
            out.nodes.extend(page)
        return out

    # ------------------------------------------------------------ operators, launchers
    async def GetStatus(
        self, request: dpb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> dpb.GetStatusResponse:
        return await self.operators.GetStatus(request, context)

    async def ListNodes(
        self, request: dpb.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ListNodesResponse:
        return await self.operators.ListNodes(request, context)

    async def WatchEvents(
        self, request: dpb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self.operators.WatchEvents(request, context)

    async def Diagnose(
        self, request: dpb.DiagnoseRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self.operators.Diagnose(request, context)

    async def Evict(
        self, request: dpb.EvictRequest, context: grpc.aio.ServicerContext
    ) -> dpb.EvictResponse:
        return await self.operators.Evict(request, context)

    async def ClearNode(
        self, request: dpb.ClearNodeRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ClearNodeResponse:
        return await self.operators.ClearNode(request, context)

    async def RunSelfCheck(
        self, request: dpb.RunSelfCheckRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RunSelfCheckResponse:
        return await self.operators.RunSelfCheck(request, context)

    async def InjectFault(
        self, request: dpb.InjectFaultRequest, context: grpc.aio.ServicerContext
    ) -> dpb.InjectFaultResponse:
        return await self.operators.InjectFault(request, context)

    async def Resume(
        self, request: dpb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ResumeResponse:
        return await self.operators.Resume(request, context)

    async def RegisterJob(
        self, request: dpb.RegisterJobRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RegisterJobResponse:
        return await self.launchers.RegisterJob(request, context)

    async def ReportFailure(
        self, request: dpb.ReportFailureRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ReportFailureResponse:
        return await self.launchers.ReportFailure(request, context)

    async def ListCheckpoints(
        self, request: dpb.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ListCheckpointsResponse:
        return await self.launchers.ListCheckpoints(request, context)

    async def RequestCheckpoint(
        self, request: dpb.RequestCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RequestCheckpointResponse:
        return await self.launchers.RequestCheckpoint(request, context)

    # ------------------------------------------------------------ commands
    def send(self, node_id: str, msg: dpb.DriverMessage) -> str:
        """Queue a command for `node_id`'s agent (`Sessions.send`)."""
        return self.sessions.send(node_id, msg)

    async def request(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> dpb.AgentMessage:
        """Send a command and wait for its reply (`Sessions.request`)."""
        return await self.sessions.request(node_id, msg, timeout_s)

    @property
    def dropped_commands(self) -> int:
        return self.sessions.dropped_commands

    # ------------------------------------------------------------ stats
    def stats(self) -> dpb.LiveStats:
        d50, d99 = self.delivery.percentiles()
        h50, h99 = self.handler.percentiles()
        alive = self.view.alive_count()
        j = self.journal
        return dpb.LiveStats(
            heartbeats=sum(s.heartbeats for s in self.view.nodes.values()),
            nodes_alive=alive,
            nodes_lost=len(self.view.nodes) - alive,
            events_appended=self.appended,
            delivery_p50_ms=d50,
            delivery_p99_ms=d99,
            handler_p50_us=h50,
            handler_p99_us=h99,
            samples=self.delivery.n,
            alerts_coalesced=j.stats.alerts_coalesced if j else 0,
            alerts_shed=j.stats.alerts_shed if j else 0,
            faults_pending=j.faults_pending() if j else 0,
        )

    def reset_samples(self) -> None:
        """Forget latency samples (benchmarks call this between load levels)."""
        self.delivery.clear()
        self.handler.clear()

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
            **({"phase": j.state.phase} if j else {}),
            "newest_commit_age_s": self.newest_commit()[1],
            "event_log": loghealth.summary(j),
        }

    def newest_commit(self) -> tuple[int, float]:
        """(the newest committed step, seconds since its commit event; -1 when none)."""
        j = self.journal
        if j is None or not j.state.checkpoints:
            return 0, -1.0
        c = j.state.checkpoints[-1]
        wall = c.wall_time_unix_ns
        return c.step, max(0.0, (time.time_ns() - wall) / 1e9) if wall else -1.0

    def persist_failing(self) -> list[dpb.PersistFailure]:
        """The alive nodes whose persister fails now (from their newest heartbeat)."""
        return [
            dpb.PersistFailure(
                node_id=s.node_id,
                error=s.hb.persist_error,
                failures=s.hb.persist_failures,
                failing_s=s.hb.persist_failing_s,
            )
            for s in list(self.view.nodes.values())
            if s.alive and s.hb.persist_failures
        ]


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:10.0.0.5:4242`, `ipv6:[::1]:4242`); "" else."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return ""


def _kind(item: Any) -> str:
    return str(item.WhichOneof("payload")) if isinstance(item, ev.Event) else type(item).__name__


async def build_server(
    service: DriverService, listen: str
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A started grpc.aio server carrying `service`, health and (optionally) reflection.

    Returns:
        The server, the bound port (listen on port 0 to pick a free one) and the health
        servicer (set NOT_SERVING when stepping down).
    """
    cfg = service.config
    # without any credential every caller is `*:anonymous` (the CALLER default): no
    # authentication; main.py refuses that beyond loopback unless --insecure. Malformed
    # request bytes get INVALID_ARGUMENT, checked after authentication (innermost).
    interceptors: list[grpc.aio.ServerInterceptor] = (
        [AuthInterceptor(cfg.tokens, tls=cfg.tls.enabled)] if cfg.tokens or cfg.tls.enabled else []
    )
    interceptors.append(MalformedRequests())
    options = [
        *channel.SERVER_OPTIONS,
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    dgrpc.add_DriverServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if cfg.reflection:
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    if cfg.tls.enabled:
        port = server.add_secure_port(listen, server_credentials(cfg.tls))
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise ValueError(f"could not bind the driver's gRPC port {listen!r}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await _set_leader_health(health_servicer, service.leader)
    service._tasks.append(asyncio.create_task(_leader_health(service, health_servicer)))
    return server, port, health_servicer


async def _set_leader_health(servicer: health.aio.HealthServicer, leading: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if leading
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in LEADER_HEALTH_NAMES:
        await servicer.set(name, status)


async def _leader_health(service: DriverService, servicer: health.aio.HealthServicer) -> None:
    """The plain health check ("", what a load balancer's or Kubernetes' gRPC probe asks by
    default) and `LEADER_HEALTH` are SERVING on the leader only: the check finds the driver
    that answers operator and launcher calls. Every driver serves agents: SERVICE_NAME is
    SERVING on standbys too (an agent may stream to any driver)."""
    leading = service.leader
    while True:
        if service.leader != leading:
            leading = service.leader
            await _set_leader_health(servicer, leading)
        await asyncio.sleep(0.2)
