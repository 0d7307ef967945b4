"""The cluster scheduler as the driver sees it: a narrow interface, an in-memory pool, a bridge.

The recovery machine (driver/machine.py) decides *that* a node leaves the job and *that* a
spare takes its place; the cluster's scheduler must hear of both, or the next job lands on
the same bad machine and a replacement is only a spare someone started by hand. Five calls
are all the driver needs (docs/style.md: a narrow interface, an in-memory version first):

- `drain(node, reason)`: no new work goes to the node (Slurm: State=DRAIN with the reason);
- `resume(node)`: an operator cleared it; it takes work again;
- `request_replacement(n, exclude)`: up to n healthy nodes for the job, and start a
  replacement's agent on each (Slurm: a spare of the job's allocation, one `srun` step);
- `release(node)`: the job gives the node back;
- `nodes()`: every node the scheduler knows, with its state and reason.

`InMemoryScheduler` is today's static spare pool (spare agents someone started), for tests
and `unbroken up`; `unbroken.driver.slurm.SlurmScheduler` talks to Slurm. A Kubernetes
provider would be a third class with the same five calls.

`SchedulerBridge` connects the journal to a scheduler: every NodeEvicted (by a diagnosis,
a self-check, the straggler policy or an operator) drains the node with
`unbroken: <incident id> <cause>` in the reason, and the scheduler's answer is recorded as
a SchedulerCall event. Calls run in the background with a deadline; a failed call is
recorded (ok=false, the error) and never blocks the recovery, which goes on with the spares
it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from unbroken.common import aio
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

REASON_PREFIX = "unbroken:"  # drains made by unbroken say so; `resume` refuses others by default
MAX_REASON = 200  # characters of a drain reason (Slurm keeps it whole; `sinfo -R` shows it)


class SchedulerError(Exception):
    """The scheduler refused a call, failed, or did not answer within its deadline."""


class NodeHealth(enum.Enum):
    """A node's state as the scheduler sees it (coarser than Slurm's dozens)."""

    IDLE = "idle"  # up, no job
    ALLOCATED = "allocated"  # up, running a job
    DRAINING = "draining"  # drained, a job still runs on it
    DRAINED = "drained"  # drained, no job
    DOWN = "down"  # not responding (or marked down)
    FUTURE = "future"  # configured, not started yet
    UNKNOWN = "unknown"

    @property
    def faulty(self) -> bool:
        """A fault signal: the scheduler took the node out of service."""
        return self in (NodeHealth.DRAINING, NodeHealth.DRAINED, NodeHealth.DOWN)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node as the scheduler reports it."""

    node_id: str
    health: NodeHealth
    reason: str = ""
    raw_state: str = ""  # the scheduler's own word for it (Slurm: IDLE+DRAIN, ...)


def drain_reason(incident_id: str, cause: str) -> str:
    """`unbroken: <incident id> <cause>`, one line, at most MAX_REASON characters."""
    text = f"{REASON_PREFIX} {incident_id or '-'} {cause}".replace("\n", " ").strip()
    return text[:MAX_REASON]


class Scheduler(Protocol):
    """What the driver asks of a cluster scheduler. Every call has a deadline and raises
    `SchedulerError` with a message a person can act on when the scheduler refuses."""

    name: str

    async def drain(self, node_id: str, reason: str) -> str:
        """Stop new work going to `node_id`; return the scheduler's answer (one line)."""
        ...

    async def resume(self, node_id: str, *, force: bool = False) -> str:
        """Return a drained node to service; return the scheduler's answer. A node drained
        by someone else for their own reason (not `unbroken: ...`) is refused unless
        `force`."""
        ...

    async def request_replacement(self, n: int, exclude: Iterable[str]) -> list[str]:
        """Up to `n` healthy nodes not in `exclude`, their agents started; [] when none."""
        ...

    async def release(self, node_id: str) -> str:
        """Give `node_id` back to the scheduler (it leaves the job's allocation)."""
        ...

    async def nodes(self) -> list[NodeInfo]:
        """Every node the scheduler knows."""
        ...


