"""The recovery loop: the asyncio shell around the pure state machine (driver/machine.py).

The leader runs one `RecoveryLoop`. It starts the job itself: once `LoopConfig.nodes`
non-spare agents are registered (started with `--no-start`), it appends JobStarted and
TrainingResumed(step 0, world) and sends StartWorkers with each node's rank base and a
fresh master port. From then on every observation goes through `machine.decide`:

- detector events (WorkerFailed, NodeLost, HangSuspected, LogAlert, ...) are queued by the
  service as before; the service's single writer calls `RecoveryLoop.decide`, which folds
  the log's tail into the loop's state and returns the decision's events (the observation
  first) plus a callback that performs the decision's actions once all are appended;
- progress is observed here and queued the same way: every reachable agent acknowledged
  the stop (`machine.Paused`), every rank of the restarted world reports a step
  (RestoreFinished).

Actions map onto agent commands: PauseAll -> StopWorkers (workers flash-save every step
into agent-owned memory, so stopping them loses nothing that a pause would keep; they
restart anyway), StartWorkers -> StartWorkers (new world size, rank bases, a fresh master
port), EvictNode -> Evict, ResumeAll -> Resume, StopAll -> StopWorkers. Restore and
FlashSaveAll need no command: workers restore at start (memory -> buddy -> storage).
On becoming leader the loop calls `machine.settle` on the replayed state and performs the
pending actions again (each is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from unbroken.diagnostics.check import free_port
from unbroken.driver import machine
from unbroken.driver import state as statelib
from unbroken.driver.eventlog import EventLog
from unbroken.driver.service import Batch, DriverService
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

#: Event kinds the machine reacts to; everything else is appended as it is.
OBSERVED = frozenset(
    {
        "node_lost",
        "worker_failed",
        "hang_suspected",
        "log_alert",
        "self_check_reported",
        "operator_action",
        "diagnosis_verdict",
        "restore_finished",
        "loss_spike",
        "node_registered",
    }
)


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """The job the driver starts and recovers (`unbroken driver --nodes ...`).

    `nodes` = 0 turns the loop off: agents start their own workers and faults are only
    recorded (the mode of the heartbeat-plane tests).
    """

    nodes: int = 0
    workers_per_node: int = 1
    dp: int = 0  # 0: nodes x workers_per_node / (pp x tp)
    pp: int = 1
    tp: int = 1
    min_nodes: int = 1
    trainer: str = "external"
    worker_cmd: str = ""  # empty: each agent's own --worker-cmd
    master_addr: str = ""  # empty: the registered IP of the node holding rank 0
    stop_grace_s: float = 5.0
    command_timeout_s: float = 60.0
    start_timeout_s: float = 600.0  # for the world's nodes to register
    restore_timeout_s: float = 300.0  # for every rank of a restarted world to report a step
    policy: machine.Policy = field(default_factory=machine.Policy)

    def __post_init__(self) -> None:
        if self.nodes < 0:
            raise ValueError(f"nodes must be >= 0, got {self.nodes}")
        for name in ("workers_per_node", "pp", "tp", "min_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("stop_grace_s", "command_timeout_s", "start_timeout_s", "restore_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.nodes:
            return
        ranks = self.nodes * self.workers_per_node
        if not self.dp:
            if ranks % (self.pp * self.tp):
                raise ValueError(
                    f"nodes x workers_per_node ({ranks}) is not a multiple of pp x tp "
                    f"({self.pp * self.tp}); set dp, pp and tp so that dp x pp x tp = {ranks}"
                )
            self.dp = ranks // (self.pp * self.tp)
        if self.dp * self.pp * self.tp != ranks:
            raise ValueError(
                f"dp x pp x tp = {self.dp * self.pp * self.tp} but nodes x workers_per_node "
                f"= {ranks}; set --dp/--pp/--tp so that they are equal"
            )
        if self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) must be <= nodes ({self.nodes})")

    def world(self, node_ids: list[str]) -> ev.WorldLayout:
        """The configured layout on `node_ids` (rank order)."""
        return ev.WorldLayout(
            dp=self.dp,
            pp=self.pp,
            tp=self.tp,
            node_ids=node_ids,
            workers_per_node=self.workers_per_node,
        )


@dataclass(frozen=True, slots=True)
class _Settle:
    """Queued on becoming leader: finish a half-appended decision, resend its actions."""


@dataclass(frozen=True, slots=True)
class _StartJob:
    """Queued once the world's nodes are registered: start the job at step 0."""

    node_ids: tuple[str, ...]


