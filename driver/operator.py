"""The driver's operator API: status, nodes, events, diagnose and evict over gRPC.

These RPCs serve the `unbroken` CLI, launchers and dashboards, not the agents' hot path,
so they live apart from the heartbeat service (driver/service.py), in their own handler
object built with what it needs (who leads, the agent sessions, the config). Only the
leader answers: a standby has no journal and says where the leader is
(FAILED_PRECONDITION plus the `x-unbroken-leader` trailer). Reads come from the journal's
folded state in memory, joined with the live view; writes go through the journal (an
eviction is an observation the recovery loop decides on at once). Diagnose runs as a task
of the driver, not of the call (a client that goes away does not leave the workers paused).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from unbroken.common import aio, channel
from unbroken.common.faults import RuntimeFault
from unbroken.diagnostics.runner import verdict_event
from unbroken.driver import goodput as goodputlib
from unbroken.driver import loghealth, machine, paging
from unbroken.driver.decider import EVICT
from unbroken.driver.diagnose import DiagnoseError, DriverDiagnoseConfig, run_diagnosis
from unbroken.driver.eventlog import EventLogError, new_event_id
from unbroken.driver.journal import Journal
from unbroken.driver.leadership import Commands, Leadership
from unbroken.driver.liveview import LiveView
from unbroken.driver.rpc import abort, within_deadline
from unbroken.driver.security import ANONYMOUS, OPERATOR, caller
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:  # only the type is needed here
    from unbroken.driver.config import ServiceConfig

log = structlog.get_logger(__name__)

READ_CHUNK = 500  # events read per call while streaming history (one exact key range)
WATCH_BUFFER = 4096  # live events queued for one follower before it is dropped
MAX_NODE_ID = 128
MAX_PAGE = 100_000  # ListNodes page_size cap
DIAGNOSE_QUEUE = 1024  # progress messages buffered for one watching call
SELFCHECK_TIMEOUT_S = 120.0  # default deadline of one node's self-check (RunSelfCheck)
SELFCHECK_SLACK_S = 15.0  # extra wait for the agent's report after the child's deadline
MAX_DETAILS_JSON = 8000  # self-check details kept in the event


def who(context: grpc.aio.ServicerContext) -> str:
    """Who made a call, for the audit trail: the authenticated principal.

    Without credentials configured (`*:anonymous`), the client's own claim (the CLI's
    user@host metadata, else the peer address) follows it, marked as a claim.
    """
    p = caller()
    if p is not ANONYMOUS:
        return str(p)
    claim = next(
        (str(v) for k, v in context.invocation_metadata() or () if k == channel.USER_KEY),
        str(context.peer()),
    )
    return f"{p} (claims {claim[:100]})"


def node_infos(
    state: ev.JobState, view: LiveView, now: float, *, after: str = "", limit: int = 0
) -> list[dpb.NodeInfo]:
    """The nodes of the folded state or the live view, joined, sorted by id (pure): those
    with ids after `after`, at most `limit` of them (0: all)."""
    out = []
    ids = sorted(n for n in set(state.nodes) | set(view.nodes) if n > after)
    for node_id in ids[:limit] if limit else ids:
        info = dpb.NodeInfo(node_id=node_id)
        rec = state.nodes.get(node_id)
        if rec is not None:
            info.state = rec.state
            info.epoch = rec.epoch
            info.hostname = rec.hostname
            info.ip = rec.ip
            info.num_workers = rec.num_workers
            info.spare = rec.spare
            info.failures = rec.failures
        slot = view.nodes.get(node_id)
        if slot is not None:
            info.alive = slot.alive
            info.connected = slot.outbox is not None
            info.epoch = slot.epoch or info.epoch
            info.hostname = info.hostname or slot.info.hostname
            info.ip = info.ip or slot.info.ip
            info.num_workers = info.num_workers or slot.info.num_workers
            info.silent_ms = (now - slot.last_seen) * 1000.0 if slot.last_seen else 0.0
            info.workers.extend(slot.hb.workers)
            info.attached.extend(slot.hb.attached)
            info.step = max((w.step for w in [*slot.hb.workers, *slot.hb.attached]), default=0)
        out.append(info)
    return out


LIVE_STEP_NODES = 64  # the most recently heard nodes whose ranks give the live step


def status_of(state: ev.JobState, view: LiveView) -> dpb.GetStatusResponse:
    """The status counters of a folded state and the live view (pure; no NodeInfo is built,
    no heartbeat of every node read, so it stays cheap at 10,000 nodes).

    The live step is the newest step of the `LIVE_STEP_NODES` nodes heard from last (the
    ranks of a synchronous job are within a step of each other), not a scan of every rank.
    """
    counts = dict.fromkeys(ev.NodeState.values(), 0)
    for rec in state.nodes.values():
        counts[rec.state] += 1
    unlogged = sum(1 for node_id in view.nodes if node_id not in state.nodes)
    counts[0] += unlogged  # registered, not in the log yet
    live_step = 0
    for _, slot in zip(range(LIVE_STEP_NODES), view.heard(), strict=False):
        for w in slot.hb.workers:
            if w.step > live_step:
                live_step = w.step
        for w in slot.hb.attached:
            if w.step > live_step:
                live_step = w.step
    ids_total = len(state.nodes) + unlogged
    alive = view.alive_count()
    st = dpb.GetStatusResponse(
        job_id=state.job_id,
        leader_term=state.leader_term,
        phase=state.phase,
        step=state.step,
        last_seq=state.last_seq,
        incident_id=state.incident_id,
        incident_cause=state.incident_cause,
        failed_restores=state.failed_restores,
        finished_reason=state.finished_reason,
        last_diagnosis_id=state.last_diagnosis_id,
        nodes_total=ids_total,
        nodes_alive=alive,
        live_step=live_step,
    )
    st.nodes_active = counts[ev.NODE_STATE_ACTIVE]
    st.nodes_spare = counts[ev.NODE_STATE_SPARE]
    st.nodes_lost = counts[ev.NODE_STATE_LOST]
    st.nodes_evicted = counts[ev.NODE_STATE_EVICTED]
    return st


OPERATORS = OPERATOR  # the role whose watcher slots are kept free of everyone else


def watcher_quota(cap: int, total: int, mine: int, operator: bool) -> str:
    """Why one more WatchEvents stream is refused ("" when it is not). Pure.

    Of the driver's `cap` streams, one principal holds at most a quarter (one viewer's
    token cannot take them all), and the last eighth are kept for operators, so viewers'
    and launchers' watches never lock an operator out of `unbroken events`.
    """
    per_principal = max(1, cap // 4)
    reserved = max(1, cap // 8) if cap > 1 else 0
    if total >= cap:
        return f"{total} event watchers are already streaming (the limit, {cap})"
    if mine >= per_principal:
        return (
            f"this principal already has {mine} event watchers streaming (at most {per_principal})"
        )
    if not operator and total >= cap - reserved:
        return (
            f"{total} event watchers are streaming; the last {reserved} of {cap} are kept for "
            "operators"
        )
    return ""


class OperatorApi:
    """Operator RPCs: status, nodes, events, evict, diagnose, self-checks, fault drills.

    Args:
        lead: who leads (the journal of the current term).
        commands: the agent sessions (send, request) and the live view.
        config: deadlines, watcher cap, diagnosis settings.
    """

    def __init__(self, lead: Leadership, commands: Commands, config: ServiceConfig) -> None:
        self._lead = lead
        self._cmd = commands
        self._read_timeout_s = config.read_timeout_s
        self._max_watchers = config.max_watchers
        self._diagnose_config = config.diagnose
        self._allow_fault_injection = config.allow_fault_injection
        self.watchers = 0  # WatchEvents calls streaming now
        self.watchers_of: collections.Counter[str] = collections.Counter()  # by principal
        self.diagnosis_running = ""  # id of the operator's diagnosis in progress
        self._diagnosis_task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        """Cancel an operator's diagnosis still running (the driver is stopping)."""
        task = self._diagnosis_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    @property
    def view(self) -> LiveView:
        return self._cmd.view

    async def _journal(self, context: grpc.aio.ServicerContext) -> Journal:
        return await self._lead.require(context)

    async def _state(self, context: grpc.aio.ServicerContext) -> ev.JobState:
        """The leader's folded state, from memory (never a read of etcd)."""
        return (await self._journal(context)).state

    # ------------------------------------------------------------ reads
    async def GetStatus(
        self, request: dpb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> dpb.GetStatusResponse:
        state = await self._state(context)
        st = status_of(state, self.view)
        gp = goodputlib.goodput_now(state, self.view)
        st.goodput, st.training_wall_s = gp.ratio, gp.wall_s
        st.lost_s_by_cause.update(gp.lost_s_by_cause)
        st.lost_s_by_category.update(gp.lost_s_by_category)
        st.job_id = st.job_id or self._lead.job_id
        st.driver_id = self._lead.driver_id
        st.leader_address = self._lead.address
        st.diagnosis_running = self.diagnosis_running
        st.persist_every_s, st.persist_cost_s, st.storage_mtbf_s = self._cmd.persistence()
        st.persist_failing.extend(self._cmd.persist_failing())
        st.newest_commit_step, st.newest_commit_age_s = self._cmd.newest_commit()
        h = loghealth.summary(self._lead.journal)
        st.log_error, st.log_failing_s, st.log_full = h["error"], h["failing_s"], h["full"]
        st.faults_unrecorded = h["faults_unrecorded"]
        held = self._cmd.mass_silence()
        st.mass_silence_nodes, st.mass_silence_held_s, st.mass_silence_unheard_s = held
        st.awaiting_nodes = self._cmd.awaiting_nodes(state)
        return st

    async def ListNodes(
        self, request: dpb.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ListNodesResponse:
        state = await self._state(context)
        if request.page_size > MAX_PAGE:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"page_size {request.page_size} is over {MAX_PAGE}",
            )
        limit = paging.page_size(request.page_size)
        nodes = node_infos(state, self.view, time.monotonic(), after=request.after, limit=limit + 1)
        page, nxt = paging.bounded(nodes, limit, more=False)
        return dpb.ListNodesResponse(nodes=page, next_after=nxt)

    async def WatchEvents(
        self, request: dpb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        """Stream history page by page (archive included), then, with `follow`, live events.

        Memory per watcher is one page plus a bounded live buffer; a follower that does not
        keep up with the live buffer is dropped (RESOURCE_EXHAUSTED), and at most
        `max_watchers` calls stream at once.
        """
        journal = await self._journal(context)
        who = caller()
        problem = watcher_quota(
            self._max_watchers, self.watchers, self.watchers_of[str(who)], who.may(OPERATORS)
        )
        if problem:
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{problem} on driver {self._lead.driver_id}; close one or retry later",
            )
        self.watchers += 1
        self.watchers_of[str(who)] += 1
        live: asyncio.Queue[ev.Event] = asyncio.Queue(WATCH_BUFFER)
        overflow = asyncio.Event()

        def on_event(e: ev.Event) -> None:
            try:
                live.put_nowait(e)
            except asyncio.QueueFull:
                overflow.set()

        if request.follow:
            journal.subscribers.append(on_event)
        try:
            nxt = await self._history(journal, request.since_seq + 1, context)
            if request.follow:
                await self._follow(journal, live, overflow, nxt, context)
        finally:
            self.watchers -= 1
            self.watchers_of[str(who)] -= 1
            if self.watchers_of[str(who)] <= 0:
                del self.watchers_of[str(who)]
            if on_event in journal.subscribers:
                journal.subscribers.remove(on_event)

    async def _history(self, journal: Journal, nxt: int, context: grpc.aio.ServicerContext) -> int:
        """Stream the recorded events from `nxt` (exact key ranges, one page at a time);
        the seq after the last one sent."""
        last = journal.state.last_seq
        while nxt <= last:
            try:
                chunk = await aio.wait_for(
                    journal.log.read(nxt, min(last, nxt + READ_CHUNK - 1)),
                    self._read_timeout_s,
                )
            except (TimeoutError, EventLogError) as err:
                await abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"reading the event log failed: {err!r}",
                )
            if not chunk:
                break
            for one in chunk:
                await context.write(dpb.WatchEventsResponse(event=one))
            nxt = chunk[-1].seq + 1
        return nxt

    async def _follow(
        self,
        journal: Journal,
        live: asyncio.Queue[ev.Event],
        overflow: asyncio.Event,
        nxt: int,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Stream what the journal records from now on (ends on cancel, on falling behind,
        or when this driver steps down)."""
        while True:
            if overflow.is_set():
                await abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this watcher fell {WATCH_BUFFER} events behind; watch again with "
                    f"--since {nxt - 1}",
                )
            e = await live.get()
            if e.seq < nxt:
                continue  # already sent from history
            if e.seq > nxt:  # recorded before we subscribed ... after our last page
                for one in await journal.log.read(nxt, e.seq - 1):
                    await context.write(dpb.WatchEventsResponse(event=one))
            await context.write(dpb.WatchEventsResponse(event=e))
            nxt = e.seq + 1
            if self._lead.journal is not journal:
                await abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"driver {self._lead.driver_id} stepped down; watch the new leader from "
                    f"--since {nxt - 1}",
                    trailing_metadata=((channel.LEADER_KEY, self._lead.address),),
                )

    # ------------------------------------------------------------ resume
    async def Resume(
        self, request: dpb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ResumeResponse:
        """A failed or stuck job gets a new incident with a fresh restore budget."""
        journal = await self._journal(context)
        if not journal.decider.recovers:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"driver {self._lead.driver_id} does not run job {self._lead.job_id}'s recovery "
                "(it was started without --nodes): restart the job's workers with its launcher",
            )
        before = journal.state.phase
        why = machine.resumable(before)
        if why:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, why)
        action = ev.Event(
            event_id=new_event_id(),
            cause="operator",
            operator_action=ev.OperatorAction(
                action=machine.RESUME,
                target=request.reason[:512] or "operator",
                who=who(context),
            ),
        )
        try:
            stored = await journal.observe(action, self._read_timeout_s)
        except (EventLogError, TimeoutError) as e:
            await abort(
                context, grpc.StatusCode.UNAVAILABLE, f"recording the resume failed: {e!r}; retry"
            )
        seq = min((e.seq for e in stored), default=journal.state.last_seq)
        log.warning("job resumed by operator", was=ev.Phase.Name(before), seq=seq)
        return dpb.ResumeResponse(
            seq=seq,
            from_phase=ev.Phase.Name(before),
            phase=ev.Phase.Name(journal.state.phase),
        )

    # ------------------------------------------------------------ evict
    async def Evict(
        self, request: dpb.EvictRequest, context: grpc.aio.ServicerContext
    ) -> dpb.EvictResponse:
        node_id = request.node_id
        if not node_id or len(node_id) > MAX_NODE_ID:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node_id must be 1-{MAX_NODE_ID} characters, got {node_id[:MAX_NODE_ID]!r}",
            )
        journal = await self._journal(context)
        state = journal.state
        rec = state.nodes.get(node_id)
        if (
            rec is None
            and node_id not in self.view.nodes
            and node_id not in self._lead.rendezvous_nodes()
        ):
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"node {node_id!r} is not part of job {self._lead.job_id} (no agent registered "
                "it and no torchrun agent of that node id called the rendezvous lately); "
                "`unbroken nodes` and `unbroken events` list them",
            )
        if rec is not None and rec.state == ev.NODE_STATE_EVICTED:
            await abort(
                context, grpc.StatusCode.FAILED_PRECONDITION, f"node {node_id!r} is already evicted"
            )
        reason = request.reason[:512] or "operator"
        action = ev.Event(
            event_id=new_event_id(),
            cause="operator",
            operator_action=ev.OperatorAction(
                action=EVICT, target=node_id, who=who(context), reason=reason
            ),
        )
        try:  # the decider decides (driver/decider.py): the recovery loop pauses, evicts,
            # takes a spare or shrinks and restores; without one the node is out at once
            stored = await journal.observe(action, self._read_timeout_s)
        except (EventLogError, TimeoutError) as e:
            await abort(
                context, grpc.StatusCode.UNAVAILABLE, f"recording the eviction failed: {e!r}; retry"
            )
        seq = max(e.seq for e in stored) if stored else journal.state.last_seq
        out_now = any(e.node_evicted.node_id == node_id for e in stored)
        notified = await self._tell_evicted(node_id, reason, context) if out_now else False
        log.warning("node evicted by operator", node=node_id, reason=reason, seq=seq)
        return dpb.EvictResponse(
            seq=seq, agent_notified=notified, recovering=journal.decider.recovers
        )

    async def _tell_evicted(
        self, node_id: str, reason: str, context: grpc.aio.ServicerContext
    ) -> bool:
        """Tell an evicted node's agent to stop (it exits: no NodeLost follows); whether it
        acknowledged within the caller's deadline."""
        slot = self.view.nodes.get(node_id)
        if slot is None or slot.outbox is None:
            return False
        self.view.mark_leaving(node_id)
        try:
            reply = await self._cmd.request(
                node_id,
                dpb.DriverMessage(evict=dpb.Evict(reason=reason)),
                within_deadline(context, self._diagnose_config.ack_timeout_s),
            )
            return reply.ack.ok
        except (TimeoutError, KeyError) as e:
            log.warning("evicted node's agent did not acknowledge", node=node_id, error=str(e))
            return False

    # ------------------------------------------------------------ clear
    async def ClearNode(
        self, request: dpb.ClearNodeRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ClearNodeResponse:
        """An operator clears a node the cluster scheduler holds out of service."""
        node_id = request.node_id
        if not node_id or len(node_id) > MAX_NODE_ID:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node_id must be 1-{MAX_NODE_ID} characters, got {node_id[:MAX_NODE_ID]!r}",
            )
        journal = await self._journal(context)
        bridge = self._lead.bridge
        if bridge is None:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "this driver runs without a cluster scheduler (--scheduler none): there is "
                "nothing to clear; `unbroken slurm resume --direct NODE` resumes a Slurm node "
                "without a driver",
            )
        action = ev.Event(
            event_id=new_event_id(),
            cause="operator",
            operator_action=ev.OperatorAction(
                action="clear", target=node_id, who=who(context) + (" (force)" * request.force)
            ),
        )
        try:
            await journal.record(action, wait_s=self._read_timeout_s)
        except (EventLogError, TimeoutError) as e:
            await abort(
                context, grpc.StatusCode.UNAVAILABLE, f"recording the clearing failed: {e!r}; retry"
            )
        answer = await bridge.clear(node_id, force=request.force, cause=action.event_id)
        call = answer.scheduler_call
        if not call.ok:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{call.scheduler} did not resume {node_id}: {call.detail}",
            )
        log.warning("node cleared by operator", node=node_id, answer=call.detail)
        return dpb.ClearNodeResponse(seq=answer.seq, answer=call.detail, scheduler=call.scheduler)

    # ------------------------------------------------------------ diagnose
    async def Diagnose(
        self, request: dpb.DiagnoseRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        journal = await self._journal(context)
        cfg = await self._diagnose_settings(request, context)
        if self.diagnosis_running:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"diagnosis {self.diagnosis_running} is already running; wait for its verdict "
                "(`unbroken events --follow` shows it)",
            )
        nodes = await self._diagnose_nodes(list(request.node_ids), context)
        did = uuid.uuid4().hex[:12]
        queue: asyncio.Queue[dpb.DiagnoseResponse | BaseException] = asyncio.Queue(DIAGNOSE_QUEUE)

        def put(item: dpb.DiagnoseResponse | BaseException) -> None:
            with contextlib.suppress(asyncio.QueueFull):  # a stuck watcher loses progress only
                queue.put_nowait(item)

        def progress(index: int, total: int, done: int) -> None:
            put(
                dpb.DiagnoseResponse(
                    progress=dpb.DiagnoseProgress(round=index, groups_total=total, groups_done=done)
                )
            )

        async def job() -> None:
            try:
                d = await run_diagnosis(
                    self._cmd,
                    journal.record,
                    nodes,
                    config=cfg,
                    diagnosis_id=did,
                    who=who(context),
                    on_started=lambda s: put(dpb.DiagnoseResponse(started=s)),
                    on_progress=progress,
                    on_round=lambda r: put(dpb.DiagnoseResponse(round=r)),
                )
                put(dpb.DiagnoseResponse(verdict=verdict_event(d)))
            except Exception as e:
                log.exception("diagnosis failed", diagnosis_id=did)
                put(e)
            finally:
                self.diagnosis_running = ""

        self.diagnosis_running = did
        self._diagnosis_task = asyncio.create_task(job())
        while True:
            item = await queue.get()
            if isinstance(item, DiagnoseError):
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(item))
            if isinstance(item, BaseException):
                await abort(
                    context,
                    grpc.StatusCode.INTERNAL,
                    f"diagnosis {did} failed: {item!r}; see driver log",
                )
            assert isinstance(item, dpb.DiagnoseResponse)
            await context.write(item)
            if item.WhichOneof("kind") == "verdict":
                return

    async def _diagnose_settings(
        self, request: dpb.DiagnoseRequest, context: grpc.aio.ServicerContext
    ) -> DriverDiagnoseConfig:
        base = self._diagnose_config
        try:
            runner = base.runner
            if request.round_timeout_s:
                runner = replace(runner, round_timeout_s=request.round_timeout_s)
            return DriverDiagnoseConfig(
                runner=runner,
                check_timeout_s=request.check_timeout_s or base.check_timeout_s,
                reply_slack_s=base.reply_slack_s,
                matmul_iters=base.matmul_iters,
                ack_timeout_s=base.ack_timeout_s,
            )
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _diagnose_nodes(
        self, asked: list[str], context: grpc.aio.ServicerContext
    ) -> list[str]:
        if len(set(asked)) != len(asked):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node_ids has duplicates: {sorted(asked)}",
            )
        if not asked:
            nodes = sorted(n for n, s in self.view.nodes.items() if s.alive and s.outbox)
        else:
            for n in asked:
                if n not in self.view.nodes:
                    await abort(
                        context,
                        grpc.StatusCode.NOT_FOUND,
                        f"node {n[:MAX_NODE_ID]!r} is not known to this driver; "
                        "`unbroken nodes` lists them",
                    )
                slot = self.view.nodes[n]
                if not (slot.alive and slot.outbox is not None):
                    await abort(
                        context,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"node {n!r} has no open stream (lost or disconnected); "
                        "leave it out of --nodes",
                    )
            nodes = list(asked)
        if len(nodes) < 2:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a diagnosis needs at least 2 connected nodes, got {nodes}; "
                "start more agents or name more --nodes",
            )
        return nodes

    # ------------------------------------------------------------ self-checks, faults
    def on_self_check(self, node_id: str, rep: dpb.SelfCheckReport) -> str:
        """Queue a node's self-check report as SelfCheckReported; return its command id.

        The machine treats ok=false on a world node as a fault and marks a failing spare
        bad (driver/machine.py).
        """
        self._cmd.emit(
            ev.Event(
                cause="self-check",
                self_check_reported=ev.SelfCheckReported(
                    node_id=node_id,
                    ok=rep.ok,
                    failures=[f[:500] for f in rep.failures[:32]],
                    details_json=rep.details_json[:MAX_DETAILS_JSON],
                    trigger="on demand" if rep.command_id else "registration",
                ),
            )
        )
        return rep.command_id

    async def _connected_nodes(
        self, asked: list[str], context: grpc.aio.ServicerContext
    ) -> list[str]:
        """`asked` (or every connected node when empty), each known and connected."""
        if not asked:
            nodes = sorted(n for n, s in self.view.nodes.items() if s.alive and s.outbox)
            if not nodes:
                await abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "no node is connected to this driver; start agents first",
                )
            return nodes
        for n in asked:
            slot = self.view.nodes.get(n)
            if slot is None:
                await abort(
                    context,
                    grpc.StatusCode.NOT_FOUND,
                    f"node {n[:MAX_NODE_ID]!r} is not known to this driver; "
                    "`unbroken nodes` lists them",
                )
            assert slot is not None
            if not (slot.alive and slot.outbox is not None):
                await abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"node {n!r} has no open stream (lost or disconnected); "
                    "`unbroken nodes` shows which are connected",
                )
        return list(dict.fromkeys(asked))

    async def RunSelfCheck(
        self, request: dpb.RunSelfCheckRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RunSelfCheckResponse:
        journal = await self._journal(context)
        if request.timeout_s < 0:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout_s must be >= 0 (0: {SELFCHECK_TIMEOUT_S:g} s), got {request.timeout_s}",
            )
        nodes = await self._connected_nodes(list(request.node_ids), context)
        timeout = request.timeout_s or SELFCHECK_TIMEOUT_S
        try:
            await journal.record(
                ev.Event(
                    cause="operator",
                    operator_action=ev.OperatorAction(
                        action="selfcheck", target=",".join(nodes), who=who(context)
                    ),
                ),
                wait_s=self._read_timeout_s,
            )
        except (EventLogError, TimeoutError) as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"appending the request failed: {e}")

        async def one(n: str) -> dpb.NodeSelfCheck:
            msg = dpb.DriverMessage(run_self_check=dpb.RunSelfCheck(timeout_s=timeout))
            try:
                reply = await self._cmd.request(n, msg, timeout + SELFCHECK_SLACK_S)
            except TimeoutError:
                return dpb.NodeSelfCheck(
                    node_id=n, error=f"no report within {timeout + SELFCHECK_SLACK_S:g} s"
                )
            except KeyError as e:
                return dpb.NodeSelfCheck(node_id=n, error=f"not connected: {e}")
            if reply.WhichOneof("kind") != "self_check_report":
                return dpb.NodeSelfCheck(node_id=n, error=reply.ack.detail or "the agent refused")
            r = reply.self_check_report
            return dpb.NodeSelfCheck(
                node_id=n, ok=r.ok, failures=r.failures, details_json=r.details_json
            )

        results = await asyncio.gather(*(one(n) for n in nodes))
        log.info(
            "self-checks run on demand",
            nodes=nodes,
            failed=[r.node_id for r in results if not r.ok],
        )
        return dpb.RunSelfCheckResponse(results=results)

    async def InjectFault(
        self, request: dpb.InjectFaultRequest, context: grpc.aio.ServicerContext
    ) -> dpb.InjectFaultResponse:
        if not self._allow_fault_injection:
            await abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                "fault injection is off on this driver: start it with --allow-fault-injection "
                "(`unbroken up` does) to run drills",
            )
        journal = await self._journal(context)
        try:
            f = RuntimeFault.of(request.kind, request.local_rank, request.factor, request.step)
        except ValueError as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not request.node_id:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "node_id is empty; `unbroken nodes` lists them",
            )
        (node_id,) = await self._connected_nodes([request.node_id], context)
        what = f.kind + (f" rank={f.local_rank}" if f.kind in ("crash", "hang") else "")
        what += f" factor={f.factor or 2.0:g}" if f.kind == "slow" else ""
        what += f" step={f.step}" if f.step else ""
        try:
            (action,) = await journal.record(
                ev.Event(
                    cause=f"inject {what}",
                    operator_action=ev.OperatorAction(
                        action="inject", target=node_id, who=who(context)
                    ),
                ),
                wait_s=self._read_timeout_s,
            )
        except (EventLogError, TimeoutError) as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"appending the request failed: {e}")
        msg = dpb.DriverMessage(
            inject_fault=dpb.InjectFault(
                kind=f.kind,
                local_rank=f.local_rank,
                factor=f.factor,
                step=f.step,
                sdc=request.sdc if request.HasField("sdc") else None,
            )
        )
        try:
            reply = await self._cmd.request(
                node_id, msg, within_deadline(context, self._diagnose_config.ack_timeout_s)
            )
        except (TimeoutError, KeyError) as e:
            detail = f"the agent did not acknowledge ({type(e).__name__}: {e})"
            return dpb.InjectFaultResponse(seq=action.seq, ok=False, detail=detail)
        log.warning("fault injected", node=node_id, fault=what, ok=reply.ack.ok)
        return dpb.InjectFaultResponse(seq=action.seq, ok=reply.ack.ok, detail=reply.ack.detail)
