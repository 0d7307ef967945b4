"""The node agent: register with the driver, hold the session, heartbeat, obey commands.

One asyncio process per node. It registers (node id, epoch = start time in ns, hostname,
IP, pod name, hardware inventory), opens the bidirectional session and sends a heartbeat
every interval on an absolute schedule (no drift). A heartbeat carries every local
worker's status; host and GPU counters about once a second; log alerts since the last
one; and flags telling the driver when something needs a detector's attention.

With workers, the agent also owns the node's flash-checkpoint memory (agent/flash.py):
created before the workers start, persisted and replicated to the buddy in the
background, freed on a clean shutdown. Each shard the persister wrote and verified is
reported to the driver (`ShardPersisted`, after a heartbeat), which commits the step once
every rank's shard is in.

Self-checks (diagnostics/selfcheck.py) run as a child process at nice +5 with a deadline,
once after the first registration (re-sent on the next session until one takes it) and
again on the driver's RunSelfCheck; the report goes up the session as SelfCheckReport.
Commands from the driver are handled by one table (agent/commands.py), the link to the
driver (finding the leader, backoff, the relay) is agent/link.py and the configuration
agent/config.py; this module is the session: heartbeats, shard reports, self-checks.

What the network may make an agent do is bounded (docs/operations/security.md): a driver-sent
`StartWorkers.worker_cmd` other than the agent's own is run only with `allow_remote_cmd`
(--allow-remote-cmd); a bearer token is never configured for a non-loopback driver without
TLS (it would travel in cleartext); a --master-addr given to the agent wins over the one
the driver derives.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any

import structlog

from unbroken.agent import checks, commands, loopguard, probes, starvation
from unbroken.agent.config import AgentConfig
from unbroken.agent.flash import NodeFlash
from unbroken.agent.hookserver import HookServer
from unbroken.agent.link import AgentExit, DriverLink
from unbroken.agent.metrics import AgentMetrics
from unbroken.agent.relay import Relay, RelayConfig
from unbroken.agent.workers import Supervisor
from unbroken.common import aio, channel, reportmac
from unbroken.common.faults import FAULT_FILE
from unbroken.common.paths import group_id
from unbroken.common.timing import node_timing
from unbroken.common.workerenv import WorkerEnv
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.recovery.persist import Persisted
from unbroken.recovery.sdcbuddy import opinion_messages

log = structlog.get_logger(__name__)

REPORT_BATCH = 256  # verified shards per ShardsPersisted message

AGENT_VERSION = "0.1.0"
F_EXITED = dpb.HEARTBEAT_FLAG_WORKER_EXITED
F_ALERTS = dpb.HEARTBEAT_FLAG_LOG_ALERTS
F_STALLED = dpb.HEARTBEAT_FLAG_STALLED
# a driver's shutdown / evict: how long the agent lets the session end by itself (the driver
# reading the reply) before it closes the channel
ENDING_GRACE_S = 2.0
# how long a stopping agent waits for its cancelled side tasks to finish their cleanup
TASKS_GRACE_S = 5.0
# The most often a worker's outlying losses send an extra heartbeat (and a ring rescan): the
# SDK reports at most this often anyway; a worker flipping its loss high and low at every
# datagram gets no more heartbeats than that
OUTLIER_BEAT_EVERY_S = 0.05


def local_ip() -> str:
    """The address this host uses to reach the network (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _relay_of(config: AgentConfig, interval_s: float) -> Relay | None:
    """The relay this agent runs for its group's members, if it listens for them."""
    if not config.relay_listen:
        return None
    relay_cfg = RelayConfig(listen=config.relay_listen, tls=config.tls, token=config.token)
    return Relay(relay_cfg, config.node_id, interval_s)


class Agent:
    """One node's daemon."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.epoch = time.time_ns()
        self.interval_s = config.heartbeat_interval_ms / 1000.0
        self.supervisor = Supervisor(config.workers, config.socket_path) if config.workers else None
        self.hooks = (
            HookServer(
                config.socket_path,
                self.supervisor,
                config.node_id,
                group_id(config.socket_group) if config.socket_group else None,
            )
            if self.supervisor
            else None
        )
        self.session_open = False
        # set when a worker steps for the first time in a new world, or fails: heartbeat now
        self._beat_soon = asyncio.Event()
        # set by a loss that stands out: that heartbeat carries the rings listed anew
        self._rescan_due = False
        self._outlier_at = -OUTLIER_BEAT_EVERY_S  # when the last outlier's heartbeat was asked
        if self.hooks is not None:
            self.hooks.on_beat_now = self._beat_soon.set
            self.hooks.on_outlier = self._outlier_beat
            self.hooks.on_step = self._flash_poke
        if self.supervisor is not None:
            self.supervisor.on_failure = self._beat_soon.set
            self.supervisor.on_hang_dumped = self._beat_soon.set
        self._hb_seq = 0  # the session's heartbeat sequence number
        self.metrics = AgentMetrics(self._metric_values)
        self.flash: NodeFlash | None = None
        self.fault = config.fault  # the fault spec in force: --inject-fault, then drills'
        self.fault_file: Path | None = None
        if self.supervisor is not None:
            sup, spec = self.supervisor, self.supervisor.spec
            if config.flash is not None:
                self.flash = NodeFlash(config.flash, sup.launch.world_size, config.node_id)
                sup.launch = sup.launch.with_env(**self.flash.env())
            self.fault_file = Path(spec.log_dir) / FAULT_FILE
            sup.launch = sup.launch.with_env(**WorkerEnv(fault_file=str(self.fault_file)).to_env())
        # the registration self-check: pending until a session took its report
        self._selfcheck_due = config.selfcheck_at_register
        self._selfcheck_at = time.monotonic() + max(0.0, config.selfcheck_after_s)
        self.warm_check = checks.WarmCheck() if config.warm_checks else None
        self._selfcheck_report: dpb.SelfCheckReport | None = None
        self._selfcheck_lock = asyncio.Lock()
        self.gpus = probes.Gpus()
        self.stop = asyncio.Event()
        # set with `stop` by a driver's shutdown / evict: its reply is on the session, so
        # the session is let end by itself (the driver reads the reply, then ends it)
        self.ending_session = False
        self.exit_code = 0
        self._write_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.loop_lag = starvation.LoopLag()  # our own loop's lateness, in every heartbeat
        # ...and while it lags at real-time priority, our other threads at its priority: from
        # the loop guard's process (at once), or from the loop once it runs again (no guard)
        self.gil_boost = loopguard.GilBoost() if self.config.realtime else None
        self.loop_guard: loopguard.LoopGuard | None = None
        self._guard_boosts = 0  # the guard's boosts as of the last look
        self.term_seen = 0  # the newest leader term a command came with (older ones dropped)
        self.session_term = 0  # the leader term our registration was answered under
        # what terms count in (the etcd cluster and the job's incarnation): a registration
        # under another scope starts the count afresh
        self.term_scope = ""
        self.report_key = b""  # our key for signed shard reports, from RegisterResponse
        self.relay = _relay_of(config, self.interval_s)
        self.link = DriverLink(
            config,
            self.stop,
            on_registered=self._registered,
            session=self._session,
            fence=self._fence,
        )

    def register_request(self) -> dpb.RegisterRequest:
        n = len(self.supervisor.workers) if self.supervisor else 0
        if self.config.workers is not None:
            n = max(n, self.config.workers.nproc)
        return dpb.RegisterRequest(
            node_id=self.config.node_id,
            epoch=self.epoch,
            hostname=socket.gethostname(),
            ip=local_ip(),
            pod_name=os.environ.get("POD_NAME", ""),
            inventory=probes.inventory(self.gpus),
            agent_version=AGENT_VERSION,
            num_workers=n,
            spare=self.config.spare,
            replica_buddy=self.flash.buddy if self.flash is not None else "",
            replica_listen=self.flash.listen_address() if self.flash is not None else "",
            replica_pubkey=self.flash.replica_pubkey if self.flash is not None else b"",
            relay_batches=self.relay is not None,
        )

    # ------------------------------------------------------------ lifecycle
    def _outlier_beat(self) -> None:
        """A worker's loss stood out (a spike, maybe): heartbeat now, with the rings listed
        after its report. The driver rolls back to the newest step every ring holds below the
        spike; the copy of the step before it was finished by the spiked step's save, but
        the last listing predated it, and the rollback went two steps back, not one.
        At most once per `OUTLIER_BEAT_EVERY_S`."""
        now = time.monotonic()
        if now - self._outlier_at < OUTLIER_BEAT_EVERY_S:
            return
        self._outlier_at = now
        self._rescan_due = True
        self._beat_soon.set()

    def _flash_poke(self) -> None:
        if self.flash is not None:
            self.flash.poke()

    def _metric_values(self) -> dict[str, Any]:
        """Counters for this node's Prometheus endpoint (plain reads; any thread)."""
        v: dict[str, Any] = {"connected": self.session_open, "term": self.term_seen}
        f = self.flash
        if f is not None:
            v["shards_persisted"] = f.persisted_count
            v["persisted_bytes"] = f.persisted_bytes
            v["flash_scan_age"] = f.scan_age_s(time.monotonic())
            v["replicas_received"] = f.server.received
            v["replicas_refused"] = f.server.refused
            if f.sender is not None:
                v["replicas_sent"] = f.sender.sent_copies
                v["replica_bytes_sent"] = f.sender.sent_bytes
                v["replica_send_failures"] = f.sender.failed
        sup = self.supervisor
        if sup is not None:
            v["warm_starts"], v["cold_starts"] = sup.warm_starts, sup.cold_starts
        guard, boost = self.loop_guard, self.gil_boost
        v["loop_boosts"] = (guard.boosts if guard else self._guard_boosts) + (
            boost.boosts if boost else 0
        )
        return v

    async def run(self) -> int:
        """Run until shut down; return the exit code."""
        structlog.contextvars.bind_contextvars(node=self.config.node_id)
        if self.config.metrics_port is not None:
            port = self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
            log.info("agent metrics", url=f"http://{self.config.metrics_host}:{port}/metrics")
        if self.hooks is not None:
            await self.hooks.start()
        if self.relay is not None:
            await self.relay.start()
        self.loop_guard = self._start_loop_guard()
        try:
            if self.flash is not None:
                await self.flash.start()
            if self.supervisor is not None and self.config.start_workers:
                await self.supervisor.start_all()
            elif self.supervisor is not None:
                self.supervisor.warm_up()  # standbys import torch while we wait for the job
                spec = self.supervisor.spec
                if self.flash is not None and spec.warm:  # ...and the SDC helper likewise
                    self._spawn(self._prestart(self.flash, spec.warm_after_s))
            connect = asyncio.create_task(self.link.run(self.register_request()))
            stopped = asyncio.create_task(self.stop.wait())
            done, _ = await asyncio.wait({connect, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if connect not in done and self.ending_session:
                # a shutdown's reply is written, the stream half-closed: the driver reads
                # the reply and ends the stream. Closing the channel first cancels the call,
                # and a reply the driver's loop had not read yet went with it (a clean-clone
                # CI run: "no reply from n0 in 20 s" to a shutdown whose agent exited 0)
                with contextlib.suppress(TimeoutError):
                    await aio.wait_for(asyncio.shield(connect), ENDING_GRACE_S)
            if connect.done():
                connect.result()
            else:
                connect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await connect
        except AgentExit as e:
            log.error("agent stopping", reason=str(e))
            self.exit_code = e.code
        finally:
            self.loop_lag.stop()
            if self.loop_guard is not None:
                self.loop_guard.stop()
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            if tasks:  # their own cleanup (a self-check's child killed and reaped) runs now
                await asyncio.wait(tasks, timeout=TASKS_GRACE_S)
            if self.warm_check is not None:
                await self.warm_check.close()
            if self.supervisor is not None:
                await self.supervisor.close(grace_s=2.0)  # workers and warm standbys
            if self.hooks is not None:
                self.hooks.close()
            if self.relay is not None:
                await self.relay.close()
            if self.flash is not None:
                # Keep the copies when the agent fails: a restarted agent can use them.
                await self.flash.close(clean=self.exit_code == 0)
            self.metrics.close()
        return self.exit_code

    def _registered(self, resp: dpb.RegisterResponse, target: str, relay: str) -> None:
        """A registration was answered: the session's term, its scope, our report key and
        the driver's heartbeat interval."""
        self.session_term = resp.leader_term
        if resp.term_scope != self.term_scope:
            if self.term_scope:
                log.warning(
                    "the driver's terms count in a new scope (another etcd cluster "
                    "or job incarnation): counting terms afresh",
                    old=self.term_scope,
                    new=resp.term_scope,
                    term=resp.leader_term,
                    newest_seen=self.term_seen,
                )
            self.term_scope = resp.term_scope
            self.term_seen = 0
        self.report_key = resp.report_key  # signs our shard reports (reportmac)
        if self.flash is not None and self.flash.resend():  # lost or refused in a failover
            log.info(
                "shard reports queued again for the new session", reports=len(self.flash.reports)
            )
        self.interval_s = resp.heartbeat_interval_ms / 1000.0 or self.interval_s
        log.info(
            "registered",
            driver=target,
            driver_id=resp.driver_id,
            interval_ms=resp.heartbeat_interval_ms,
            epoch=self.epoch,
            relay=relay,
        )
        if self.relay is not None:
            self.relay.interval_s = self.interval_s
            self.relay.miss_limit = resp.miss_limit or 3
            self.relay.closed_timeout_s = resp.closed_timeout_ms / 1000.0  # 0: the timeout
            self.relay.batch_up = resp.relay_batches

    async def _fence(self) -> None:
        """The driver declared this node lost (it was silent: SIGSTOPped, partitioned) and
        the world went on without it: its workers belong to a dead timeline. Stop them
        before registering again, so they neither fail as faults of the node nor write
        into the new world; the node comes back idle, for the driver to take again."""
        sup = self.supervisor
        if sup is None or not any(w.pid and w.exit_code == 0 for w in sup.workers.values()):
            return
        log.warning("declared lost: stopping the workers of the old world before registering")
        await sup.stop_all(grace_s=2.0)
        sup.exited = False  # their exits are this cleanup, not faults

    async def _session(self, stub: dgrpc.DriverStub) -> None:
        md = (
            *self.link.metadata,
            (channel.NODE_KEY, self.config.node_id),
            (channel.EPOCH_KEY, str(self.epoch)),
        )
        call = stub.Session(metadata=md)
        self._hb_seq = 0  # per session
        beats = asyncio.create_task(self._heartbeats(call))
        forward = None
        if self.relay is not None:
            relay = self.relay

            async def up(msg: dpb.AgentMessage) -> None:
                await self.write(call, msg)

            forward = asyncio.create_task(relay.forward(up))
        self.session_open = True
        if self._selfcheck_due:
            self._spawn(self._registration_selfcheck(call))
        elif self.warm_check is not None:
            # no self-check at registration starts one: keep a check process warm from
            # the first session, so the first on-demand self-check or diagnosis of this
            # node does not pay torch's import (5 s for a silently bad node in the
            # recovery bench, whose agents skip the registration self-check)
            self.warm_check.refill()
        try:
            async for msg in call:
                self.link.heard = time.monotonic()
                if msg.WhichOneof("kind") is None:
                    continue  # a relay's tick: it is alive
                kind = msg.WhichOneof("kind")
                if kind == "relayed" and self.relay is not None:
                    self.relay.deliver(msg.relayed)
                    continue
                if kind == "relayed_batch" and self.relay is not None:
                    for down in msg.relayed_batch.down:
                        self.relay.deliver(down)
                    continue
                self._spawn(self._command(call, msg))
        finally:
            self.session_open = False
            beats.cancel()
            if forward is not None:
                forward.cancel()
            with contextlib.suppress(BaseException):
                await beats
            if forward is not None:
                with contextlib.suppress(BaseException):
                    await forward
        # a clean end of stream: driver shutting down; reconnect
        log.info("session ended by the driver")

    def _start_loop_guard(self) -> loopguard.LoopGuard | None:
        """The loop guard (agent/loopguard.py), when this loop runs at real-time priority."""
        if self.gil_boost is None or not loopguard.is_realtime():  # `realtime_loop` took?
            return None
        try:
            guard = loopguard.LoopGuard.start(self.loop_lag.period_s)
        except OSError as e:
            log.warning("no loop guard: the loop's waits for the GIL end later", error=str(e))
            return None
        self.loop_lag.stamp = guard.stamp
        self.loop_lag.start()
        return guard

    @staticmethod
    async def _prestart(flash: NodeFlash, after_s: float) -> None:
        """Start the SDC buddy's helper process with the standbys (recovery/sdcbuddy.py
        `prestart`): at the first fingerprinted copy, its torch import ran beside a promoted
        spare's first step. Only where standbys are wanted (`--warm-workers`): memory spent
        to shorten a recovery."""
        await asyncio.sleep(after_s)
        await asyncio.to_thread(flash.opinions.prestart)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def write(self, call: Any, msg: dpb.AgentMessage) -> None:
        async with self._write_lock:
            await call.write(msg)

    # ------------------------------------------------------------ heartbeats
    async def _heartbeats(self, call: Any) -> None:
        sup = self.supervisor
        if sup is not None and any(w.exit_code for w in sup.workers.values()):
            sup.exited = True  # a new session: re-announce exits the driver may have missed
        self.loop_lag.start()
        cpus = starvation.usable_cpus()
        watch = asyncio.create_task(sup.watch_stops(self._beat_soon.set)) if sup else None
        try:
            await self._beat_loop(call, cpus)
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(BaseException):
                    await watch

    async def _beat_loop(self, call: Any, cpus: int) -> None:
        next_t = time.monotonic()
        next_host = next_t
        every_host = self.config.host_stats_every_ms / 1000.0
        beats = 0
        while True:
            if self.config.realtime and beats % 50 == 0:  # gRPC may start threads any time
                starvation.realtime_grpc_threads()
                self._check_loop_guard()
            beats += 1
            now = time.monotonic()
            hb = self._heartbeat(now)
            # how starved we were: the driver reads a late heartbeat of a starved node as such
            late_ms = max(0.0, now - next_t) * 1000.0
            self.loop_lag.note(late_ms)
            hb.late_ms = late_ms
            hb.loop_lag_ms = self.loop_lag.take()
            if self.gil_boost is not None and self.loop_guard is None:  # waits for the GIL
                self.gil_boost.note(max(hb.loop_lag_ms, late_ms), now)
            hb.cpu_pressure_pct = starvation.cpu_pressure_pct()
            hb.runnable_per_cpu = starvation.runnable_per_cpu(cpus=cpus)
            if now >= next_host:
                hb.host.CopyFrom(probes.host_stats())
                hb.gpus.extend(self.gpus.stats())
                next_host = now + every_host
            hb.sent_mono_ns = time.monotonic_ns()
            relay = self.relay
            if relay is not None and relay.upstream is not None:
                # one message per interval: the group's batch carries our own heartbeat
                batch = relay.batch(time.monotonic(), own=hb)
                await self.write(call, dpb.AgentMessage(relay_batch=batch))
            else:
                await self.write(call, dpb.AgentMessage(heartbeat=hb))
            self.metrics.sent(hb)
            if self.flash is not None and self.flash.reports:
                await self._report_shards(call, self.flash)
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (a stall): skip missed slots, do not burst
                next_t = time.monotonic() + self.interval_s
                delay = self.interval_s
            # A worker's first step in a new world is sent at once (one extra heartbeat off
            # the schedule, which stays): the driver resumes when every rank stepped, and
            # waited up to a whole interval for it.
            while await self._kicked(next_t - time.monotonic()):
                if self._rescan_due and self.flash is not None:
                    self._rescan_due = False
                    await self.flash.rescan()
                await self._extra_heartbeat(call)

    def _check_loop_guard(self) -> None:
        """Say when the guard lifted our threads since the last look; a guard that exited
        leaves the boosts to the loop itself (said once)."""
        guard = self.loop_guard
        if guard is not None and guard.boosts > self._guard_boosts:
            log.info("loop guard: the loop waited for the GIL; its threads were lifted",
                     boosts=guard.boosts)  # fmt: skip
            self._guard_boosts = guard.boosts
        if guard is not None and guard.proc.poll() is not None:
            log.warning("loop guard exited: the loop boosts its threads itself, later",
                        code=guard.proc.returncode)  # fmt: skip
            self.loop_lag.stamp = None
            guard.stop()
            self._guard_boosts = guard.boosts
            self.loop_guard = None

    async def _kicked(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a worker's first step (True) or the next slot (False)."""
        if timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await aio.wait_for(self._beat_soon.wait(), timeout_s)
        kicked = self._beat_soon.is_set()
        self._beat_soon.clear()
        return kicked

    async def _extra_heartbeat(self, call: Any) -> None:
        """One heartbeat now, off the schedule (not behind a relay: its batches keep it)."""
        if self.relay is not None and self.relay.upstream is not None:
            return
        hb = self._heartbeat(time.monotonic())
        hb.sent_mono_ns = time.monotonic_ns()
        await self.write(call, dpb.AgentMessage(heartbeat=hb))
        self.metrics.sent(hb)

    async def ring_heartbeat(self, call: Any) -> bool:
        """After a stop: rescan the flash rings and send a heartbeat with them now, ahead
        of the ack (True). Without it the driver waited for two more heartbeats after the
        ack (~200 ms of every incident's pause; the recovery bench's worker crashes lost
        1.0-1.6 s each). A relay sends it as its own heartbeat in a batch of its own,
        vouching for nobody (its group's periodic batches keep their interval); a member's
        relay sends it up ahead of the ack (agent/relay.py `_fresh_beats`)."""
        if self.flash is None or self.supervisor is None or not self.session_open:
            return False
        await self.flash.rescan()
        hb = self._heartbeat(time.monotonic())
        hb.sent_mono_ns = time.monotonic_ns()
        if self.relay is not None and self.relay.upstream is not None:
            msg = dpb.AgentMessage(relay_batch=dpb.RelayBatch(own=hb))
        else:
            msg = dpb.AgentMessage(heartbeat=hb)
        await self.write(call, msg)
        self.metrics.sent(hb)
        return True

    def _heartbeat(self, now: float) -> dpb.Heartbeat:
        """This node's heartbeat now (host and GPU figures are the caller's to add)."""
        self._hb_seq += 1
        hb = dpb.Heartbeat(seq=self._hb_seq)
        sup = self.supervisor
        if self.hooks is not None and self.hooks.attached:
            hb.attached.extend(self.hooks.statuses(now))
        if sup is not None:
            hb.workers.extend(sup.statuses(now))
            # said even when 0: the driver then skips this node's ranks in its fingerprint watch
            hb.fingerprint_ranks = sum(1 for w in hb.workers if w.fingerprints)
            hb.start_id = sup.start_id
            if self.flash is not None:  # the steps each rank can restore from memory
                self.flash.starved(now)
                hb.persist_error, hb.persist_failures, hb.persist_failing_s = (
                    self.flash.persist_health()
                )
                for w in hb.workers:
                    if w.global_rank >= 0:
                        w.ring_steps.extend(self.flash.ring_steps(w.global_rank))
                for node, rank, steps in self.flash.replicas_held():  # as a buddy
                    hb.replicas.add(node=node, rank=rank, steps=steps)
                hb.buddy_opinions.extend(opinion_messages(self.flash.opinions.to_send()))
            timing = node_timing(hb.workers)  # the straggler sweep reads this summary
            if timing is not None:
                hb.timing.CopyFrom(timing)
            stalled, stacks = sup.hang_check(list(hb.workers))
            if stalled:
                hb.flags |= F_STALLED
                hb.hang_stacks = stacks
            if sup.exited:
                hb.flags |= F_EXITED
                sup.exited = False
            alerts = sup.take_alerts()
            if alerts:
                hb.alerts.extend(alerts)
                hb.flags |= F_ALERTS
        return hb

    async def _report_shards(self, call: Any, flash: NodeFlash) -> None:
        """Send every verified shard not reported yet, in one message per `REPORT_BATCH`
        (the driver ignores duplicates)."""
        while flash.reports:
            batch: list[Persisted] = []
            while flash.reports and len(batch) < REPORT_BATCH:
                batch.append(flash.reports.popleft())
            msg = dpb.ShardsPersisted(
                shards=[
                    dpb.ShardPersisted(
                        step=p.step,
                        rank=p.rank,
                        uri=p.uri,
                        bytes=p.nbytes,
                        checksum=p.checksum,
                        world_size=flash.world_size,
                        url=flash.config.persist_url,
                        timeline=p.timeline,  # None (unset) when the worker did not stamp one
                        persist_s=p.seconds,
                    )
                    for p in batch
                ]
            )
            if self.report_key:  # signed: a relay carrying it cannot forge or alter it
                out = dpb.AgentMessage(
                    signed_report=reportmac.sign(self.report_key, self.epoch, msg)
                )
            else:  # a driver that hands out no key (older)
                out = dpb.AgentMessage(shards_persisted=msg)
            try:
                await self.write(call, out)
            except BaseException:
                flash.reports.extendleft(reversed(batch))  # the next session reports them
                raise
            flash.sent.extend(batch)

    async def _command(self, call: Any, msg: dpb.DriverMessage) -> None:
        """Obey one command of the driver (agent/commands.py)."""
        await commands.handle(self, call, msg)

    # ------------------------------------------------------------ self-checks
    async def selfcheck(self, command_id: str, timeout_s: float = 0.0) -> dpb.SelfCheckReport:
        spec = self.config.workers
        warm_before = self.warm_check.taken if self.warm_check is not None else 0
        rep = await checks.run_selfcheck(
            self.config.node_id,
            self.fault,
            timeout_s or self.config.selfcheck_timeout_s,
            command_id=command_id,
            disk_path=spec.log_dir if spec is not None else "/",
            nice=spec.nice if spec is not None else 5,
            warm=self.warm_check,
        )
        log.info(
            "self-check",
            ok=rep.ok,
            failures=list(rep.failures),
            command_id=command_id,
            warm=bool(self.warm_check and self.warm_check.taken > warm_before),
        )
        if self.warm_check is not None:
            self.warm_check.refill()  # torch is in the page cache now: a check kept warm
        return rep

    async def _registration_selfcheck(self, call: Any) -> None:
        """Run the self-check once (not before `selfcheck_after_s` from the agent's start)
        and send it; a session that ends first leaves it due."""
        async with self._selfcheck_lock:  # a quick reconnect must not start a second run
            await asyncio.sleep(max(0.0, self._selfcheck_at - time.monotonic()))
            if self._selfcheck_report is None:
                self._selfcheck_report = await self.selfcheck("")
        if not self._selfcheck_due:
            return
        try:
            await self.write(call, dpb.AgentMessage(self_check_report=self._selfcheck_report))
        except Exception as e:  # the session ended first: the next one sends it
            log.info("self-check report not sent; the next session sends it", error=repr(e))
            return
        self._selfcheck_due = False
