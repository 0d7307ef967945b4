"""The driver's gRPC service for agents: registration, the heartbeat stream, commands.

The heartbeat handler is the hot path of the whole system (2,000 nodes x 10/s): per
message it takes one monotonic timestamp, stores the message by reference in the node's
slot and moves the node to the end of the deadline order (driver/liveview.py). Detectors
run on timers (node lost every interval/5, hangs every `hang_sweep_ms`), or on the rare
heartbeat that carries flags. Agents' verified-shard reports feed the commit bookkeeping
(driver/commits.py): a step's CheckpointCommitted is appended once every rank's shard is
in. Events go through one bounded queue to a single writer task that appends them to the
event log, so the log sees them in detection order and a slow store never blocks the
handler.

A driver that is not the leader answers every agent call with UNAVAILABLE and the
leader's address in the `x-unbroken-leader` trailer, so agents move on to it.
The operator RPCs (status, nodes, events, diagnose, evict) live in driver/operator.py
as a mixin of the same servicer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from unbroken.driver import detectors
from unbroken.driver.commits import Commits
from unbroken.driver.diagnose import DriverDiagnoseConfig
from unbroken.driver.eventlog import EventLog, EventLogError, NotLeaderError
from unbroken.driver.liveview import LiveView, LiveViewConfig, NodeSlot
from unbroken.driver.metrics import DriverMetrics
from unbroken.driver.operator import OperatorApi
from unbroken.driver.security import TlsConfig, TokenInterceptor, server_credentials
from unbroken.proto import channel
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

SERVICE_NAME = "unbroken.driver.v1.Driver"
#: What the recovery loop's decider returns: events to append in order, then a callback.
Batch = tuple[list[ev.Event], Callable[[], None] | None]
RING = 1 << 16  # latency samples kept for p50/p99


@dataclass(kw_only=True, slots=True)
class ServiceConfig:
    """Everything the agent-facing service needs to know."""

    live: LiveViewConfig = field(default_factory=LiveViewConfig)
    detectors: detectors.DetectorConfig = field(default_factory=detectors.DetectorConfig)
    stream_buffer: int = 64  # commands queued per stream before the consumer is dropped
    event_queue: int = 10_000  # detected events waiting for the log
    max_message_bytes: int = channel.MAX_MESSAGE_BYTES
    reflection: bool = False
    tls: TlsConfig = field(default_factory=TlsConfig)
    token: str | None = None
    diagnose: DriverDiagnoseConfig = field(default_factory=DriverDiagnoseConfig)
    read_timeout_s: float = 10.0  # deadline of event-log reads behind operator calls

    def __post_init__(self) -> None:
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if not 1 <= self.stream_buffer <= 100_000:
            raise ValueError(f"stream_buffer must be in [1, 100000], got {self.stream_buffer}")
        if self.event_queue < 16:
            raise ValueError(f"event_queue must be >= 16, got {self.event_queue}")
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


class _Ending:
    """How a session should end when the driver ends it (set from any task)."""

    __slots__ = ("event", "status", "writing")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.writing = False
        self.status: tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None = None


class DriverService(OperatorApi, dgrpc.DriverServicer):
    """Agent-facing service of one driver process (leader or standby).

    The operator RPCs (status, nodes, events, diagnose, evict) come from `OperatorApi`.
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
        self.log = log_
        self.leader_address = leader_address  # the current leader's (maybe our own) address
        self.view = LiveView(config.live)
        # detected events (and the recovery loop's observations) waiting for the writer
        self.events: asyncio.Queue[tuple[Any, float]] = asyncio.Queue(config.event_queue)
        # The recovery loop (driver/loop.py) turns each queued item into the events to
        # append and a callback run once they all are; None: items are events, as they are.
        self.decider: Callable[[Any], Awaitable[Batch]] | None = None
        self.appended = 0
        self.dropped_commands = 0
        self.delivery = _Ring()
        self.handler = _Ring()
        self.listeners: list[Callable[[ev.Event], None]] = [self._on_appended]
        self.commits = Commits()
        self.metrics = DriverMetrics(self._metric_values)
        self.metrics.watch(self.view, self.listeners, time.monotonic)
        self._replies: dict[str, asyncio.Future[dpb.AgentMessage]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._sessions: dict[str, _Ending] = {}
        self._mass_since = 0.0  # monotonic time a mass silence was first held back
        self._ids = itertools.count(1)
        self.stopping = asyncio.Event()
        self.diagnosis_running = ""  # id of the diagnosis in progress
        self._diagnosis_task: asyncio.Task[None] | None = None
        self._read_timeout_s = config.read_timeout_s
        self._diagnose_config = config.diagnose

    # ------------------------------------------------------------ leadership
    @property
    def leader(self) -> bool:
        return self.log is not None

    def lead(self, log_: EventLog, address: str) -> None:
        """Become the leader: detectors start writing to `log_`."""
        self.log = log_
        self.leader_address = address
        now = time.monotonic()
        for slot in self.view.nodes.values():
            if slot.alive:  # every node gets a full timeout to find the new leader
                self.view.mark_alive(slot, now)

    def step_down(self, leader_address: str = "") -> None:
        """Stop leading: agents are sent away to `leader_address`."""
        self.log = None
        self.leader_address = leader_address
        for node_id in list(self._sessions):
            self._end_session(
                node_id,
                grpc.StatusCode.UNAVAILABLE,
                f"driver {self.driver_id} stepped down; the leader is at "
                f"{leader_address or 'unknown yet'}",
                ((channel.LEADER_KEY, leader_address),),
            )

    def _end_session(
        self,
        node_id: str,
        code: grpc.StatusCode,
        details: str,
        trailing: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Ask `node_id`'s session handler to end its stream with this status."""
        ending = self._sessions.pop(node_id, None)
        if ending is not None:
            ending.status = (code, details, trailing)
            ending.event.set()

    async def _not_leader(self, context: grpc.aio.ServicerContext) -> None:
        where = self.leader_address or "unknown yet"
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"driver {self.driver_id} is not the leader; the leader is at {where}",
            trailing_metadata=((channel.LEADER_KEY, self.leader_address),),
        )

    # ------------------------------------------------------------ background loops
    def start(self) -> None:
        """Start the detector sweeps and the event writer (call inside the event loop)."""
        self._tasks = [
            asyncio.create_task(self._lost_loop()),
            asyncio.create_task(
                self._loop("hang", self._sweep_hangs, self.config.detectors.hang_sweep_ms / 1000.0)
            ),
            asyncio.create_task(self._writer()),
        ]

    async def close(self) -> None:
        """Stop the loops and end every session."""
        self.stopping.set()
        if self._diagnosis_task is not None:
            self._tasks.append(self._diagnosis_task)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.metrics.close()

    async def _loop(self, name: str, body: Callable[[], None], period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                if self.leader:
                    body()
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
        lost = detectors.silent(self.view, now, slack_s)
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

    def _sweep_hangs(self) -> None:
        for e in detectors.hangs(self.view, self.config.detectors):
            self.emit(e)
            h = e.hang_suspected
            log.warning(
                "hang suspected",
                node=h.node_id,
                local_rank=h.local_rank,
                step=h.stuck_at_step,
                silent_ms=round(h.silent_ms),
            )

    def emit(self, event: ev.Event, last_seen: float = math.nan) -> bool:
        """Queue `event` for the log; False (and an error log) when the queue is full."""
        event.cause = event.cause or "detector"
        try:
            self.events.put_nowait((event, last_seen))
            return True
        except asyncio.QueueFull:
            log.error("event queue full; event dropped", kind=event.WhichOneof("payload"))
            return False

    def submit(self, item: Any) -> bool:
        """Queue a recovery-loop observation (not an event) for the writer's decider."""
        try:
            self.events.put_nowait((item, math.nan))
            return True
        except asyncio.QueueFull:
            log.error("event queue full; observation dropped", kind=type(item).__name__)
            return False

    async def _writer(self) -> None:
        while True:
            item, last_seen = await self.events.get()
            if self.log is None:
                log.warning("not leader; detector event discarded", kind=_kind(item))
                continue
            batch: Batch = ([item], None) if isinstance(item, ev.Event) else ([], None)
            if self.decider is not None:
                try:
                    batch = await self.decider(item)
                except Exception:
                    log.exception("recovery decision failed; recording the event alone")
            events, then = batch
            for i, event in enumerate(events):
                if not await self._append(event, last_seen if i == 0 else math.nan):
                    then = None  # half a decision: the next settle finishes it
                    break
            if then is not None:
                try:
                    then()
                except Exception:
                    log.exception("recovery actions failed to start")

    async def _append(self, event: ev.Event, last_seen: float) -> bool:
        if self.log is None:  # stepped down while the decider awaited the log
            log.warning("not leader any more; event discarded", kind=_kind(event))
            return False
        try:
            stored = await self.log.append(event)
        except NotLeaderError as e:
            log.error("lost leadership while appending; stepping down", error=str(e))
            self.step_down()
            return False
        except (EventLogError, ValueError) as e:
            log.error("event append failed; event dropped", error=str(e), kind=_kind(event))
            return False
        self.appended += 1
        if not math.isnan(last_seen):
            self.metrics.detect_latency.observe(time.monotonic() - last_seen)
        for fn in self.listeners:
            try:
                fn(stored)
            except Exception:
                log.exception("event listener failed")
        return True

    # ------------------------------------------------------------ RPCs
    async def Register(
        self, request: dpb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RegisterResponse:
        if not self.leader:
            await self._not_leader(context)
        problem = detectors.validate_register(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if self.events.full():
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "driver busy writing events; retry with backoff"
            )
        now = time.monotonic()
        reason, event = detectors.admit(self.view, request, now)
        if reason:
            if event is None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            assert event is not None  # abort raised otherwise
            self.emit(event)
            log.warning("registration refused", node=request.node_id, reason=reason)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        slot = self.view.slot(request.node_id)
        if event is not None:
            if slot.epoch != request.epoch:
                slot.reported_exits.clear()
                slot.hung_at.clear()
                slot.last_step.clear()
                slot.hb = dpb.Heartbeat()
            slot.epoch = request.epoch
            slot.info = request
            self.emit(event)
            log.info(
                "node registered",
                node=request.node_id,
                epoch=request.epoch,
                workers=request.num_workers,
            )
        if not (slot.alive and slot.node_id in self.view.order):
            self.view.mark_registered(slot, now)
        return dpb.RegisterResponse(
            driver_id=self.driver_id,
            job_id=self.job_id,
            heartbeat_interval_ms=self.config.live.heartbeat_interval_ms,
            miss_limit=self.config.live.miss_limit,
        )

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        if not self.leader:
            await self._not_leader(context)
        node_id, epoch = "", 0
        for k, v in context.invocation_metadata() or ():
            if k == channel.NODE_KEY:
                node_id = str(v)
            elif k == channel.EPOCH_KEY:
                epoch = int(v) if str(v).isdigit() else -1
        slot = self.view.nodes.get(node_id)
        if slot is None or slot.epoch != epoch or not slot.alive:
            await context.abort(
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
        ending = self._sessions[node_id] = _Ending()
        pump = asyncio.create_task(self._pump(outbox, context, ending))
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
                await context.abort(code, details, trailing_metadata=trailing)
        finally:
            for t in (pump, reader, stop):
                t.cancel()
            if slot.session == mine:
                slot.connected = False
                slot.outbox = None
                if self._sessions.get(node_id) is ending:
                    del self._sessions[node_id]

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
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"node {slot.node_id} was declared lost; call Register again",
                    )
                beat(slot, hb, mono())
                if hb.flags:
                    for e in detectors.flagged(slot, hb):
                        self.emit(e)
                if hb.sent_mono_ns:
                    delivery.add((mono_ns() - hb.sent_mono_ns) / 1e6)
                handler.add((perf() - t0) / 1e3)
            elif msg.WhichOneof("kind") == "shard_persisted":
                commit = self.commits.record(slot.node_id, msg.shard_persisted)
                if commit is not None:
                    self.emit(commit)
            else:
                self._on_reply(slot, msg)

    def _on_appended(self, event: ev.Event) -> None:
        """Bookkeeping that follows the log: a rollback reopens the steps after it."""
        if event.WhichOneof("payload") == "rollback":
            self.commits.rollback(event.rollback.to_step)

    def _on_reply(self, slot: NodeSlot, msg: dpb.AgentMessage) -> None:
        kind = msg.WhichOneof("kind")
        cid = msg.check_result.command_id if kind == "check_result" else msg.ack.command_id
        if kind == "self_check_report":  # appended as SelfCheckReported (driver/operator.py)
            cid = self.on_self_check(slot.node_id, msg.self_check_report)
            if not cid:
                return
        fut = self._replies.pop(cid, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        else:
            log.info("unsolicited reply", node=slot.node_id, kind=kind, command_id=cid[:64])

    async def _pump(
        self,
        outbox: asyncio.Queue[dpb.DriverMessage],
        context: grpc.aio.ServicerContext,
        ending: _Ending,
    ) -> None:
        while not ending.event.is_set():
            msg = await outbox.get()
            if ending.event.is_set():
                return
            ending.writing = True
            try:
                await context.write(msg)
            finally:
                ending.writing = False

    async def LiveView(
        self, request: dpb.LiveViewRequest, context: grpc.aio.ServicerContext
    ) -> dpb.LiveViewResponse:
        out = dpb.LiveViewResponse(driver_id=self.driver_id, leader=self.leader, stats=self.stats())
        if not request.summary_only:
            out.nodes.extend(self.view.snapshot())
        return out

    # ------------------------------------------------------------ commands
    def send(self, node_id: str, msg: dpb.DriverMessage) -> str:
        """Queue a command for `node_id`'s agent; return its command id.

        Raises:
            KeyError: the node has no open session.
        A stream whose buffer is full is a consumer that cannot keep up: it is dropped
        (the agent reconnects), and the command is lost with it.
        """
        slot = self.view.nodes.get(node_id)
        if slot is None or slot.outbox is None:
            raise KeyError(f"node {node_id!r} has no open session")
        if not msg.command_id:
            msg.command_id = f"{self.driver_id}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        outbox = slot.outbox
        assert isinstance(outbox, asyncio.Queue)
        try:
            outbox.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped_commands += 1
            log.error("command buffer full; dropping the stream", node=node_id)
            slot.outbox = None
            self._end_session(
                node_id,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the driver's command buffer for {node_id} is full (the agent "
                "does not read its stream); reconnect",
            )
        return msg.command_id

    async def request(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> dpb.AgentMessage:
        """Send a command and wait (at most `timeout_s`) for its ack or check result."""
        cid = self.send(node_id, msg)
        fut: asyncio.Future[dpb.AgentMessage] = asyncio.get_running_loop().create_future()
        self._replies[cid] = fut
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(cid, None)

    # ------------------------------------------------------------ stats
    def stats(self) -> dpb.LiveStats:
        d50, d99 = self.delivery.percentiles()
        h50, h99 = self.handler.percentiles()
        alive = self.view.alive_count()
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
        )

    def reset_samples(self) -> None:
        """Forget latency samples (benchmarks call this between load levels)."""
        self.delivery.clear()
        self.handler.clear()

    def _metric_values(self) -> dict[str, Any]:
        alive = self.view.alive_count()
        return {
            "heartbeats": sum(s.heartbeats for s in self.view.nodes.values()),
            "nodes": {"alive": alive, "lost": len(self.view.nodes) - alive},
            "events": self.appended,
            "dropped": self.dropped_commands,
        }


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
    interceptors = [TokenInterceptor(cfg.token)] if cfg.token else []
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
    status = health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set(SERVICE_NAME, status)
    await health_servicer.set("", status)
    return server, port, health_servicer
