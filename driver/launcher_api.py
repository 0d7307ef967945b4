"""The launcher API of the driver: register a job, report a failure, list and request checkpoints.

Launchers that start their own workers (torchrun, srun, Kubernetes operators, in any
language) and operator tools use these RPCs next to the operator ones (status, nodes,
events, evict, diagnose in driver/operator.py); `LauncherApi` is its own handler object,
and like those calls only the leader answers.

- `RegisterJob` appends JobStarted (+ TrainingResumed at step 0) for a job whose workers a
  launcher runs; a driver that starts the job itself (`--nodes`) refuses it.
- `ReportFailure` turns a launcher's "worker/node failed" into the WorkerFailed / NodeLost
  event a detector would have produced (cause "launcher"). It is an observation for the
  term's journal, so the recovery loop (when on) decides on it like on any detector event;
  the call returns once the event is durable.
- `ListCheckpoints` joins the folded state's committed checkpoints with their events
  (time, ranks, checksum), the storage's per-rank shard files (read under a deadline; a
  store the driver cannot reach leaves them out and says why) and each agent's newest
  verified shard (reports seen by this driver since it took over).
- `RequestCheckpoint` sends FlashSave(step) to every world node, where `step` is a little
  ahead of the newest step any worker reported, so every rank saves the same step; the
  agents persist it and report the shards, and the driver commits it like any other step.
  With `wait` the call follows the journal until that CheckpointCommitted (or a later one).
"""

from __future__ import annotations

import asyncio
import json
import os
import posixpath
import re
import time
from typing import TYPE_CHECKING

import grpc
import structlog

from unbroken.common import aio
from unbroken.driver.detectors import node_id_problem
from unbroken.driver.eventlog import EventLogError, new_event_id
from unbroken.driver.journal import Journal
from unbroken.driver.leadership import Commands, Leadership
from unbroken.driver.liveview import LiveView
from unbroken.driver.rpc import abort
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:  # commits.py imports recovery (torch): keep the CLI's imports light
    from unbroken.driver.commits import Commits
    from unbroken.driver.config import ServiceConfig

log = structlog.get_logger(__name__)

MAX_ID = 128  # node ids, trainer names
MAX_NODES = 100_000
MAX_CONFIG_JSON = 64 * 1024
MAX_LOCAL_RANK = 4096
MAX_LEAD_STEPS = 1_000_000
MAX_WAIT_S = 3600.0
REPORT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_WAIT_S = 120.0
DEFAULT_LEAD_STEPS = 2  # heartbeats show a step up to ~1 interval old; commands take a hop
ACTIVE_DONE = (ev.PHASE_FINISHED, ev.PHASE_FAILED)
RECOVERING = (
    ev.PHASE_SUSPECTED,
    ev.PHASE_PAUSED,
    ev.PHASE_DIAGNOSED,
    ev.PHASE_RESHAPED,
    ev.PHASE_RESTORING,
)