@dataclass(slots=True)
class InMemoryScheduler:
    """Today's static spare pool: nodes and their health in a dict.

    `spares` are the nodes a replacement may be taken from (their agents are already
    running with `--spare`); `start_agent`, when set, is called for each node handed out
    (tests use it to start the agent on request, as Slurm's `srun` does).
    """

    nodes_: dict[str, NodeInfo] = field(default_factory=dict)
    spares: list[str] = field(default_factory=list)
    start_agent: Callable[[str], None] | None = None
    name: str = "memory"
    calls: list[tuple[str, str]] = field(default_factory=list)

    @staticmethod
    def of(in_job: Sequence[str], spares: Sequence[str] = ()) -> InMemoryScheduler:
        """A pool where `in_job` are allocated and `spares` idle."""
        nodes = {n: NodeInfo(n, NodeHealth.ALLOCATED) for n in in_job}
        nodes.update({n: NodeInfo(n, NodeHealth.IDLE) for n in spares})
        return InMemoryScheduler(nodes_=nodes, spares=list(spares))

    def _get(self, node_id: str) -> NodeInfo:
        info = self.nodes_.get(node_id)
        if info is None:
            raise SchedulerError(f"unknown node {node_id!r}; known: {sorted(self.nodes_)}")
        return info

    async def drain(self, node_id: str, reason: str) -> str:
        info = self._get(node_id)
        busy = info.health in (NodeHealth.ALLOCATED, NodeHealth.DRAINING)
        health = NodeHealth.DRAINING if busy else NodeHealth.DRAINED
        self.nodes_[node_id] = NodeInfo(node_id, health, reason, health.value)
        if node_id in self.spares:
            self.spares.remove(node_id)
        self.calls.append(("drain", node_id))
        return f"{node_id} {health.value}: {reason}"

    async def resume(self, node_id: str, *, force: bool = False) -> str:
        info = self._get(node_id)
        if not info.health.faulty:
            raise SchedulerError(f"{node_id} is {info.health.value}, not drained or down")
        if not force and info.reason and not info.reason.startswith(REASON_PREFIX):
            raise SchedulerError(
                f"{node_id} was drained by someone else ({info.reason!r}); clear it with "
                "--force if it is fixed"
            )
        self.nodes_[node_id] = NodeInfo(node_id, NodeHealth.IDLE, "", "idle")
        self.spares.append(node_id)
        self.calls.append(("resume", node_id))
        return f"{node_id} idle"

    async def request_replacement(self, n: int, exclude: Iterable[str]) -> list[str]:
        skip = set(exclude)
        out = [
            s for s in self.spares if s not in skip and self.nodes_[s].health is NodeHealth.IDLE
        ][:n]
        for s in out:
            self.spares.remove(s)
            self.nodes_[s] = NodeInfo(s, NodeHealth.ALLOCATED, "", "allocated")
            self.calls.append(("replace", s))
            if self.start_agent is not None:
                self.start_agent(s)
        return out

    async def release(self, node_id: str) -> str:
        info = self._get(node_id)
        if info.health is NodeHealth.ALLOCATED:
            self.nodes_[node_id] = NodeInfo(node_id, NodeHealth.IDLE, "", "idle")
        elif info.health is NodeHealth.DRAINING:
            self.nodes_[node_id] = NodeInfo(node_id, NodeHealth.DRAINED, info.reason, "drained")
        self.calls.append(("release", node_id))
        return f"{node_id} released"

    async def nodes(self) -> list[NodeInfo]:
        return sorted(self.nodes_.values(), key=lambda i: i.node_id)


