"""The agents' side of the driver: registration, the session stream, relays, shard reports.

The heartbeat handler is the hot path of the whole system (2,000 nodes x 10/s): per
message it takes one monotonic timestamp, stores the message by reference in the node's
slot and moves the node to the end of the deadline order (driver/liveview.py). Hangs are
judged by the agents and reach the driver only as a heartbeat flag. A relay (an agent that
carries its neighbours' heartbeats in one batch) speaks only for the members that named it
when they registered; a member's shard report through a relay counts only when the member
signed it (common/reportmac.py). Agents' verified-shard reports feed the commit bookkeeping
(driver/commits.py): a step's CheckpointCommitted is emitted once every rank's shard is in.

A driver that is not the leader answers every agent call with UNAVAILABLE and the
leader's address in the `x-unbroken-leader` trailer, so agents move on to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
import structlog

from unbroken.common import aio, channel, reportmac
from unbroken.driver import commits as commits_mod
from unbroken.driver import detectors, paging, principalquota
from unbroken.driver.commits import Commits
from unbroken.driver.config import ServiceConfig
from unbroken.driver.leadership import Leadership
from unbroken.driver.liveview import Group, LiveView, NodeSlot
from unbroken.driver.principalquota import QuotaBook
from unbroken.driver.retention import CheckpointKeeper
from unbroken.driver.rpc import abort
from unbroken.driver.security import caller
from unbroken.driver.sessions import Outbox, RelayOutbox, Sessions
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

RING = 1 << 16  # latency samples kept for p50/p99
MAX_SHARDS_PER_REPORT = 4096  # shards read from one ShardsPersisted (a node's ranks, many steps)
LIVE_VIEW_MAX_PAGE = 10_000  # LiveView page_size cap
RELAYED_BATCH_MAX = 1024  # members' messages read from one RelayedUpBatch (the rest refused)


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


class AgentApi:
    """The agents' RPCs (Register, Session, LiveView) and what their messages feed.

    Args:
        config: the service's (live view, stream buffer, backlog, quotas).
        lead: who leads (its journal; a standby sends agents to the leader).
        view: the live view the heartbeats land in.
        sessions: the agents' command streams.
        commits: the shard bookkeeping behind CheckpointCommitted.
        keeper: the newest torchrun round (whose ranks a node may report).
        emit: hands a detection to the journal (`last_seen`: when the fault began).
        on_self_check: records a self-check report; returns its command id ("": done).
        appended: how many events the driver recorded (LiveStats).
    """

    def __init__(
        self,
        config: ServiceConfig,
        lead: Leadership,
        view: LiveView,
        sessions: Sessions,
        commits: Commits,
        keeper: CheckpointKeeper,
        *,
        emit: Callable[[ev.Event, float], bool],
        on_self_check: Callable[[str, Any], str],
        appended: Callable[[], int],
    ) -> None:
        self.config = config
        self._lead = lead
        self.driver_id = lead.driver_id
        self.job_id = lead.job_id
        self.view = view
        self.sessions = sessions
        self.commits = commits
        self._keeper = keeper
        self._emit = emit
        self._on_self_check = on_self_check
        self._appended = appended
        self.delivery = _Ring()  # heartbeat delivery latency (ms)
        self.handler = _Ring()  # handler time per heartbeat (us)
        self.relayed: dict[str, set[str]] = {}  # relay node id -> members attached through it
        self.relay_refused = 0  # batch entries for nodes that did not name the relay
        self.quotas = QuotaBook(config.quotas)  # registrations and relay members, per principal
        self._told_to_register: set[str] = set()  # relayed nodes sent away (until Register)

    def stats(self) -> dpb.LiveStats:
        """The heartbeat plane's counters and latencies (LiveView, the dashboard)."""
        d50, d99 = self.delivery.percentiles()
        h50, h99 = self.handler.percentiles()
        alive = self.view.alive_count()
        j = self._lead.journal
        return dpb.LiveStats(
            heartbeats=sum(s.heartbeats for s in self.view.nodes.values()),
            nodes_alive=alive,
            nodes_lost=len(self.view.nodes) - alive,
            events_appended=self._appended(),
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

    async def _not_leader(self, context: grpc.aio.ServicerContext) -> NoReturn:
        where = self._lead.address or "unknown yet"
        await abort(
            context,
            grpc.StatusCode.UNAVAILABLE,
            f"driver {self.driver_id} is not the leader; the leader is at {where}",
            trailing_metadata=((channel.LEADER_KEY, self._lead.address),),
        )

    async def Register(
        self, request: dpb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RegisterResponse:
        if not self._lead.leader:
            if caller().is_node(request.node_id) and not detectors.validate_register(request):
                # its agent retries fast until someone leads: if this driver wins, it
                # expects the node back soon (LiveView.await_nodes)
                self.view.asked_for_leader(request.node_id, time.monotonic())
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
        journal = self._lead.journal
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
            self._emit(event, math.nan)
            log.warning("registration refused", node=request.node_id, reason=reason)
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, reason)
        relay = ""
        for k, v in context.invocation_metadata() or ():
            if k == channel.RELAY_KEY:
                relay = str(v)[:128]
        relay = relay if relay != request.node_id else ""
        why, back = self._over_quota(
            str(who) if who.identified else "", request, relay, event is not None, now
        )
        if why:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        if back and event is not None:
            event.cause = principalquota.RETURNED  # not counted, nor by a later term
        slot = self._take(request, event, relay, context.peer(), now)
        term, scope = self._lead.journal.term if self._lead.journal is not None else (0, "")
        return dpb.RegisterResponse(
            driver_id=self.driver_id,
            job_id=self.job_id,
            heartbeat_interval_ms=self.config.live.heartbeat_interval_ms,
            miss_limit=self.config.live.miss_limit,
            leader_term=term,
            term_scope=scope,
            report_key=slot.report_key,
            relay_batches=True,
            closed_timeout_ms=round(self.config.live.closed_timeout_s * 1000),
        )

    def _take(
        self,
        request: dpb.RegisterRequest,
        event: ev.Event | None,
        relay: str,
        peer: str,
        now: float,
    ) -> NodeSlot:
        """The admitted node's slot, as it registered (`event`: a new epoch's
        NodeRegistered, emitted here; None: a reconnect)."""
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
            self._emit(event, math.nan)
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
        slot.peer_host = peer_host(peer)
        if not self.view.tracked(slot):
            self.view.mark_registered(slot, now)
        else:
            self.view.reopened(slot, now)  # back after closing its stream: not lost
        return slot

    def _over_quota(
        self, who: str, request: dpb.RegisterRequest, relay: str, new: bool, now: float
    ) -> tuple[str, bool]:
        """Why `who`'s registration (through `relay`; `new`: a new epoch's event) is past a
        per-principal quota ("": it is not; `who` "": no identified principal), and whether
        it is the node back with a new leader under its logged epoch (never counted)."""
        node_id = request.node_id

        def still(n: str) -> bool:
            m = self.view.nodes.get(n)
            return m is not None and m.relay == relay and m.alive

        why = self.quotas.relay_member(node_id, relay, still)
        back = False
        if not why:
            back = self.quotas.returning(node_id, request.epoch)
            if new and who and not back:
                why = self.quotas.registration(who, now)
        if why:
            log.warning("registration over quota", node=node_id, reason=why)
        return why, back

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        if not self._lead.leader:
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
        outbox = Outbox(self.config.stream_buffer)
        slot.outbox = outbox
        ending = self.sessions.opened(node_id)
        batch = slot.info.relay_batches  # a relay that takes its members' commands batched
        pump = asyncio.create_task(self.sessions.pump(outbox, context, ending, batch=batch))
        reader = asyncio.create_task(self._read_loop(slot, context))
        stop = asyncio.create_task(ending.event.wait())
        try:
            await asyncio.wait({reader, stop}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                failed = None if reader.cancelled() else reader.exception()
                if failed is not None and not isinstance(failed, grpc.aio.AbortError):
                    # a bug, not the agent's doing: say so (gRPC alone tells only the agent)
                    log.error("session read failed", node=node_id, exc_info=failed)
                reader.result()  # re-raise an abort or error of the read loop
            elif ending.status is not None:
                # a write cancelled mid-flight would hold back the status: let it finish
                if ending.writing:
                    with contextlib.suppress(TimeoutError):
                        await aio.wait_for(asyncio.shield(pump), 2.0)
                pump.cancel()
                code, details, trailing = ending.status
                await abort(context, code, details, trailing_metadata=trailing)
        finally:
            for t in (pump, reader, stop):
                t.cancel()
            if slot.session == mine:
                slot.connected = False
                slot.outbox = None
                if ending.status is None:  # its side ended it, not this driver
                    self.view.mark_closed(slot)
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
                        self._emit(e, math.nan)
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
                            self._emit(e, math.nan)
                self._relay_batch(slot, batch, t0)
            elif (kind := msg.WhichOneof("kind")) in ("relayed", "relayed_batch"):
                if slot.alive and slot.heartbeats:
                    self.view.relay_heard(slot, mono())  # its batch is behind it
                ups = (msg.relayed,) if kind == "relayed" else msg.relayed_batch.up
                if len(ups) > RELAYED_BATCH_MAX:  # a relay gathers at most 256
                    self.relay_refused += len(ups) - RELAYED_BATCH_MAX
                    ups = ups[:RELAYED_BATCH_MAX]
                for up in ups:
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
            carried = self.relayed.setdefault(relay.node_id, set())
            carried.add(node_id)
            if isinstance(relay.outbox, Outbox):
                relay.outbox.nodes = 1 + len(carried)  # room for each member's commands
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
                    self._emit(e, math.nan)
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
                self._emit(e, now - s.silent_ms / 1000.0)
                log.warning("node lost (its relay)", node=m.node_id, relay=rid)
        if batch.beats and view.any_beat is not None:  # a wait on what they say (next_beat)
            view.any_beat.set()
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
            self._emit(commit, math.nan)

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
        journal = self._lead.journal
        world = journal.state.world if journal is not None else None
        if world is not None and world.node_ids and world.workers_per_node:
            size = len(world.node_ids) * world.workers_per_node
            if msg.world_size != size:
                return f"world size {msg.world_size} is not the current world's {size}"
            return commits_mod.rank_slice_problem(
                node_id, list(world.node_ids), size, msg.rank, "the current world"
            )
        if self._keeper.rdzv_members is not None:
            return commits_mod.rank_slice_problem(
                node_id,
                self._keeper.rdzv_members,
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

    def _on_reply(self, slot: NodeSlot, msg: dpb.AgentMessage) -> None:
        kind = msg.WhichOneof("kind")
        cid = msg.check_result.command_id if kind == "check_result" else msg.ack.command_id
        if kind == "self_check_report":  # recorded as SelfCheckReported (driver/operator.py)
            cid = self._on_self_check(slot.node_id, msg.self_check_report)
            if not cid:
                return
        if self.sessions.reply(cid, msg, slot.node_id):
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
        out = dpb.LiveViewResponse(
            driver_id=self.driver_id, leader=self._lead.leader, stats=self.stats()
        )
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


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:10.0.0.5:4242`, `ipv6:[::1]:4242`); "" else."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return ""
