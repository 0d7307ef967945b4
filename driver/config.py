"""The driver's configs, from the root down: every flag of `unbroken driver`.

`DriverConfig` is the root (the process: ids, addresses, the event log, etcd, the scheduler);
it holds `ServiceConfig` (the agent-facing service, the operators' and launchers' handlers,
the journal, quotas, the checkpoint lifecycle) and `LoopConfig` (the job the driver starts
and recovers, with its recovery policy, driver/policy.py). Every flag is generated from
these fields (common/config.py); a component's own knobs stay in its module's config
(`JournalConfig`, `LiveViewConfig`, `BridgeConfig`, ...), held here.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field

from unbroken.common import channel
from unbroken.common.channel import is_loopback
from unbroken.common.tls import TlsConfig
from unbroken.driver.diagnose import DriverDiagnoseConfig
from unbroken.driver.etcd import EtcdConfig
from unbroken.driver.journal import JournalConfig
from unbroken.driver.liveview import LiveViewConfig
from unbroken.driver.policy import Policy
from unbroken.driver.principalquota import PrincipalQuotas
from unbroken.driver.scheduler import BridgeConfig
from unbroken.driver.security import RoleTokens
from unbroken.driver.slurm import SlurmConfig
from unbroken.driver.straggler import StragglerConfig
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.lifecycle import PersistPolicy

__all__ = ["DriverConfig", "LoopConfig", "ServiceConfig"]


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
        metadata={"prefix": "quota-", "group": "per-principal quotas (driver/principalquota.py)"},
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


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopConfig:
    """The job the driver starts and recovers (`unbroken driver --nodes ...`).

    `nodes` = 0 turns the loop off: agents start their own workers and faults are only
    recorded (the mode of the heartbeat-plane tests).
    """

    nodes: int = field(default=0, metadata={"help": "nodes in the world (0: no recovery loop)"})
    workers_per_node: int = field(default=1, metadata={"help": "workers per node"})
    dp: int = field(default=0, metadata={"help": "data parallel (0: the rest)"})
    pp: int = field(default=1, metadata={"help": "pipeline parallel degree"})
    tp: int = field(default=1, metadata={"help": "tensor parallel degree"})
    min_nodes: int = field(
        default=1, metadata={"flag": None, "why": "--min-nodes (policy.min_nodes)"}
    )
    trainer: str = field(
        default="external", metadata={"help": "trainer name recorded in JobStarted"}
    )
    worker_cmd: str = field(
        default="", metadata={"help": "worker command (empty: each agent's --worker-cmd)"}
    )
    master_addr: str = field(
        default="", metadata={"help": "rendezvous host (empty: rank 0's node IP)"}
    )
    stop_grace_s: float = field(
        default=5.0, metadata={"help": "workers' grace between SIGTERM and SIGKILL"}
    )
    command_timeout_s: float = field(
        default=60.0, metadata={"help": "deadline of one command to an agent"}
    )
    start_timeout_s: float = field(
        default=600.0, metadata={"help": "for the world's nodes to register"}
    )
    restore_timeout_s: float = field(
        default=300.0,
        metadata={"help": "for every rank of a restarted world to report a step"},
    )
    policy: Policy = field(default_factory=Policy)

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
            object.__setattr__(self, "dp", ranks // (self.pp * self.tp))  # a derived default
        if self.dp * self.pp * self.tp != ranks:
            raise ValueError(
                f"dp x pp x tp = {self.dp * self.pp * self.tp} but nodes x workers_per_node "
                f"= {ranks}; set --dp/--pp/--tp so that they are equal"
            )
        if self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) must be <= nodes ({self.nodes})")
        cap = self.policy.max_nodes
        if cap and self.nodes > cap:
            raise ValueError(
                f"--nodes {self.nodes} is more than --max-nodes {cap}: the first incident would "
                f"shrink the world to {cap} nodes; raise --max-nodes or leave it at 0 (the "
                "configured world's)"
            )

    def world(self, node_ids: list[str]) -> ev.WorldLayout:
        """The configured layout on `node_ids` (rank order)."""
        return ev.WorldLayout(
            dp=self.dp,
            pp=self.pp,
            tp=self.tp,
            node_ids=node_ids,
            workers_per_node=self.workers_per_node,
        )


# titles of flag groups in `unbroken driver --help`
JOB_FLAGS = "the job (with --nodes the driver starts and recovers it; agents run --no-start)"
SCHEDULER_FLAGS = "the cluster scheduler (README: Running under Slurm)"


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverConfig:
    """The root config of `unbroken driver`."""

    job_id: str = field(default="default", metadata={"help": "job name (etcd key prefix)"})
    driver_id: str = field(
        default="", metadata={"help": "this driver's id (empty: driver-<host>-<random>)"}
    )
    listen: str = field(
        default="127.0.0.1:50051",
        metadata={
            "help": "gRPC listen address host:port (port 0 picks a free one; a non-loopback "
            "host needs --tls-* or --token-file, or --insecure)"
        },
    )
    advertise: str = field(
        default="",
        metadata={"help": "host:port agents should use (empty: hostname + bound port)"},
    )
    metrics_port: int | None = field(
        default=None, metadata={"help": "Prometheus HTTP port (0: a free one; unset: off)"}
    )
    dashboard_port: int | None = field(
        default=None, metadata={"help": "web dashboard HTTP port (0: a free one; unset: off)"}
    )
    dashboard_host: str = field(
        default="127.0.0.1",
        metadata={"help": "web dashboard host (it accepts viewer tokens only)"},
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata={"help": "Prometheus endpoint host (beyond loopback only with --metrics-public)"},
    )
    metrics_public: bool = field(
        default=False,
        metadata={
            "help": "serve the metrics beyond loopback: they name nodes, errors and steps to "
            "anyone who reaches the port, with no credential (put them behind a firewall)"
        },
    )
    insecure: bool = field(
        default=False,
        metadata={
            "help": "allow a non-loopback --listen or --dashboard-host without TLS or tokens "
            "(says so loudly)"
        },
    )
    event_log: str = field(
        default="etcd",
        metadata={
            "choices": ("etcd", "memory"),
            "help": "where events go (memory: no etcd, for demos and benches)",
        },
    )
    # "": the library default, a local directory -- the CLI refuses that, since a failover
    # would split the history across hosts
    archive_url: str = field(
        default="",
        metadata={
            "env": "UNBROKEN_ARCHIVE",
            "help": "where events older than the newest snapshot are archived: an fsspec URL "
            "every driver of the job shares (s3://..., a shared path); 'none': keep all in "
            "etcd (required with the etcd event log)",
        },
    )
    etcd: EtcdConfig = field(
        default_factory=EtcdConfig, metadata={"prefix": "etcd-", "group": "etcd"}
    )
    service: ServiceConfig = field(default_factory=ServiceConfig)
    port_file: str | None = field(
        default=None,
        metadata={"help": "write {grpc_port, metrics_port, address} as JSON here"},
    )
    grace_s: float = field(
        default=2.0, metadata={"help": "how long in-flight RPCs may finish at shutdown"}
    )
    exit_when_finished: bool = field(
        default=False,
        metadata={
            "help": "exit 0 once the job finished (every worker of the world exited 0), so a "
            "batch job gives its nodes back; a failed job keeps the driver for `unbroken resume`"
        },
    )
    loop: LoopConfig = field(
        default_factory=LoopConfig,
        metadata={"group": JOB_FLAGS},
    )
    scheduler: str = field(
        default="none",
        metadata={
            "choices": ("none", "slurm"),
            "group": SCHEDULER_FLAGS,
            "help": "slurm: drain evicted nodes, start replacements' agents as job steps, "
            "treat DOWN/DRAIN as faults",
        },
    )
    slurm: SlurmConfig = field(
        default_factory=SlurmConfig,
        metadata={
            "prefix": "slurm-",
            "group": SCHEDULER_FLAGS,
        },
    )
    bridge: BridgeConfig = field(
        default_factory=BridgeConfig,
        metadata={
            "prefix": "scheduler-",
            "group": SCHEDULER_FLAGS,
        },
    )

    def __post_init__(self) -> None:
        if self.scheduler not in ("none", "slurm"):
            raise ValueError(f"scheduler must be 'none' or 'slurm', got {self.scheduler!r}")
        if not self.job_id or len(self.job_id) > 64 or "/" in self.job_id:
            raise ValueError(f"job_id must be 1-64 characters without '/', got {self.job_id!r}")
        if self.event_log not in ("etcd", "memory"):
            raise ValueError(f"event_log must be 'etcd' or 'memory', got {self.event_log!r}")
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.dashboard_port is not None and not 0 <= self.dashboard_port <= 65535:
            raise ValueError(f"dashboard_port must be in [0, 65535], got {self.dashboard_port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        svc = self.service
        cap = svc.live.max_nodes
        wanted = max(self.loop.nodes, self.loop.policy.max_nodes)
        if wanted > cap:
            # bench-scale at 20,480: the nodes past the cap were refused and retried for
            # 900 s, and the join never finished
            raise ValueError(
                f"the job may hold {wanted} nodes (--nodes / --max-nodes) but the driver "
                f"registers at most {cap}; raise --max-registered-nodes above {wanted} "
                "(spares and replacements register too)"
            )
        exposed = exposure_problems(
            self.listen,
            self.dashboard_host if self.dashboard_port is not None else None,
            credentials=svc.tls.enabled or svc.tokens is not None,
            insecure=self.insecure,
        )
        if exposed:
            raise ValueError(exposed[0])
        if self.metrics_port is not None:
            problem = metrics_exposure(self.metrics_host, public=self.metrics_public)
            if problem:
                raise ValueError(problem)
        if not self.driver_id:
            driver_id = f"driver-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
            object.__setattr__(self, "driver_id", driver_id)  # a derived default


def exposure_problems(
    listen: str, dashboard_host: str | None, *, credentials: bool, insecure: bool
) -> list[str]:
    """Why the driver would serve beyond loopback without credentials (none: fine)."""
    if credentials or insecure:
        return []
    hosts = [("--listen", listen.rsplit(":", 1)[0])]
    if dashboard_host is not None:
        hosts.append(("--dashboard-host", dashboard_host))
    return [
        f"{what} {host} is not a loopback address and the driver has no "
        "credentials: anyone who reaches it could evict nodes and read the job. "
        "Give it certificates (--tls-cert/--tls-key/--tls-ca) or role tokens "
        "(--token-file ROLE=PATH), or pass --insecure to run open anyway"
        for what, host in hosts
        if not is_loopback(host)
    ]


def metrics_exposure(host: str, *, public: bool) -> str:
    """Why `--metrics-host HOST` is refused ("" when it is not): the endpoint takes no
    credential, so beyond loopback it needs the explicit `--metrics-public`."""
    if public or is_loopback(host):
        return ""
    return (
        f"--metrics-host {host} is not a loopback address: the metrics endpoint takes no "
        "credential and names nodes, errors and steps. Pass --metrics-public to serve it "
        "there anyway (behind a firewall that lets only Prometheus in), or scrape it on "
        "loopback"
    )