# ---------------------------------------------------------------- the bridge
@dataclass(frozen=True, kw_only=True, slots=True)
class BridgeConfig:
    """How the driver uses its scheduler."""

    timeout_s: float = field(
        default=30.0,
        metadata={"help": "per call, on top of the scheduler's own command deadlines"},
    )
    poll_s: float = field(
        default=2.0, metadata={"help": "how often the scheduler's node states are read (0: never)"}
    )
    replace: bool = field(
        default=True,
        metadata={
            "negate": "--no-scheduler-replace",
            "help": "do not ask the scheduler for a node when a world node goes and no spare "
            "is left",
        },
    )
    # Spares kept registered: the bridge asks the scheduler for a node (and its agent) until
    # this many healthy spares are registered, so a lost node is replaced at once, in place
    # (same world, no shrink), and the pool is refilled after each replacement.
    spares: int = field(
        default=0,
        metadata={
            "help": "spares to keep registered: the driver starts their agents through the "
            "scheduler (--slurm-agent-cmd) and refills the pool after each replacement"
        },
    )
    drain_lost: bool = field(
        default=True,
        metadata={
            "negate": "--no-scheduler-drain-lost",
            "help": "do not drain a lost world node (it is drained by default: it crashed, "
            "check it first)",
        },
    )
    register_s: float = field(
        default=60.0, metadata={"help": "a requested agent counts as on its way this long"}
    )

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"BridgeConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.poll_s < 0:
            raise ValueError(f"BridgeConfig.poll_s must be >= 0, got {self.poll_s}")


