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
Faults can be injected at runtime (InjectFault; common/faults.py RUNTIME_FAULTS):
check-level ones (wrong-matmul, slow) change the fault spec the checks and self-checks
run with; crash / hang signal a worker; node-loss kills the workers and the agent without
a goodbye; nan / loss-spike are written atomically as JSON to `<log dir>/fault.json`,
the file the workers find in UNBROKEN_FAULT_FILE (the trainer reads it each step).

Driver endpoints are a list: a driver that is not the leader answers UNAVAILABLE with the
leader's address, which the agent tries next when it is one of its configured endpoints
(a redirect elsewhere is ignored: it could carry the token to anyone); other failures
move to the next endpoint after a jittered exponential backoff. Without a successful
registration for `max_disconnected_s` the agent gives up (exit 3): every retry has a limit.

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
import random
import signal
import socket
import ssl
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import grpc
import structlog

from unbroken.agent import checks, injob, probes, starvation
from unbroken.agent.flash import NodeFlash, NodeFlashConfig
from unbroken.agent.hookserver import HookServer
from unbroken.agent.metrics import AgentMetrics
from unbroken.agent.peerid import PeerIdentityError, check_peer
from unbroken.agent.relay import SILENT_S, Relay, RelayConfig, parse_relay
from unbroken.agent.workers import Supervisor, WorkerSpec
from unbroken.common import channel, reportmac, workerenv
from unbroken.common.channel import endpoint_is_loopback, is_loopback
from unbroken.common.faults import (
    FAULT_FILE,
    SDC_FAULTS,
    SLOW_FILE,
    WORKER_FILE_FAULTS,
    FaultSpec,
    RuntimeFault,
    SdcDetail,
    WorkerFault,
    write_slow_factor,
)
from unbroken.common.paths import DEFAULT_SOCKET, group_id
from unbroken.common.timing import node_timing
from unbroken.common.tls import TlsConfig, channel_credentials, token_metadata
from unbroken.common.workerenv import WorkerEnv
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import hooks_pb2 as hpb
from unbroken.recovery.persist import Persisted

log = structlog.get_logger(__name__)

REPORT_BATCH = 256  # verified shards per ShardsPersisted message

AGENT_VERSION = "0.1.0"
# After a standby driver said the leader is unknown or one of ours (an election under way),
# retries stay `election_retry_s` apart for this long, whichever endpoint refuses meanwhile
# (the dead leader refuses the connection: that says nothing about the election).
ELECTION_WINDOW_S = 10.0
# How far above its registration's leader term a command's term may be: elections that
# can complete while one session lasts (a registration answered just before the new
# leader's LeaderElected is folded sees the previous term). Beyond it: forged.
TERM_SLACK = 16
F_EXITED = dpb.HEARTBEAT_FLAG_WORKER_EXITED
F_ALERTS = dpb.HEARTBEAT_FLAG_LOG_ALERTS
F_STALLED = dpb.HEARTBEAT_FLAG_STALLED


