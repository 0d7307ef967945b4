"""The node agent's configuration: one dataclass, validated where it is built.

Every field is a flag of `unbroken-agent` (agent/main.py builds the parser from the fields'
metadata); a field with `"flag": None` is built from other flags. Validation raises
`ValueError` naming the field and what to pass instead, including the security rules: a bearer
token never travels to a non-loopback driver or relay without TLS, and the metrics endpoint,
which takes no credential, stays on loopback unless asked.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from unbroken.agent.flash import NodeFlashConfig
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.relay import parse_relay
from unbroken.common.channel import endpoint_is_loopback, is_loopback
from unbroken.common.faults import FaultSpec
from unbroken.common.paths import DEFAULT_SOCKET, group_id
from unbroken.common.tls import TlsConfig


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
    selfcheck_after_s: float = field(
        default=0.0,
        metadata={
            "help": "run the registration self-check this long after the agent starts (0: at "
            "once). For a spare on a host shared with the job's first start (several nodes on "
            "a few cores), where its check competes with the workers' imports, e.g. 25",
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