class SchedulerBridge:
    """Tells the scheduler what the log decided, records its answers, watches its nodes.

    - Subscribes to the journal: each NodeEvicted drains its node; a world node lost or
      evicted while no healthy spare is registered asks for a replacement, whose agent the
      scheduler starts (it registers as a spare and the recovery takes it).
    - Every `poll_s` reads the scheduler's nodes: a node of the job that the scheduler marks
      DOWN, or DRAIN by someone else, is a fault signal (NodeLost resp. an eviction by
      "slurm"); a node unbroken drained that is back in service (cleared outside the
      driver: `unbroken slurm resume --direct`, scontrol) is recorded as a SchedulerCall
      "resumed".
    - `clear(node)` (the operator's ClearNode RPC, `unbroken slurm resume`): the scheduler
      resumes the node; its answer is recorded as a SchedulerCall "resume".

    `journal` is the term's `Journal` (the driver's only writer of the log).
    """

    def __init__(
        self, scheduler: Scheduler, journal: Any, config: BridgeConfig | None = None
    ) -> None:
        self.scheduler = scheduler
        self.journal = journal
        self.config = config or BridgeConfig()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._drained: set[str] = set()  # nodes this driver drained, until resumed
        self._signalled: set[str] = set()  # nodes whose scheduler fault was submitted
        self._replacing = 0  # replacement requests in flight (and agents not registered yet)
        self._exhausted = False  # the scheduler had no node for the last request
        self._coming: dict[str, float] = {}  # node -> deadline: started, not registered yet
        self._seeded = False  # `_drained` learned the drains of earlier terms
        self._watcher: asyncio.Task[Any] | None = None  # the poll of the scheduler's nodes

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s

    def start(self) -> None:
        """Subscribe to the journal and start the watch (inside the event loop)."""
        self.journal.subscribers.append(self.on_event)
        if self.config.poll_s:
            self._watcher = self._spawn(self._watch())

    def on_event(self, e: ev.Event) -> None:
        """A journal subscriber (never blocks: calls run in the background)."""
        kind = e.WhichOneof("payload")
        if kind == "node_evicted":
            p = e.node_evicted
            why = p.reason
            if p.diagnosis_id and p.diagnosis_id not in why:  # the verdict that named it
                head, sep, cause = why.partition(": ")
                why = (
                    f"{head}: diagnosis {p.diagnosis_id}: {cause}"
                    if sep and head.startswith("incident ")
                    else f"diagnosis {p.diagnosis_id}: {why}"
                )
            self.drain_evicted(p.node_id, why, f"s{e.seq}")
            self._maybe_replace(p.node_id)
        elif kind == "node_lost":
            n = e.node_lost.node_id
            rec = self.journal.state.nodes.get(n)
            stale = rec is not None and e.node_lost.epoch and e.node_lost.epoch < rec.epoch
            if self.config.drain_lost and not stale and n in self.journal.state.world.node_ids:
                why = e.node_lost.reason or "no heartbeat"
                self.drain_evicted(n, f"node {n} lost ({why})", f"s{e.seq}")
            self._maybe_replace(n)
        elif kind in ("node_registered", "spare_assigned", "job_started"):
            self._top_up()

    def drain_evicted(self, node_id: str, why: str, fallback: str = "") -> None:
        """Drain an evicted node in the background and record the answer.

        The reason is `unbroken: <incident id> <cause>`; an eviction outside an incident (an
        operator's, with no recovery loop) names the eviction's sequence number instead.
        """
        self._drained.add(node_id)

        async def later() -> None:
            # run after the whole transaction is folded: the incident it opened is known
            incident, cause = self.journal.state.incident_id, why
            if why.startswith("incident ") and ": " in why:  # machine._reshape's reason
                head, cause = why.split(": ", 1)
                incident = head.split(" ", 1)[1]
            reason = drain_reason(incident or fallback, cause)
            await self.call("drain", node_id, reason, self._drain(node_id, reason))

        self._spawn(later())

    async def _drain(self, node_id: str, reason: str) -> str:
        for info in await self.scheduler.nodes():
            if (
                info.node_id == node_id
                and info.health.faulty
                and info.reason
                and not (info.reason.startswith(REASON_PREFIX))
            ):  # someone drained it for their own reason first: keep theirs
                return f"{node_id} already {info.raw_state}: {info.reason}"
        return await self.scheduler.drain(node_id, reason)

    def _spares(self) -> int:
        """Registered healthy spares, plus requested agents not registered yet."""
        s = self.journal.state
        now = time.monotonic()
        for n, deadline in list(self._coming.items()):
            if n in s.nodes or now > deadline:
                del self._coming[n]
        return len(self._coming) + sum(
            1
            for r in s.nodes.values()
            if r.state == ev.NODE_STATE_SPARE and r.node_id not in s.world.node_ids
        )

    def _maybe_replace(self, node_id: str) -> None:
        s = self.journal.state
        if not self.config.replace or node_id not in s.world.node_ids:
            return
        if self._spares() + self._replacing >= max(1, self.config.spares):
            return
        self._replacing += 1
        self._spawn(self._replace(node_id, set(s.nodes)))

    def _top_up(self) -> None:
        """Ask for spares until `config.spares` are registered or on their way."""
        s = self.journal.state
        if s.phase in (ev.PHASE_STARTING, ev.PHASE_FINISHED, ev.PHASE_FAILED, 0):
            return  # before the job starts its world is not known; after it, no need
        if self._exhausted:
            return
        while self._spares() + self._replacing < self.config.spares:
            self._replacing += 1
            self._spawn(self._replace("", set(s.nodes)))

    async def _replace(self, node_id: str, known: set[str]) -> None:
        try:

            async def one() -> str:
                got = await self.scheduler.request_replacement(1, known)
                if not got:
                    raise SchedulerError("no healthy node free for a replacement")
                return ",".join(got)

            what = f"replace {node_id}" if node_id else "keep a spare"
            answer = await self.call("replace", node_id, what, one())
            if not answer.scheduler_call.ok:
                self._exhausted = True  # no more until a node comes back (a resume)
            else:  # its agent registers a few seconds later: on its way until then
                for got in answer.scheduler_call.detail.split(","):
                    self._coming[got] = time.monotonic() + self.config.register_s
        finally:
            self._replacing -= 1

    async def clear(self, node_id: str, *, force: bool = False, cause: str = "") -> ev.Event:
        """An operator cleared `node_id` (the ClearNode RPC): the scheduler resumes it.

        Returns the recorded SchedulerCall "resume" (stored, with its seq, when the log took
        it); ok=false with the scheduler's refusal in `detail`. The node takes new work from
        the scheduler again (it stays evicted in this job's log); the bridge asks for spares
        again if it had stopped because none was left.
        """
        was = node_id in self._drained
        self._drained.discard(node_id)  # the watch must not record this clearing twice
        answer = await self.call(
            "resume",
            node_id,
            "cleared by an operator" + (" (force)" if force else ""),
            self.scheduler.resume(node_id, force=force),
            cause=cause,
        )
        if answer.scheduler_call.ok:
            self._signalled.discard(node_id)
            self._exhausted = False
        elif was:
            self._drained.add(node_id)
        return answer

    async def call(
        self, action: str, node_id: str, reason: str, coro: Any, *, cause: str = ""
    ) -> ev.Event:
        """Await a scheduler call (with the bridge's deadline) and record its answer;
        return the answer as stored (with its seq) or, when the log refused it, as made."""
        t0 = time.monotonic()
        try:
            detail = str(await aio.wait_for(coro, self.timeout_s))
            ok = True
        except TimeoutError:
            detail, ok = f"no answer within {self.timeout_s} s", False
        except SchedulerError as e:
            detail, ok = str(e), False
        answer = self._answer(action, node_id, ok, detail, reason, time.monotonic() - t0)
        if cause:
            answer.cause = cause
        (log.info if ok else log.error)(
            "scheduler call", action=action, node=node_id, ok=ok, detail=detail
        )
        return await self._record(answer)

    def _answer(
        self, action: str, node_id: str, ok: bool, detail: str, reason: str, took: float
    ) -> ev.Event:
        return ev.Event(
            cause=f"{action} {node_id}",
            scheduler_call=ev.SchedulerCall(
                action=action,
                node_id=node_id,
                ok=ok,
                detail=detail[:500],
                reason=reason,
                scheduler=self.scheduler.name,
                duration_s=took,
            ),
        )

    async def _record(self, e: ev.Event) -> ev.Event:
        try:
            stored = await self.journal.record(e, wait_s=self.timeout_s)
            return stored[0] if stored else e
        except Exception as err:  # the term ended, etcd is down: the call was still made
            log.warning("scheduler answer not recorded", error=str(err))
            return e

    async def _watch(self) -> None:
        """Poll the scheduler's nodes: faults as signals, cleared drains as answers."""
        while not self.journal.closed:  # the term ended: the next leader watches
            await asyncio.sleep(self.config.poll_s)
            try:
                infos = await aio.wait_for(self.scheduler.nodes(), self.timeout_s)
                await self._look(infos)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Slurm down for a while: say so, keep watching
                log.warning("reading the scheduler's nodes failed", error=str(e))

    async def _look(self, infos: Iterable[NodeInfo]) -> None:
        s = self.journal.state
        infos = list(infos)
        if not self._seeded:  # a new term: the drains earlier terms made are ours too
            self._seeded = True
            self._drained |= {
                i.node_id for i in infos if i.health.faulty and i.reason.startswith(REASON_PREFIX)
            }
        for info in infos:
            n = info.node_id
            if (
                n in self._drained
                and not info.health.faulty
                and info.health is not (NodeHealth.UNKNOWN)
            ):
                self._drained.discard(n)
                self._exhausted = False
                await self._record(
                    self._answer("resumed", n, True, f"{n} {info.raw_state}", "cleared", 0.0)
                )
            rec = s.nodes.get(n)
            healthy = rec is not None and rec.state in (ev.NODE_STATE_ACTIVE, ev.NODE_STATE_SPARE)
            if not info.health.faulty:
                self._signalled.discard(n)
                continue
            if not healthy or n in self._signalled or n in self._drained:
                continue
            self._signalled.add(n)
            said = f"{info.raw_state}: {info.reason}" if info.reason else info.raw_state
            if info.health is NodeHealth.DOWN:
                fault = ev.Event(
                    cause=f"{self.scheduler.name}",
                    node_lost=ev.NodeLost(
                        node_id=n, epoch=rec.epoch, reason=f"{self.scheduler.name}: {said}"
                    ),
                )
            else:
                fault = ev.Event(
                    cause=f"{self.scheduler.name}: {said}"[:200],
                    operator_action=ev.OperatorAction(
                        action="evict", target=n, who=f"{self.scheduler.name} ({said})"[:200]
                    ),
                )
            log.warning("the scheduler took a node out of service", node=n, state=said)
            self.journal.submit(fault, time.monotonic())

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def close(self) -> None:
        """Unsubscribe; wait briefly for calls in flight, then cancel them."""
        with contextlib.suppress(ValueError):
            self.journal.subscribers.remove(self.on_event)
        if self._watcher is not None:
            self._watcher.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.timeout_s)
        for t in list(self._tasks):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