class RecoveryLoop:
    """The leader's recovery loop (one per term)."""

    def __init__(
        self, config: LoopConfig, service: DriverService, elog: EventLog, state: ev.JobState
    ) -> None:
        self.config = config
        self.policy = config.policy
        self.service = service
        self.elog = elog
        self.state = state
        self._gen = 0  # bumped by every performed decision; older progress watchers stop
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Take over the service's writer and settle the replayed state."""
        self.service.decider = self.decide
        if self.state.phase == ev.PHASE_STARTING:
            self._spawn(self._wait_for_world())
        else:
            self.service.submit(_Settle())

    async def close(self) -> None:
        """Stop watching (the service keeps running as a standby)."""
        if self.service.decider == self.decide:
            self.service.decider = None
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ deciding (writer task)
    async def _catch_up(self) -> None:
        """Fold every event appended since the state's last one (by anyone)."""
        for e in await self.elog.read(self.state.last_seq + 1):
            self.state = statelib.apply(self.state, e)

    async def decide(self, item: Any) -> Batch:
        """The events to append for a queued item, and the actions to run after them."""
        await self._catch_up()
        s = self.state
        if isinstance(item, ev.Event):
            if item.WhichOneof("payload") not in OBSERVED:
                return [item], None
            d = machine.decide(s, item, self.policy)
            if d.note:
                log.info("observation", kind=item.WhichOneof("payload"), note=d.note)
            if len(d.events) == 1:  # recorded only: nothing to do
                return list(d.events), None
            return list(d.events), self._then(d)
        if isinstance(item, machine.Paused):
            d = machine.decide(s, item, self.policy)
            if d.note:
                log.info("paused report", note=d.note)
                return [], None
            return list(d.events), self._then(d)
        if isinstance(item, _Settle):
            d = machine.settle(s, self.policy)
            log.info("settled after replay", phase=ev.Phase.Name(d.phase), events=len(d.events))
            return list(d.events), self._then(d)
        if isinstance(item, _StartJob):
            return self._start_job(s, item)
        raise AssertionError(f"unknown item {item!r}")

    def _start_job(self, s: ev.JobState, item: _StartJob) -> Batch:
        if s.phase != ev.PHASE_STARTING:
            return [], None
        world = self.config.world(list(item.node_ids))
        started = ev.Event(
            cause="driver",
            job_started=ev.JobStarted(
                trainer=self.config.trainer,
                world=world,
                min_nodes=self.policy.min_nodes,
                max_nodes=self.policy.max_nodes,
            ),
        )
        resumed = ev.Event(cause="driver", training_resumed=ev.TrainingResumed(world=world))
        layout = machine.Layout.of(world)
        wpn = layout.workers_per_node
        action = machine.StartWorkers(
            layout, tuple((n, i * wpn) for i, n in enumerate(layout.node_ids))
        )
        log.info("starting the job", world=list(item.node_ids), dp=world.dp)
        return [started, resumed], lambda: self._perform((action,), restore=None)

    def _then(self, d: machine.Decision) -> Callable[[], None]:
        phases = machine.phases(d.events)
        if phases:
            log.info("recovery", phases=phases, actions=[type(a).__name__ for a in d.actions])
        restore = next((a for a in d.actions if isinstance(a, machine.Restore)), None)
        return lambda: self._perform(d.actions, restore=restore)

    # ------------------------------------------------------------ acting
    def _perform(
        self, actions: tuple[machine.Action, ...], restore: machine.Restore | None
    ) -> None:
        self._gen += 1
        self._spawn(self._act(self._gen, actions, restore))

    async def _act(
        self, gen: int, actions: tuple[machine.Action, ...], restore: machine.Restore | None
    ) -> None:
        try:
            for a in actions:
                if gen != self._gen:
                    return  # a newer decision took over
                await self._one(gen, a, restore)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("recovery action failed; the next observation retries")

    async def _one(self, gen: int, a: machine.Action, restore: machine.Restore | None) -> None:
        cfg = self.config
        if isinstance(a, machine.PauseAll):
            await self._broadcast(
                a.nodes, dpb.DriverMessage(stop_workers=dpb.StopWorkers(grace_s=cfg.stop_grace_s))
            )
            if gen == self._gen:
                self.service.submit(machine.Paused(step=self._live_step(a.nodes)))
        elif isinstance(a, machine.EvictNode):
            await self._broadcast(
                (a.node_id,), dpb.DriverMessage(evict=dpb.Evict(reason=a.reason)), wait=False
            )
        elif isinstance(a, machine.StartWorkers):
            await self._start_workers(gen, a, restore)
        elif isinstance(a, machine.ResumeAll):
            await self._broadcast(
                a.nodes, dpb.DriverMessage(resume=dpb.Resume(at_step=a.step)), wait=False
            )
        elif isinstance(a, machine.StopAll):
            await self._broadcast(
                a.nodes, dpb.DriverMessage(stop_workers=dpb.StopWorkers(grace_s=cfg.stop_grace_s))
            )
        elif isinstance(a, machine.RunDiagnosis):
            log.error(
                "a diagnosis is needed but the loop does not run one yet; "
                "run `unbroken diagnose` or evict the suspects",
                diagnosis_id=a.diagnosis_id,
                suspects=list(a.suspects),
            )
        # FlashSaveAll and Restore need no command: see the module docstring.

    async def _broadcast(
        self, nodes: tuple[str, ...], msg: dpb.DriverMessage, *, wait: bool = True
    ) -> dict[str, str]:
        """Send `msg` to every node with a session; return node -> error for failures."""

        async def one(n: str) -> str:
            m = dpb.DriverMessage()
            m.CopyFrom(msg)
            try:
                if not wait:
                    self.service.send(n, m)
                    return ""
                r = await self.service.request(n, m, self.config.command_timeout_s)
                return "" if r.ack.ok else r.ack.detail or "refused"
            except (KeyError, TimeoutError) as e:
                return f"{type(e).__name__}: {e}"

        errors = dict(zip(nodes, await asyncio.gather(*(one(n) for n in nodes)), strict=True))
        bad = {n: e for n, e in errors.items() if e}
        if bad:
            log.warning("command not done everywhere", kind=msg.WhichOneof("kind"), errors=bad)
        return bad

    def _live_step(self, nodes: tuple[str, ...]) -> int:
        """The newest step any worker of `nodes` reported (the step the job stopped at)."""
        step = self.state.step
        for n in nodes:
            slot = self.service.view.nodes.get(n)
            if slot is not None:
                step = max([step, *(w.step for w in slot.hb.workers)])
        return step

    async def _start_workers(
        self, gen: int, a: machine.StartWorkers, restore: machine.Restore | None
    ) -> None:
        cfg = self.config
        nodes = a.world.node_ids
        # A world node without a session is coming back or about to be declared lost
        # (then a newer decision replaces this one): wait for either, up to the deadline.
        deadline = time.monotonic() + cfg.restore_timeout_s
        while missing := [n for n in nodes if not self._connected(n)]:
            if gen != self._gen:
                return
            if time.monotonic() > deadline:
                log.error("world nodes without a session", nodes=missing)
                break
            await asyncio.sleep(0.05)
        first = self.service.view.nodes.get(nodes[0])
        addr = cfg.master_addr or (first.info.ip if first is not None else "")
        port = free_port()
        marks = {n: self._beats(n) for n in nodes}
        t0 = time.monotonic()
        bases = dict(a.rank_base)

        async def one(n: str) -> str:
            msg = dpb.DriverMessage(
                start_workers=dpb.StartWorkers(
                    worker_cmd=cfg.worker_cmd,
                    world_size=a.world.world_size,
                    global_rank_base=bases[n],
                    master_addr=addr or "127.0.0.1",
                    master_port=port,
                )
            )
            try:
                r = await self.service.request(n, msg, cfg.command_timeout_s)
                return "" if r.ack.ok else r.ack.detail or "refused"
            except (KeyError, TimeoutError) as e:
                return f"{type(e).__name__}: {e}"

        errors = [e for e in await asyncio.gather(*(one(n) for n in nodes)) if e]
        log.info("workers started", world=list(nodes), master_port=port, errors=errors)
        if restore is None:
            return
        error = "; ".join(errors)
        while not error and not self._all_stepping(nodes, marks):
            if gen != self._gen:
                return
            if time.monotonic() > deadline:
                error = f"not every rank reported a step within {cfg.restore_timeout_s} s"
            await asyncio.sleep(0.05)
        if gen != self._gen:
            return
        self.service.submit(
            ev.Event(
                cause="driver",
                restore_finished=ev.RestoreFinished(
                    step=restore.step,
                    duration_s=time.monotonic() - t0,
                    ok=not error,
                    error=error,
                ),
            )
        )

    def _connected(self, node_id: str) -> bool:
        slot = self.service.view.nodes.get(node_id)
        return slot is not None and slot.alive and slot.outbox is not None

    def _beats(self, node_id: str) -> int:
        slot = self.service.view.nodes.get(node_id)
        return slot.heartbeats if slot is not None else 0

    def _all_stepping(self, nodes: tuple[str, ...], marks: dict[str, int]) -> bool:
        """Every node sent a heartbeat since the start in which all its workers step."""
        for n in nodes:
            slot = self.service.view.nodes.get(n)
            if slot is None or slot.heartbeats <= marks[n] + 1 or not slot.hb.workers:
                return False
            for w in slot.hb.workers:
                if w.state != dpb.WORKER_STATE_RUNNING or w.step == 0:
                    return False
        return True

    # ------------------------------------------------------------ starting the job
    async def _wait_for_world(self) -> None:
        """Wait for the world's nodes to register, then queue the job's start."""
        cfg = self.config
        deadline = time.monotonic() + cfg.start_timeout_s
        while True:
            ready = self._ready_nodes()
            if len(ready) >= cfg.nodes:
                self.service.submit(_StartJob(tuple(ready[: cfg.nodes])))
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
        for slot in self.service.view.nodes.values():
            if slot.alive and slot.outbox is not None and slot.info.node_id and not slot.info.spare:
                out.append(slot.node_id)
        return out