class AgentExit(Exception):
    """The agent must stop; `code` is the process exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """Everything one agent needs."""

    drivers: list[str] = field(
        metadata={
            "flag": "--driver",
            "parse": lambda text: [d.strip() for d in text.split(",") if d.strip()],
            "required": True,
            "help": "driver endpoints host:port, comma-separated (standbys too)",
        }
    )
    node_id: str = field(
        default_factory=socket.gethostname, metadata={"help": "this node's id (unset: hostname)"}
    )
    heartbeat_interval_ms: int = field(
        default=100, metadata={"help": "interval until the driver sets its own"}
    )
    workers: WorkerSpec | None = field(
        default=None, metadata={"flag": None, "why": "built from --worker-cmd and its flags"}
    )
    start_workers: bool = field(
        default=True,
        metadata={
            "negate": "--no-start",
            "help": "wait for the driver's StartWorkers instead of starting at once",
        },
    )
    socket_path: str = field(
        default="",
        metadata={"flag": "--socket", "help": "unix socket of the local hooks channel"},
    )
    socket_group: str = field(
        default="",
        metadata={
            "help": "a group (name or id) whose members' scripts may use the hooks SDK with "
            "this agent: the socket's directory becomes 1770 and the socket 0660 in that "
            "group, and datagrams of its members are taken (unset: only this user's and "
            "root's); the agent's user must be a member"
        },
    )
    spare: bool = field(default=False, metadata={"help": "register as a spare node"})
    register_timeout_s: float = field(
        default=2.0, metadata={"help": "deadline of one Register call"}
    )
    backoff_base_s: float = field(
        default=0.05, metadata={"help": "first wait before reconnecting to a driver"}
    )
    backoff_max_s: float = field(
        default=2.0, metadata={"help": "longest wait between reconnection attempts"}
    )
    election_retry_s: float = field(
        default=0.25,
        metadata={
            "help": "longest wait between reconnection attempts while a standby driver "
            "answers that the leader is unknown or one of --driver (an election under way: "
            "the new leader is found within this of winning, not after a backoff of "
            "--backoff-max-s)"
        },
    )
    max_disconnected_s: float = field(
        default=600.0, metadata={"help": "give up after this long without a driver"}
    )
    host_stats_every_ms: int = field(
        default=1000, metadata={"help": "how often host statistics join a heartbeat"}
    )
    check_timeout_s: float = field(
        default=300.0, metadata={"help": "deadline of a diagnosis check the driver asks for"}
    )
    selfcheck_timeout_s: float = field(
        default=120.0,
        metadata={"help": "deadline of a self-check run (later it counts as failed)"},
    )
    selfcheck_at_register: bool = field(
        default=True,
        metadata={
            "negate": "--no-selfcheck",
            "help": "do not run the self-checks after registering (the driver can still ask)",
        },
    )
    realtime: bool = field(
        default=True,
        metadata={
            "negate": "--no-realtime",
            "help": "do not run the agent's event loop (heartbeats, commands) at SCHED_RR "
            "priority 1 (agent/starvation.py); without it, its own workers' and standbys' "
            "start-up can delay its heartbeats past the driver's timeout on a loaded host",
        },
    )
    warm_checks: bool = field(
        default=True,
        metadata={
            "negate": "--no-warm-checks",
            "help": "do not keep a check process with torch imported (started after the "
            "self-check and after each check) for diagnoses; each check then imports torch",
        },
    )
    tls: TlsConfig = field(
        default_factory=TlsConfig,
        metadata={"flag": None, "why": "built from --tls-cert, --tls-key and --tls-ca"},
    )
    token: str | None = field(
        default=None, metadata={"flag": None, "why": "read from --token-file or $UNBROKEN_TOKEN"}
    )
    fault: str = field(
        default="",
        metadata={
            "flag": "--inject-fault",
            "help": "fault spec passed to workers (UNBROKEN_FAULT) and to checks",
        },
    )
    # None: no flash store (no workers, or disabled)
    flash: NodeFlashConfig | None = field(
        default=None, metadata={"flag": None, "why": "built from the flash flags"}
    )
    allow_remote_cmd: bool = field(
        default=False,
        metadata={
            "help": "run the worker command the driver sends in StartWorkers when it differs "
            "from --worker-cmd (off: a driver, or whoever holds its credentials, cannot make "
            "this node run a command of its choosing)"
        },
    )
    metrics_port: int | None = field(
        default=None,
        metadata={
            "help": "this node's Prometheus endpoint (workers, flash, replicas; 0: a free "
            "port; unset: off)"
        },
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata={"help": "metrics endpoint host (beyond loopback only with --metrics-public)"},
    )
    metrics_public: bool = field(
        default=False,
        metadata={
            "help": "serve the metrics beyond loopback: they take no credential (put them "
            "behind a firewall)"
        },
    )
    pin_master_addr: bool = field(
        default=False,
        metadata={"flag": None, "why": "set when --master-addr is given (it wins then)"},
    )
    relay_listen: str = field(
        default="",
        metadata={
            "group": "relays (agent/relay.py; past ~1,000 nodes)",
            "help": "act as the relay of a group of nodes: serve their sessions on HOST:PORT "
            "and forward one batch per heartbeat interval to the driver",
        },
    )
    relay: str = field(
        default="",
        metadata={
            "group": "relays (agent/relay.py; past ~1,000 nodes)",
            "help": "heartbeat through this relay, ID@HOST:PORT (its node id and "
            "--relay-listen); the driver is used directly whenever the relay is unreachable",
        },
    )

    def __post_init__(self) -> None:
        if not self.drivers:
            raise ValueError("drivers is empty; pass --driver host:port[,host:port...]")
        for d in self.drivers:
            if ":" not in d:
                raise ValueError(f"driver endpoint {d!r} must be host:port")
        if not 10 <= self.heartbeat_interval_ms <= 60_000:
            raise ValueError(
                f"heartbeat_interval_ms must be in [10, 60000], got {self.heartbeat_interval_ms}"
            )
        if self.register_timeout_s <= 0:
            raise ValueError(f"register_timeout_s must be > 0, got {self.register_timeout_s}")
        if not 0 < self.backoff_base_s <= self.backoff_max_s:
            raise ValueError("backoff_base_s must be > 0 and <= backoff_max_s")
        if not 0 < self.election_retry_s <= self.backoff_max_s:
            raise ValueError("election_retry_s must be > 0 and <= backoff_max_s")
        if self.max_disconnected_s <= 0:
            raise ValueError(f"max_disconnected_s must be > 0, got {self.max_disconnected_s}")
        if not self.selfcheck_timeout_s > 0:
            raise ValueError(f"selfcheck_timeout_s must be > 0, got {self.selfcheck_timeout_s}")
        FaultSpec.parse(self.fault)  # ValueError naming the known terms
        if self.metrics_port is not None and not (
            self.metrics_public or is_loopback(self.metrics_host)
        ):
            raise ValueError(
                f"--metrics-host {self.metrics_host} is not a loopback address: the metrics "
                "endpoint takes no credential. Pass --metrics-public to serve it there anyway "
                "(behind a firewall that lets only Prometheus in), or scrape it on loopback"
            )
        if self.token and not self.tls.enabled:
            remote = [d for d in self.drivers if not endpoint_is_loopback(d)]
            if remote:
                raise ValueError(
                    f"the token would travel in cleartext to {', '.join(remote)}: give the "
                    "agent --tls-cert/--tls-key/--tls-ca, or reach the driver on loopback"
                )
        if self.relay:
            rid, endpoint = parse_relay(self.relay)
            if rid == self.node_id:
                raise ValueError("--relay names this node itself; a relay needs no relay")
            if self.token and not self.tls.enabled and not endpoint_is_loopback(endpoint):
                raise ValueError(
                    f"the token would travel in cleartext to the relay {endpoint}: give the "
                    "agent --tls-cert/--tls-key/--tls-ca"
                )
        if self.relay_listen and self.relay:
            raise ValueError("--relay-listen and --relay exclude each other")
        if not self.socket_path:  # taken by the first agent on the host
            object.__setattr__(self, "socket_path", DEFAULT_SOCKET)  # a derived default
        if self.socket_group:
            group_id(self.socket_group)  # ValueError: no such group, and how to make it


def local_ip() -> str:
    """The address this host uses to reach the network (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


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
        if self.hooks is not None:
            self.hooks.on_first_step = self._beat_soon.set
        if self.supervisor is not None:
            self.supervisor.on_failure = self._beat_soon.set
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
        self.warm_check = checks.WarmCheck() if config.warm_checks else None
        self._selfcheck_report: dpb.SelfCheckReport | None = None
        self._selfcheck_lock = asyncio.Lock()
        self.gpus = probes.Gpus()
        self.endpoints = list(config.drivers)
        self.current = 0
        self._electing_until = 0.0  # until then, retries are `election_retry_s` apart
        self.stop = asyncio.Event()
        self.exit_code = 0
        self._write_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.loop_lag = starvation.LoopLag()  # our own loop's lateness, in every heartbeat
        # ...and while it lags at real-time priority, our other threads at its priority
        self.gil_boost = starvation.GilBoost() if self.config.realtime else None
        self._metadata = self._token_md()
        self.term_seen = 0  # the newest leader term a command came with (older ones dropped)
        self.session_term = 0  # the leader term our registration was answered under
        # what terms count in (the etcd cluster and the job's incarnation): a registration
        # under another scope starts the count afresh
        self.term_scope = ""
        self.report_key = b""  # our key for signed shard reports, from RegisterResponse
        self.relay: Relay | None = None
        if config.relay_listen:
            self.relay = Relay(
                RelayConfig(
                    listen=config.relay_listen,
                    tls=config.tls,
                    token=config.token,
                ),
                config.node_id,
                self.interval_s,
            )
        self.via: tuple[str, str] | None = parse_relay(config.relay) if config.relay else None
        self._relay_down = False  # the relay failed us: go to the driver directly
        self._heard = 0.0  # monotonic time of the last message down the session

    def _token_md(self) -> tuple[tuple[str, str], ...]:
        return token_metadata(self.config.token)

    def _channel(self, target: str) -> grpc.aio.Channel:
        if self.config.tls.enabled:
            creds = channel_credentials(self.config.tls)
            return grpc.aio.secure_channel(target, creds, options=channel.CLIENT_OPTIONS)
        return grpc.aio.insecure_channel(target, options=channel.CLIENT_OPTIONS)

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
        )

    # ------------------------------------------------------------ lifecycle
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
        try:
            if self.flash is not None:
                await self.flash.start()
            if self.supervisor is not None and self.config.start_workers:
                await self.supervisor.start_all()
            elif self.supervisor is not None:
                self.supervisor.warm_up()  # standbys import torch while we wait for the job
            connect = asyncio.create_task(self._connect_loop())
            stopped = asyncio.create_task(self.stop.wait())
            done, _ = await asyncio.wait({connect, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if connect in done:
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
            for t in list(self._tasks):
                t.cancel()
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

    async def _connect_loop(self) -> None:
        backoff = self.config.backoff_base_s
        last_ok = time.monotonic()
        request = self.register_request()
        while not self.stop.is_set():
            target = self.endpoints[self.current % len(self.endpoints)]
            ch = self._channel(target)
            try:
                stub = dgrpc.DriverStub(ch)
                via = self.via if self.via is not None and not self._relay_down else None
                md = self._metadata
                if via is not None:
                    md = (*md, (channel.RELAY_KEY, via[0]))
                if self.config.tls.enabled:  # the driver's principal, not any of its CA's
                    await asyncio.to_thread(check_peer, target, self.config.tls, role="driver")
                resp = await stub.Register(
                    request,
                    timeout=self.config.register_timeout_s,
                    metadata=md,
                    wait_for_ready=False,
                )
                last_ok = time.monotonic()
                backoff = self.config.backoff_base_s
                self._electing_until = 0.0
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
                self.interval_s = resp.heartbeat_interval_ms / 1000.0 or self.interval_s
                log.info(
                    "registered",
                    driver=target,
                    driver_id=resp.driver_id,
                    interval_ms=resp.heartbeat_interval_ms,
                    epoch=self.epoch,
                    relay=via[0] if via else "",
                )
                if self.relay is not None:
                    self.relay.interval_s = self.interval_s
                    self.relay.miss_limit = resp.miss_limit or 3
                if via is not None:
                    if self.config.tls.enabled:  # the relay is the node it was named as
                        try:
                            await asyncio.to_thread(
                                check_peer, via[1], self.config.tls, role="node", name=via[0]
                            )
                        except (PeerIdentityError, OSError, ssl.SSLError) as e:
                            log.error("relay refused; going to the driver directly", error=str(e))
                            self._relay_down = True
                            continue
                    if await self._relayed_session(via):
                        continue  # the relay failed us: straight to the driver, no backoff
                else:
                    await self._session(stub)
                    self._relay_down = False  # next time, try the relay again
            except grpc.aio.AioRpcError as e:
                self._on_rpc_error(e, target)
                if "declared lost" in (e.details() or ""):
                    await self._fence()
            except PeerIdentityError as e:
                log.error("not our driver", error=str(e))
                self.current += 1
            except (OSError, ssl.SSLError) as e:
                log.warning("driver unreachable", driver=target, error=str(e))
                self.current += 1
            finally:
                await ch.close(grace=None)
            if self.stop.is_set():
                return
            if time.monotonic() - last_ok > self.config.max_disconnected_s:
                raise AgentExit(
                    3,
                    f"no driver reachable for {self.config.max_disconnected_s} s "
                    f"(tried {', '.join(self.endpoints)})",
                )
            wait = backoff
            if time.monotonic() < self._electing_until:
                # a live standby answered: the control plane is up and electing; a short
                # jittered retry finds the winner (at most every agent's few calls a
                # second, each refused cheaply, for the lease's TTL)
                wait = min(backoff, self.config.election_retry_s)
            await asyncio.sleep(wait * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, self.config.backoff_max_s)

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

    async def _relayed_session(self, via: tuple[str, str]) -> bool:
        """Hold the session through the relay; True when the relay failed (unreachable,
        refused, died): the caller goes to the driver directly at once."""
        ch = self._channel(via[1])
        session = asyncio.create_task(self._session(dgrpc.DriverStub(ch)))
        self._heard = time.monotonic()
        try:
            while not session.done():
                await asyncio.wait({session}, timeout=0.1)
                if not session.done() and time.monotonic() - self._heard > SILENT_S:
                    session.cancel()  # stopped or cut off: it breaks no connection
                    with contextlib.suppress(asyncio.CancelledError):
                        await session
                    log.warning(
                        "relay silent; going to the driver directly", relay=via[0], s=SILENT_S
                    )
                    self._relay_down = True
                    return True
            session.result()
            return False
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # the driver sent us away through the relay (declared lost): register again
                log.warning("the driver asks us to register again", details=e.details())
                return True
            log.warning(
                "relay failed; going to the driver directly",
                relay=via[0],
                code=e.code().name,
                details=(e.details() or "")[:200],
            )
            self._relay_down = True
            return True
        finally:
            if not session.done():  # (we are being cancelled)
                session.cancel()
            await ch.close(grace=None)

    def _on_rpc_error(self, e: grpc.aio.AioRpcError, target: str) -> None:
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise AgentExit(2, f"driver {target} refused our credentials: {e.details()}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise AgentExit(2, f"driver {target} rejected the registration: {e.details()}")
        details = (e.details() or "").lower()
        if code == grpc.StatusCode.FAILED_PRECONDITION and "register" not in details:
            raise AgentExit(1, f"driver {target} refused this node: {e.details()}")
        leader, standby = "", False
        for k, v in e.trailing_metadata() or ():
            if k == channel.LEADER_KEY:
                leader, standby = str(v), True
        # a standby that knows no leader, or names one of ours (maybe the one that just
        # died: its lease has not expired yet), is waiting for an election to end
        if standby and (not leader or leader in self.config.drivers):
            self._electing_until = time.monotonic() + ELECTION_WINDOW_S
        if leader and leader != target and leader in self.config.drivers:
            self.current = self.endpoints.index(leader)
            log.info("redirected to the leader", leader=leader)
        elif leader and leader != target:  # not one of ours: never follow (nor send it a token)
            self.current += 1
            log.warning(
                "ignoring a redirect to a driver not in --driver", leader=leader, driver=target
            )
        elif code != grpc.StatusCode.FAILED_PRECONDITION:
            self.current += 1
            log.warning(
                "driver unreachable; trying the next one",
                driver=target,
                code=code.name,
                details=(e.details() or "")[:200],
            )

    async def _session(self, stub: dgrpc.DriverStub) -> None:
        md = (
            *self._metadata,
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
                await self._write(call, msg)

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
                self._heard = time.monotonic()
                if msg.WhichOneof("kind") is None:
                    continue  # a relay's tick: it is alive
                if msg.WhichOneof("kind") == "relayed" and self.relay is not None:
                    self.relay.deliver(msg.relayed)
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

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _refuse(self, call: Any, cid: str, detail: str) -> None:
        """Answer command `cid` with a refusal saying why (best effort: the stream may be gone)."""
        with contextlib.suppress(Exception):
            await self._write(
                call,
                dpb.AgentMessage(ack=dpb.CommandAck(command_id=cid, ok=False, detail=detail)),
            )

    async def _write(self, call: Any, msg: dpb.AgentMessage) -> None:
        async with self._write_lock:
            await call.write(msg)

    # ------------------------------------------------------------ heartbeats
    async def _heartbeats(self, call: Any) -> None:
        next_t = time.monotonic()
        next_host = next_t
        every_host = self.config.host_stats_every_ms / 1000.0
        sup = self.supervisor
        if sup is not None and any(w.exit_code for w in sup.workers.values()):
            sup.exited = True  # a new session: re-announce exits the driver may have missed
        self.loop_lag.start()
        cpus = starvation.usable_cpus()
        beats = 0
        while True:
            if self.config.realtime and beats % 50 == 0:  # gRPC may start threads any time
                starvation.realtime_grpc_threads()
            beats += 1
            now = time.monotonic()
            hb = self._heartbeat(now)
            # how starved we were: the driver reads a late heartbeat of a starved node as such
            late_ms = max(0.0, now - next_t) * 1000.0
            self.loop_lag.note(late_ms)
            hb.late_ms = late_ms
            hb.loop_lag_ms = self.loop_lag.take()
            if self.gil_boost is not None:  # a real-time loop that lags waits for the GIL
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
                await self._write(call, dpb.AgentMessage(relay_batch=batch))
            else:
                await self._write(call, dpb.AgentMessage(heartbeat=hb))
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
                await self._extra_heartbeat(call)

    async def _kicked(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a worker's first step (True) or the next slot (False)."""
        if timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_soon.wait(), timeout_s)
        kicked = self._beat_soon.is_set()
        self._beat_soon.clear()
        return kicked

    async def _extra_heartbeat(self, call: Any) -> None:
        """One heartbeat now, off the schedule (not behind a relay: its batches keep it)."""
        if self.relay is not None and self.relay.upstream is not None:
            return
        hb = self._heartbeat(time.monotonic())
        hb.sent_mono_ns = time.monotonic_ns()
        await self._write(call, dpb.AgentMessage(heartbeat=hb))
        self.metrics.sent(hb)

    async def _ring_heartbeat(self, call: Any) -> bool:
        """After a stop: rescan the flash rings and send a heartbeat with them now, ahead
        of the ack (True). Without it the driver waited for two more heartbeats after the
        ack (~200 ms of every incident's pause; the recovery bench's worker crashes lost
        1.0-1.6 s each). Not behind a relay, whose batches keep the interval (False)."""
        if self.flash is None or self.supervisor is None or not self.session_open:
            return False
        if self.relay is not None and self.relay.upstream is not None:
            return False
        await self.flash.rescan()
        hb = self._heartbeat(time.monotonic())
        hb.sent_mono_ns = time.monotonic_ns()
        await self._write(call, dpb.AgentMessage(heartbeat=hb))
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
                await self._write(call, out)
            except BaseException:
                flash.reports.extendleft(reversed(batch))  # the next session reports them
                raise

    # ------------------------------------------------------------ commands
    async def _command(self, call: Any, msg: dpb.DriverMessage) -> None:
        kind = msg.WhichOneof("kind")
        cid = msg.command_id
        log.info("command", kind=kind, command_id=cid, term=msg.term)
        if msg.term_scope != self.term_scope:
            # a term of another etcd cluster or an earlier incarnation of the job: its
            # number means nothing here, whether above or below ours
            log.error(
                "command of another term scope refused",
                scope=msg.term_scope,
                ours=self.term_scope,
                term=msg.term,
            )
            await self._refuse(
                call,
                cid,
                f"leader term {msg.term} of scope {msg.term_scope!r} (etcd cluster and job "
                f"incarnation) is not of this session's scope {self.term_scope!r}: refused",
            )
            return
        if msg.term > self.session_term + TERM_SLACK:
            # a term no election of this session can have made: never adopted, so it
            # cannot make every later command of the real leader look stale
            log.error(
                "command with an implausible leader term refused",
                term=msg.term,
                session_term=self.session_term,
            )
            await self._refuse(
                call,
                cid,
                f"leader term {msg.term} is more than {TERM_SLACK} above the term "
                f"{self.session_term} this session registered under: refused",
            )
            return
        if msg.term < self.term_seen:
            log.warning(
                "command of an older leader term dropped", term=msg.term, newest=self.term_seen
            )
            await self._refuse(
                call, cid, f"stale leader term {msg.term} < {self.term_seen}: dropped"
            )
            return
        self.term_seen = msg.term
        try:
            if kind == "run_self_check":
                rep = await self._selfcheck(cid, msg.run_self_check.timeout_s)
                await self._write(call, dpb.AgentMessage(self_check_report=rep))
                return
            if kind == "inject_fault" and _is_node_loss(msg.inject_fault.kind):
                await self._write(
                    call,
                    dpb.AgentMessage(
                        ack=dpb.CommandAck(command_id=cid, ok=True, detail="node-loss: exiting")
                    ),
                )
                await asyncio.sleep(0.2)  # let the ack leave; then die like a machine would
                self._die()
            if kind == "run_check":
                t0 = time.monotonic()
                warm_before = self.warm_check.taken if self.warm_check is not None else 0
                res = await checks.run_check(
                    cid,
                    msg.run_check.spec_json,
                    self.fault,
                    msg.run_check.timeout_s or self.config.check_timeout_s,
                    warm=self.warm_check,
                )
                log.info(
                    "check ran",
                    command_id=cid,
                    exit_code=res.exit_code,
                    warm=bool(self.warm_check and self.warm_check.taken > warm_before),
                    seconds=round(time.monotonic() - t0, 2),
                )
                await self._write(call, dpb.AgentMessage(check_result=res))
                return
            detail = await self._do(kind, msg)
            fresh = False
            if kind == "stop_workers":
                try:
                    fresh = await self._ring_heartbeat(call)
                except Exception as e:  # the driver then waits for the next heartbeats
                    log.warning("ring heartbeat not sent", error=str(e))
            await self._write(
                call,
                dpb.AgentMessage(
                    ack=dpb.CommandAck(
                        command_id=cid, ok=True, detail=detail[:16000], ring_fresh=fresh
                    )
                ),
            )
        except AgentExit:
            raise
        except Exception as e:
            if isinstance(e, ValueError):  # refused as asked: say why, no traceback
                log.warning("command refused", kind=kind, error=str(e))
            else:
                log.exception("command failed", kind=kind)
            with contextlib.suppress(Exception):
                await self._write(
                    call,
                    dpb.AgentMessage(
                        ack=dpb.CommandAck(
                            command_id=cid, ok=False, detail=f"{type(e).__name__}: {e}"[:4000]
                        )
                    ),
                )
        if kind in ("shutdown", "evict"):
            self.stop.set()
            with contextlib.suppress(Exception):
                await call.done_writing()

    # ------------------------------------------------------------ self-checks
    async def _selfcheck(self, command_id: str, timeout_s: float = 0.0) -> dpb.SelfCheckReport:
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
        """Run the self-check once and send it; a session that ends first leaves it due."""
        async with self._selfcheck_lock:  # a quick reconnect must not start a second run
            if self._selfcheck_report is None:
                self._selfcheck_report = await self._selfcheck("")
        if not self._selfcheck_due:
            return
        try:
            await self._write(call, dpb.AgentMessage(self_check_report=self._selfcheck_report))
        except Exception as e:  # the session ended first: the next one sends it
            log.info("self-check report not sent; the next session sends it", error=repr(e))
            return
        self._selfcheck_due = False

    # ------------------------------------------------------------ injected faults
    def _inject(self, p: dpb.InjectFault) -> str:
        """Apply an injected fault (not node-loss: see `_die`); what was done."""
        f = RuntimeFault.of(p.kind, p.local_rank, p.factor, p.step)
        log.warning("fault injected", kind=f.kind, local_rank=f.local_rank, step=f.step)
        if f.kind in ("wrong-matmul", "slow"):
            spec = f.apply_to(FaultSpec.parse(self.fault))
            self.fault = str(spec) if spec.any else ""
            if self.supervisor is not None:  # workers started from now on see it too
                self.supervisor.launch = replace(self.supervisor.launch, fault=self.fault)
            return f"{f.kind}: checks now run with fault {spec}"
        sup = self.supervisor
        if sup is None or self.fault_file is None:
            raise ValueError(f"{f.kind}: this agent runs no workers (no --worker-cmd)")
        if f.kind == "slow-train":
            # the trainer reads it each step (trainer/run.py SlowFile)
            write_slow_factor(self.fault_file.with_name(SLOW_FILE), f.factor or 2.0)
            return f"slow-train: the workers compute {f.factor or 2.0:g}x slower"
        if f.kind in WORKER_FILE_FAULTS:
            step = f.step or max((w.step for w in sup.workers.values()), default=0) + 1
            detail = None
            if f.kind in SDC_FAULTS:
                detail = SdcDetail.of_message(p.sdc, f.local_rank, sorted(sup.workers))
            WorkerFault(f.kind, step, uuid.uuid4().hex, detail).write(self.fault_file)
            on = f" on local rank {detail.local_rank}" if detail is not None else ""
            return f"{f.kind}: written to {self.fault_file} for step {step}{on}"
        w = sup.workers.get(f.local_rank)
        if w is None or w.proc is None or w.proc.returncode is not None:
            running = sorted(r for r, x in sup.workers.items() if x.pid and x.exit_code == 0)
            raise ValueError(
                f"{f.kind}: no running worker of local rank {f.local_rank} (running: {running})"
            )
        sig = {"crash": signal.SIGKILL, "crash-suspect": signal.SIGSEGV}.get(f.kind, signal.SIGSTOP)
        os.kill(w.pid, sig)
        return f"{f.kind}: sent {sig.name} to local rank {f.local_rank} (pid {w.pid})"

    def _die(self) -> NoReturn:
        """node-loss: SIGKILL the workers and exit at once (no goodbye, no cleanup)."""
        log.warning("fault injected: node-loss; exiting without a goodbye")
        if self.supervisor is not None:
            for w in self.supervisor.workers.values():
                if w.pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.pid, signal.SIGKILL)
        os._exit(137)

    async def _do(self, kind: str | None, msg: dpb.DriverMessage) -> str:
        sup = self.supervisor
        if kind == "inject_fault":
            return self._inject(msg.inject_fault)
        if kind in ("shutdown", "evict"):
            if self.hooks is not None:  # scripts this agent did not start: save and exit
                self.hooks.send(hpb.WorkerCommand(command_id=msg.command_id, stop=kind))
            if sup is not None:
                await sup.stop_all(grace_s=2.0)
            return f"{kind}: workers stopped"
        if kind == "retention":
            if self.flash is None:
                return "retention: no flash store"
            gone = await asyncio.to_thread(
                self.flash.retain, list(msg.retention.keep_steps), msg.retention.below
            )
            return f"retention: deleted steps {gone}"
        if sup is None:
            raise ValueError(f"{kind}: this agent runs no workers (no --worker-cmd)")
        if kind == "restore_point":  # for the next start (engineer "drill"; trainer/run.py)
            rp = msg.restore_point
            point = WorkerEnv(
                restore_step=rp.step or None,
                skip_batches=(rp.skip_from_step, rp.skip_batches) if rp.skip_batches else None,
            )
            cleared: dict[str, str | None] = dict.fromkeys(workerenv.RESTORE_VARIABLES)
            sup.launch = sup.launch.with_env(**{**cleared, **point.to_env()})
            return f"restore point: step {rp.step or 'newest'}, skip {rp.skip_batches}"
        if kind == "start_workers":
            p = msg.start_workers
            cmd = sup.spec.split(p.worker_cmd) if p.worker_cmd else None
            if cmd is not None and cmd != sup.spec.cmd and not self.config.allow_remote_cmd:
                raise ValueError(
                    "start_workers: the driver sent a worker command other than this "
                    "agent's --worker-cmd; refused (start the agent with "
                    "--allow-remote-cmd to run the driver's)"
                )
            launch = sup.launch.started(p, cmd=cmd, pin_master=self.config.pin_master_addr)
            if self.flash is not None and p.buddy:
                # the world's ring, as the driver paired it: who this node sends to, and
                # whose copies its replica server takes
                self.flash.set_buddy(p.buddy, p.buddy_node, p.replicas_from)
            if self.flash is not None and p.replaces:
                # the replaced node's newest copies, from the replica server that holds them
                # (the driver knows it from the node's registration; else this node's buddy);
                # the workers look for them there
                if await self.flash.take_over(p.replaces, self.config.node_id, p.replaces_from):
                    launch = launch.with_env(**WorkerEnv(flash_node=p.replaces).to_env())
            if self.flash is not None:
                self.flash.world_size = launch.world_size
                if p.flash_bytes_per_rank:
                    mine = launch.ranks(sup.spec.nproc)
                    await asyncio.to_thread(self.flash.prepare, mine, p.flash_bytes_per_rank)
            sup.launch = launch
            if p.in_job:  # held workers rejoin in their processes; only the rest start
                return await injob.rejoin(sup, self.hooks)
            await sup.stop_all(grace_s=2.0)
            await sup.start_all()
            return f"started {len(sup.workers)} workers"
        if kind == "stop_workers" and msg.stop_workers.in_job:
            return await injob.hold(sup, self.hooks, msg.stop_workers.replace_local_ranks)
        if kind == "stop_workers":
            dumps = await sup.stop_all(
                grace_s=msg.stop_workers.grace_s or 5.0, dump=msg.stop_workers.dump_stacks
            )
            return _dumps_text(dumps)
        if kind == "restart_workers":
            ranks = list(msg.restart_workers.local_ranks) or list(sup.workers)
            dumps = {}
            for r in ranks:
                if r not in sup.workers:
                    raise ValueError(f"no local rank {r} on this node")
                dumps[r] = await sup.stop(sup.workers[r], 2.0, dump=msg.restart_workers.dump_stacks)
                await sup.start(r)
            return _dumps_text(dumps)
        assert self.hooks is not None
        if kind == "pause":
            n = self.hooks.send(
                hpb.WorkerCommand(command_id=msg.command_id, pause=msg.pause.reason or "paused")
            )
        elif kind == "resume":
            n = self.hooks.send(
                hpb.WorkerCommand(command_id=msg.command_id, resume=msg.resume.at_step)
            )
        elif kind == "flash_save":
            n = self.hooks.send(
                hpb.WorkerCommand(command_id=msg.command_id, flash_save=msg.flash_save.step)
            )
        else:
            raise ValueError(f"unknown command {kind!r}")
        return f"{kind} forwarded to {n} workers"


def _dumps_text(dumps: dict[int, str]) -> str:
    return "\n".join(f"--- local rank {r} ---\n{d}" for r, d in dumps.items() if d)


def _is_node_loss(kind: str) -> bool:
    return kind.strip().lower().replace("_", "-") == "node-loss"