def job_problem(req: dpb.RegisterJobRequest) -> str:
    """What is wrong with a RegisterJob request ("" when nothing). Pure."""
    w = req.world
    ids = list(w.node_ids)
    if not ids:
        return "world.node_ids is empty: name the job's nodes in rank order"
    if len(ids) > MAX_NODES:
        return f"world.node_ids has {len(ids)} nodes, more than {MAX_NODES}"
    bad = [n for n in ids if not n or len(n) > MAX_ID]
    if bad:
        return f"world.node_ids must be 1-{MAX_ID} characters each, got {bad[0][:MAX_ID]!r}"
    # a node id is one plain name: `n[1-64]` or `a,b` is a Slurm hostlist naming many nodes
    wrong = next((p for p in map(node_id_problem, ids) if p), "")
    if wrong:
        return f"world.{wrong}"
    if len(set(ids)) != len(ids):
        dup = sorted({n for n in ids if ids.count(n) > 1})
        return f"world.node_ids has duplicates: {dup[:5]}"
    if w.workers_per_node < 1:
        return "world.workers_per_node must be >= 1 (processes per node)"
    ranks = len(ids) * w.workers_per_node
    pp, tp = w.pp or 1, w.tp or 1
    dp = w.dp or ranks // (pp * tp)
    if dp * pp * tp != ranks:
        return (
            f"world dp x pp x tp = {dp} x {pp} x {tp} = {dp * pp * tp} but nodes x "
            f"workers_per_node = {len(ids)} x {w.workers_per_node} = {ranks}; make them equal"
        )
    lo, hi = req.min_nodes or 1, req.max_nodes or len(ids)
    if not lo <= len(ids) <= hi:
        return f"need min_nodes <= len(world.node_ids) <= max_nodes, got {lo} <= {len(ids)} <= {hi}"
    if len(req.trainer) > MAX_ID:
        return f"trainer must be at most {MAX_ID} characters"
    if len(req.config_json) > MAX_CONFIG_JSON:
        return f"config_json is {len(req.config_json)} bytes, over {MAX_CONFIG_JSON}"
    if req.config_json:
        try:
            json.loads(req.config_json)
        except ValueError as e:
            return f"config_json is not valid JSON: {e}"
    return ""


def normalized_world(req: dpb.RegisterJobRequest) -> ev.WorldLayout:
    """The request's world with dp/pp/tp defaults filled in (after `job_problem`)."""
    w = ev.WorldLayout()
    w.CopyFrom(req.world)
    w.pp, w.tp = w.pp or 1, w.tp or 1
    w.dp = w.dp or len(w.node_ids) * w.workers_per_node // (w.pp * w.tp)
    return w


def report_event_id(report_id: str) -> str:
    """The event id of a launcher report with an idempotency key (the exactly-once key)."""
    return f"launcher-{report_id}"


def failure_event(
    req: dpb.ReportFailureRequest, state: ev.JobState, view: LiveView, now: float
) -> ev.Event:
    """The WorkerFailed / NodeLost event for a (validated) launcher report. Pure."""
    eid = report_event_id(req.report_id) if req.report_id else new_event_id()
    if req.kind == dpb.FAILURE_KIND_WORKER:
        return ev.Event(
            event_id=eid,
            cause="launcher",
            worker_failed=ev.WorkerFailed(
                node_id=req.node_id,
                local_rank=req.local_rank,
                global_rank=req.global_rank,
                exit_code=req.exit_code,
                last_step=req.last_step,
            ),
        )
    rec = state.nodes.get(req.node_id)
    slot = view.nodes.get(req.node_id)
    silent = (now - slot.last_seen) * 1000.0 if slot is not None and slot.last_seen else 0.0
    return ev.Event(
        event_id=eid,
        cause="launcher",
        node_lost=ev.NodeLost(
            node_id=req.node_id,
            epoch=rec.epoch if rec is not None else 0,
            silent_ms=silent,
            reason=f"launcher: {req.reason[:400]}" if req.reason else "reported by the launcher",
        ),
    )


class PrunedError(Exception):
    """The step's directory is gone while the storage root is there: retention removed it."""


def outside_roots(uri: str, roots: tuple[str, ...]) -> str:
    """Why the driver will not open `uri` ("" when it may): only under the configured
    persist roots, or, with none configured, only local paths (an agent-reported URI must
    not make the driver connect anywhere)."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "file", uri
    path = posixpath.normpath(rest) if scheme == "file" else rest
    if ".." in path.split("/"):
        return f"{uri[:200]!r} climbs out of its folder ('..'): not listed"
    if not roots:
        if scheme != "file":
            return (
                f"{uri[:200]!r} is not a local path and the driver has no --persist-root: "
                "shards not listed"
            )
        return ""
    for root in roots:
        r_scheme, r_sep, r_rest = root.partition("://")
        if not r_sep:
            r_scheme, r_rest = "file", root
        r_path = posixpath.normpath(r_rest) if r_scheme == "file" else r_rest.rstrip("/")
        if r_scheme == scheme and (path == r_path or path.startswith(r_path.rstrip("/") + "/")):
            return ""
    return f"{uri[:200]!r} is outside the driver's --persist-root: shards not listed"


def list_shards(uri: str) -> list[dpb.ShardInfo]:
    """Every rank's shard file in a step directory (blocking: run it in a thread).

    Raises:
        PrunedError: the step directory is gone but its parent (the storage root) exists.
        OSError: the storage cannot be listed.
    """
    import fsspec  # only the checkpoint listing needs it

    fs, path = fsspec.core.url_to_fs(uri)
    proto = uri.split("://")[0] + "://" if "://" in uri else ""
    out = []
    try:
        listed = fs.ls(path, detail=True)
    except FileNotFoundError as e:
        if fs.exists(path.rstrip("/").rsplit("/", 1)[0]):
            raise PrunedError(uri) from e
        raise
    for f in listed:
        name = os.path.basename(str(f["name"]))
        if name.startswith("rank-") and name.endswith(".ubf"):
            rank = name.removeprefix("rank-").removesuffix(".ubf")
            if rank.isdigit():
                out.append(
                    dpb.ShardInfo(
                        rank=int(rank), uri=proto + str(f["name"]), bytes=int(f.get("size") or 0)
                    )
                )
    return sorted(out, key=lambda s: s.rank)


def rank_nodes(by_node: dict[str, dict[int, int]], step: int) -> dict[int, str]:
    """rank -> the node that reported its shard of `step` (else its newest shard). Pure."""
    out: dict[int, tuple[bool, int, str]] = {}
    for node, ranks in by_node.items():
        for rank, s in ranks.items():
            key = (s == step, s, node)
            if rank not in out or key > out[rank]:
                out[rank] = key
    return {r: k[2] for r, k in out.items()}


class LauncherApi:
    """Launcher RPCs: register a job, report a failure, list and request checkpoints.

    Args:
        lead: who leads (the journal of the current term).
        commands: the agent sessions (request) and the live view.
        commits: the verified shards agents reported (for ListCheckpoints).
        config: deadlines.
    """

    def __init__(
        self, lead: Leadership, commands: Commands, commits: Commits, config: ServiceConfig
    ) -> None:
        self._lead = lead
        self._cmd = commands
        self.commits = commits
        self._read_timeout_s = config.read_timeout_s
        self._diagnose_config = config.diagnose
        self._persist_roots = config.persist_roots
        self._register_job_lock = asyncio.Lock()  # RegisterJob's check-then-record

    @property
    def view(self) -> LiveView:
        return self._cmd.view

    async def _journal(self, context: grpc.aio.ServicerContext) -> Journal:
        return await self._lead.require(context)

    def _who(self, context: grpc.aio.ServicerContext) -> str:
        from unbroken.driver.operator import who

        return who(context)

    # ------------------------------------------------------------ RegisterJob
    async def RegisterJob(
        self, request: dpb.RegisterJobRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RegisterJobResponse:
        journal = await self._journal(context)
        problem = job_problem(request)
        if problem:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        if journal.decider.recovers:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"driver {self._lead.driver_id} starts and recovers job {self._lead.job_id} itself "
                "(--nodes); RegisterJob is for launchers that start their own workers: run "
                "the driver without --nodes",
            )
        # one RegisterJob at a time: the check below and the record must not interleave
        async with self._register_job_lock:
            return await self._register_job(request, journal, context)

    async def _register_job(
        self,
        request: dpb.RegisterJobRequest,
        journal: Journal,
        context: grpc.aio.ServicerContext,
    ) -> dpb.RegisterJobResponse:
        state = journal.state
        if state.event_counts["job_started"] and state.phase not in ACTIVE_DONE:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {self._lead.job_id} is already active ({state.trainer or 'unnamed'} on "
                f"{len(state.world.node_ids)} nodes, phase "
                f"{ev.Phase.Name(state.phase).removeprefix('PHASE_').lower()}); one driver "
                "runs one job: finish it first or start a driver with another --job-id",
            )
        world = normalized_world(request)
        started = ev.Event(
            event_id=new_event_id(),
            cause="launcher",
            job_started=ev.JobStarted(
                trainer=request.trainer or "external",
                world=world,
                min_nodes=request.min_nodes or 1,
                max_nodes=request.max_nodes or len(world.node_ids),
                config_json=request.config_json,
            ),
        )
        resumed = ev.Event(cause=started.event_id, training_resumed=ev.TrainingResumed(world=world))
        try:
            started, _ = await journal.record(started, resumed, wait_s=self._read_timeout_s)
        except (EventLogError, TimeoutError) as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"recording JobStarted failed: {e}")
        log.info(
            "job registered by a launcher",
            trainer=request.trainer,
            nodes=len(world.node_ids),
            who=self._who(context),
        )
        return dpb.RegisterJobResponse(job_id=self._lead.job_id, seq=started.seq)

    # ------------------------------------------------------------ ReportFailure
    async def ReportFailure(
        self, request: dpb.ReportFailureRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ReportFailureResponse:
        journal = await self._journal(context)
        node = request.node_id
        if request.kind not in (dpb.FAILURE_KIND_WORKER, dpb.FAILURE_KIND_NODE):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "kind must be FAILURE_KIND_WORKER (one worker failed) or FAILURE_KIND_NODE "
                "(the node is gone)",
            )
        if not node or len(node) > MAX_ID or node_id_problem(node):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                node_id_problem(node)
                or f"node_id must be 1-{MAX_ID} characters, got {node[:MAX_ID]!r}",
            )
        if request.local_rank > MAX_LOCAL_RANK:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"local_rank {request.local_rank} is over {MAX_LOCAL_RANK}",
            )
        if len(request.reason) > 512:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "reason is over 512 characters")
        if request.report_id and not REPORT_ID.fullmatch(request.report_id):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "report_id must be 1-64 characters of A-Z, a-z, 0-9, '_' and '-' "
                f"(an idempotency key), got {request.report_id[:64]!r}",
            )
        if request.report_id:
            try:
                seen = await aio.wait_for(
                    journal.log.find(report_event_id(request.report_id)), self._read_timeout_s
                )
            except (EventLogError, TimeoutError) as e:
                await abort(context, grpc.StatusCode.UNAVAILABLE, f"looking up report_id: {e!r}")
            if seen is not None:  # a retry of a report that is already in the log
                return dpb.ReportFailureResponse(
                    seq=seen.seq, event_kind=seen.WhichOneof("payload") or ""
                )
        state = journal.state
        rec = state.nodes.get(node)
        if rec is None and node not in state.world.node_ids and node not in self.view.nodes:
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"node {node!r} is not part of job {self._lead.job_id} (neither registered by an "
                "agent nor in the world of RegisterJob); `unbroken nodes` lists them",
            )
        if rec is not None and rec.state == ev.NODE_STATE_EVICTED:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node!r} is already evicted; its failures no longer count",
            )
        event = failure_event(request, state, self.view, time.monotonic())
        try:
            recorded = await journal.observe(event, self._read_timeout_s)
        except (EventLogError, TimeoutError) as e:
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"the report was not durable within {self._read_timeout_s:g} s ({e!r}); it "
                "stays queued: report it again with the same report_id (is etcd reachable "
                "from the driver? see its log)",
            )
        stored = next((e for e in recorded if e.event_id == event.event_id), None)
        if stored is None:  # it had landed before (a retry): read it back
            stored = await journal.log.find(event.event_id) or event
        kind = stored.WhichOneof("payload") or ""
        log.warning("failure reported by a launcher", node=node, kind=kind, seq=stored.seq)
        return dpb.ReportFailureResponse(seq=stored.seq, event_kind=kind)

    # ------------------------------------------------------------ ListCheckpoints
    async def ListCheckpoints(
        self, request: dpb.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> dpb.ListCheckpointsResponse:
        journal = await self._journal(context)
        elog = journal.log
        state = journal.state
        out = dpb.ListCheckpointsResponse(verified_steps=list(state.verified_steps))
        records = list(state.checkpoints)

        async def event_of(seq: int) -> ev.Event | None:
            got = await elog.read(seq, seq)
            return got[0] if got else None

        try:
            events = await aio.wait_for(
                asyncio.gather(*(event_of(r.seq) for r in records)), self._read_timeout_s
            )
        except (TimeoutError, EventLogError) as e:
            await abort(
                context, grpc.StatusCode.UNAVAILABLE, f"reading the checkpoint events failed: {e!r}"
            )
        by_node = {n: dict(r) for n, r in self.commits.by_node.items()}
        for rec, one in zip(records, events, strict=True):
            info = out.checkpoints.add(
                step=rec.step, seq=rec.seq, uri=rec.uri, bytes=rec.bytes, verified=rec.verified
            )
            if one is not None and one.WhichOneof("payload") == "checkpoint_committed":
                info.wall_time_unix_ns = one.wall_time_unix_ns
                info.ranks = one.checkpoint_committed.ranks
                info.checksum = one.checkpoint_committed.checksum
            if request.skip_shards:
                continue
            outside = outside_roots(rec.uri, self._persist_roots)
            if outside:
                info.shards_error = outside
                continue
            try:
                shards = await aio.wait_for(
                    asyncio.to_thread(list_shards, rec.uri), self._read_timeout_s
                )
            except PrunedError:
                info.pruned = True
                continue
            except (OSError, TimeoutError, ValueError) as err:
                info.shards_error = f"cannot list {rec.uri} from the driver: {err!r}"[:500]
                continue
            nodes = rank_nodes(by_node, rec.step)
            for s in shards:
                s.node_id = nodes.get(s.rank, "")
            info.shards.extend(shards)
        names = set(by_node) | set(state.world.node_ids)
        names |= {n for n, s in self.view.nodes.items() if s.hb.workers}
        for n in sorted(names):
            ranks = by_node.get(n, {})
            slot = self.view.nodes.get(n)
            live = max((w.step for w in slot.hb.workers), default=0) if slot is not None else 0
            out.nodes.add(
                node_id=n,
                persisted_step=max(ranks.values(), default=0),
                ranks=sorted(ranks),
                live_step=live,
            )
        return out

    # ------------------------------------------------------------ RequestCheckpoint
    async def RequestCheckpoint(
        self, request: dpb.RequestCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RequestCheckpointResponse:
        journal = await self._journal(context)
        nodes, target = await self._checkpoint_plan(request, journal.state, context)
        committed: asyncio.Future[ev.Event] = asyncio.get_running_loop().create_future()

        def on_event(e: ev.Event) -> None:
            if (
                e.WhichOneof("payload") == "checkpoint_committed"
                and e.checkpoint_committed.step >= target
                and not committed.done()
            ):
                committed.set_result(e)

        journal.subscribers.append(on_event)  # before FlashSave: no commit goes unseen
        try:
            try:
                (action,) = await journal.record(
                    ev.Event(
                        cause="operator",
                        operator_action=ev.OperatorAction(
                            action="checkpoint", target=f"step {target}", who=self._who(context)
                        ),
                    ),
                    wait_s=self._read_timeout_s,
                )
            except (EventLogError, TimeoutError) as e:
                await abort(
                    context, grpc.StatusCode.UNAVAILABLE, f"recording the request failed: {e}"
                )
            errors = await self._flash_save_all(nodes, target)
            if errors:
                await abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "FlashSave was not accepted by "
                    + "; ".join(f"{n}: {e}" for n, e in sorted(errors.items())[:10])
                    + " (the node's agent must run workers)",
                )
            resp = dpb.RequestCheckpointResponse(step=target, node_ids=nodes, seq=action.seq)
            log.info("checkpoint requested", step=target, nodes=len(nodes), seq=action.seq)
            if not request.wait:
                return resp
            wait_s = request.timeout_s or DEFAULT_WAIT_S
            try:
                got = await aio.wait_for(asyncio.shield(committed), wait_s)
                resp.committed_step = got.checkpoint_committed.step
                resp.uri = got.checkpoint_committed.uri
                return resp
            except TimeoutError:
                pass
        finally:
            if on_event in journal.subscribers:
                journal.subscribers.remove(on_event)
        await abort(
            context,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no checkpoint at step >= {target} was committed within {wait_s:g} s: every "
            "rank must save on FlashSave (the hooks SDK's should_save, or a flash save every "
            "step) and its agent persist it; `unbroken checkpoints` shows what each node "
            "persisted",
        )

    async def _checkpoint_plan(
        self,
        request: dpb.RequestCheckpointRequest,
        state: ev.JobState,
        context: grpc.aio.ServicerContext,
    ) -> tuple[list[str], int]:
        """The nodes that save and the step they save at, or the call ends saying why the
        request cannot be served now."""
        if not 0 <= request.timeout_s <= MAX_WAIT_S:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout_s must be in [0, {MAX_WAIT_S:g}] (0: {DEFAULT_WAIT_S:g} s), "
                f"got {request.timeout_s}",
            )
        if request.lead_steps > MAX_LEAD_STEPS:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lead_steps must be at most {MAX_LEAD_STEPS}, got {request.lead_steps}",
            )
        phase = ev.Phase.Name(state.phase).removeprefix("PHASE_").lower()
        if state.phase in RECOVERING or state.phase in ACTIVE_DONE:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {self._lead.job_id} is {phase}; a checkpoint can be requested only while it "
                "trains (`unbroken status` shows the phase)",
            )
        nodes = self._checkpoint_nodes(state)
        if not nodes:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "no node runs workers: nothing to checkpoint (`unbroken nodes` shows them)",
            )
        missing = [n for n in nodes if (s := self.view.nodes.get(n)) is None or s.outbox is None]
        if missing:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"world nodes {missing[:10]} have no open stream (lost or disconnected); "
                "wait for the recovery, then ask again",
            )
        live = max(
            (w.step for n in nodes for w in self.view.nodes[n].hb.workers), default=state.step
        )
        target = max(live, state.step) + (request.lead_steps or DEFAULT_LEAD_STEPS)
        return nodes, target

    def _checkpoint_nodes(self, state: ev.JobState) -> list[str]:
        """The world's nodes; without a registered world, every non-spare node with workers."""
        evicted = {n for n, r in state.nodes.items() if r.state == ev.NODE_STATE_EVICTED}
        if state.world.node_ids:
            return [n for n in state.world.node_ids if n not in evicted]
        return sorted(
            n
            for n, s in self.view.nodes.items()
            if s.alive
            and not s.info.spare
            and (s.info.num_workers or s.hb.workers)
            and n not in evicted
        )

    async def _flash_save_all(self, nodes: list[str], step: int) -> dict[str, str]:
        """Send FlashSave(step) to every node; node -> error for those that did not accept."""

        async def one(n: str) -> str:
            try:
                reply = await self._cmd.request(
                    n, dpb.DriverMessage(flash_save=dpb.FlashSave(step=step)), self._ack_s()
                )
            except (KeyError, TimeoutError) as e:
                return f"{type(e).__name__}: {e}"
            return "" if reply.ack.ok else reply.ack.detail[:300] or "refused"

        results = await asyncio.gather(*(one(n) for n in nodes))
        return {n: e for n, e in zip(nodes, results, strict=True) if e}

    def _ack_s(self) -> float:
        return self._diagnose_config.ack_timeout_s
