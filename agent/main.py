"""`unbroken agent`: the node daemon's entry point (flags -> config -> run -> close)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from unbroken.agent.daemon import Agent, AgentConfig
from unbroken.agent.flash import NodeFlashConfig
from unbroken.agent.hang import HangConfig
from unbroken.agent.warm import DEFAULT_PRELOAD
from unbroken.agent.workers import DEFAULT_KEYWORDS, WorkerSpec
from unbroken.common.logsetup import setup_logging
from unbroken.common.paths import UnsafeRuntimeDirError
from unbroken.common.tls import TOKEN_ENV, TOKEN_FILE_ENV, TlsConfig, read_token
from unbroken.recovery.flashowner import FLASH_COPIES, UnsafeFlashRootError
from unbroken.recovery.replica import KEY_ENV as REPLICA_KEY_ENV
from unbroken.recovery.sources import PERSIST_EVERY_S

#: Cores per local worker from which warm standbys are on by default (`--warm-workers`).
WARM_CORES_PER_WORKER = 4


def warm_default(nproc: int, cpus: int | None = None) -> bool:
    """Warm standbys by default when the node has spare cores for their imports: at least
    `WARM_CORES_PER_WORKER` per local worker (a GPU node: 8 workers, 64+ cores)."""
    n = (os.cpu_count() or 0) if cpus is None else cpus
    return n >= WARM_CORES_PER_WORKER * max(1, nproc)


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken agent`."""
    parser.add_argument(
        "--driver", required=True, help="driver endpoints host:port, comma-separated (standbys too)"
    )
    parser.add_argument("--node-id", default=None, help="this node's id (default: hostname)")
    parser.add_argument("--worker-cmd", default="", help="command run once per local rank")
    parser.add_argument(
        "--allow-remote-cmd",
        action="store_true",
        help="run the worker command the driver sends in StartWorkers when it differs from "
        "--worker-cmd (off: a driver, or whoever holds its credentials, cannot make this node "
        "run a command of its choosing)",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument(
        "--master-addr",
        default=None,
        help="rendezvous host of the workers; given, it wins over the driver's "
        "(default: the driver's choice, else 127.0.0.1)",
    )
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument(
        "--no-start",
        action="store_true",
        help="wait for the driver's StartWorkers instead of starting at once",
    )
    parser.add_argument("--log-dir", default=None, help="worker logs (default: a temp dir)")
    parser.add_argument(
        "--keywords",
        default=",".join(DEFAULT_KEYWORDS),
        help="comma-separated log keywords that raise an alert",
    )
    parser.add_argument(
        "--heartbeat-interval-ms",
        type=int,
        default=100,
        help="interval until the driver sets its own (default 100)",
    )
    parser.add_argument("--socket", default="", help="unix socket of the local hooks channel")
    parser.add_argument("--spare", action="store_true", help="register as a spare node")
    parser.add_argument(
        "--inject-fault",
        default="",
        help="fault spec passed to workers (UNBROKEN_FAULT) and to checks",
    )
    parser.add_argument(
        "--selfcheck-timeout-s",
        type=float,
        default=120.0,
        help="deadline of a self-check run (default 120; later it counts as failed)",
    )
    parser.add_argument(
        "--no-selfcheck",
        action="store_true",
        help="do not run the self-checks after registering (the driver can still ask)",
    )
    parser.add_argument(
        "--max-disconnected-s",
        type=float,
        default=600.0,
        help="give up after this long without a driver (default 600)",
    )
    parser.add_argument("--tls-cert", default=None, help="agent certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, help="agent private key (mTLS)")
    parser.add_argument("--tls-ca", default=None, help="CA that signed the driver's cert")
    parser.add_argument(
        "--token-file",
        default=os.environ.get(TOKEN_FILE_ENV),
        help="file holding this node's token (default $UNBROKEN_TOKEN_FILE; or the token itself "
        "in $UNBROKEN_TOKEN); never on the command line",
    )
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log-format", choices=("console", "json"), default="console")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="this node's Prometheus endpoint (workers, flash, replicas; 0: a free port; "
        "default: off)",
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="metrics endpoint host (default loopback)"
    )
    r = parser.add_argument_group("relays (agent/relay.py; past ~1,000 nodes)")
    r.add_argument(
        "--relay-listen",
        default="",
        help="act as the relay of a group of nodes: serve their sessions on HOST:PORT and "
        "forward one batch per heartbeat interval to the driver",
    )
    r.add_argument(
        "--relay",
        default="",
        help="heartbeat through this relay, ID@HOST:PORT (its node id and --relay-listen); "
        "the driver is used directly whenever the relay is unreachable",
    )
    parser.add_argument(
        "--worker-nice",
        type=int,
        default=5,
        help="niceness added for workers and checks, so heartbeats keep the CPU (default 5)",
    )
    h = parser.add_argument_group("hang detection (agent/hang.py)")
    h.add_argument(
        "--hang-floor-ms",
        type=float,
        default=1000.0,
        help="a rank is hung after no progress for max(this, k x its p90 step time) (default 1000)",
    )
    h.add_argument("--hang-k", type=float, default=5.0, help="k of the rule above (default 5)")
    h.add_argument(
        "--hang-phase-limit-ms",
        type=float,
        default=300_000.0,
        help="the limit in restore / checkpoint / eval / startup and before the first steps "
        "(default 300000)",
    )
    w = parser.add_argument_group("warm standby workers (agent/warm.py)")
    w.add_argument(
        "--warm-workers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hand worker starts to warm standbys that already imported torch (a Python "
        "worker command only). Default: on when the node has spare cores (at least "
        f"{WARM_CORES_PER_WORKER} per local worker), as GPU nodes do; off on smaller hosts, "
        "where the standbys' imports compete with training (bench/results/recovery.json)",
    )
    w.add_argument(
        "--warm-preload",
        default=",".join(DEFAULT_PRELOAD),
        help="comma-separated modules a standby imports while it waits",
    )
    w.add_argument(
        "--warm-refill-after-s",
        type=float,
        default=30.0,
        help="new standbys start once restarted workers step, or after this long (default 30)",
    )
    w.add_argument(
        "--warm-nice",
        type=int,
        default=5,
        help="niceness added while a standby waits; it takes the workers' at hand-off "
        "(default 5, the workers'; 19 leaves the imports only idle CPU, which on a "
        "saturated host kept standbys from getting ready in time)",
    )
    g = parser.add_argument_group("flash checkpoints")
    g.add_argument("--no-flash", action="store_true", help="own no flash-checkpoint memory")
    g.add_argument(
        "--flash-dir",
        default=None,
        help="tmpfs folder for flash copies (default /dev/shm/unbroken/<flash node>, so "
        "several agents on one host never share one)",
    )
    g.add_argument("--flash-job", default="default", help="job name (a folder in --flash-dir)")
    g.add_argument(
        "--flash-node",
        default=None,
        help="ring slot this node fills (default: --node-id); a replacement for a lost node "
        "passes the lost node's name to get its copies back from the buddy",
    )
    g.add_argument(
        "--persist-url",
        default=None,
        help="fsspec URL or directory for persisted copies, shared by every node and "
        "outliving them (required unless --no-flash)",
    )
    g.add_argument(
        "--persist-every-s",
        type=float,
        default=PERSIST_EVERY_S,
        help="about how often workers mark a flash copy for persistence, until the driver "
        "sends its own interval (Young/Daly from the job's failure rate and save cost)",
    )
    g.add_argument(
        "--flash-copies",
        type=int,
        default=FLASH_COPIES,
        help="flash copies kept per rank in shared memory (the ring; default 0: from a "
        "quarter of the tmpfs over the node's ranks, 2 to 8; fewer when the tmpfs cannot "
        "hold them, never under 2). More copies let a loss-spike rollback restore from "
        "memory a step from before the spike was detected",
    )
    g.add_argument(
        "--replica-listen",
        default="127.0.0.1:0",
        help="host:port of this node's replica server (port 0: a free one)",
    )
    g.add_argument(
        "--buddy",
        default="",
        help="host:port of the next node's replica server (the ring); empty: no replicas",
    )
    g.add_argument(
        "--replica-key-file",
        default=None,
        help="file holding the job's replica key (HMAC of the buddy stream without TLS; the "
        f"same on every node; or env {REPLICA_KEY_ENV}). With --tls-* the stream is mTLS",
    )
    g.add_argument(
        "--replica-grants",
        default=None,
        help='JSON file {lost node: ["node:REPLACEMENT", ...]}: who besides the node itself '
        "may fetch its replicas from this buddy (mTLS only; re-read on every fetch)",
    )


def config_from_args(ns: argparse.Namespace) -> AgentConfig:
    """An `AgentConfig` from parsed flags (ValueError naming the bad one)."""
    spec = None
    flash = None
    if ns.worker_cmd:
        spec = WorkerSpec(
            cmd=WorkerSpec.split(ns.worker_cmd),
            nproc=ns.nproc_per_node,
            nnodes=ns.nnodes,
            node_rank=ns.node_rank,
            master_addr=ns.master_addr or "127.0.0.1",
            master_port=ns.master_port,
            log_dir=ns.log_dir or tempfile.mkdtemp(prefix="unbroken-agent-logs-"),
            keywords=tuple(k for k in ns.keywords.split(",") if k),
            fault=ns.inject_fault,
            nice=ns.worker_nice,
            warm=warm_default(ns.nproc_per_node) if ns.warm_workers is None else ns.warm_workers,
            warm_preload=tuple(m for m in ns.warm_preload.split(",") if m),
            warm_refill_after_s=ns.warm_refill_after_s,
            warm_nice=ns.warm_nice,
            hang=HangConfig(
                floor_ms=ns.hang_floor_ms, k=ns.hang_k, phase_limit_ms=ns.hang_phase_limit_ms
            ),
        )
        if not ns.no_flash:
            if not ns.persist_url:
                raise ValueError(
                    "--persist-url is required with flash checkpoints: storage every node "
                    "can read and that outlives this node (a shared filesystem path or an "
                    "fsspec URL such as s3://bucket/job); a checkpoint committed to this "
                    "node's own disk dies with the node. Or pass --no-flash; `unbroken up` "
                    "passes its run directory"
                )
            node = ns.flash_node or ns.node_id or socket.gethostname()
            flash = NodeFlashConfig(
                root=ns.flash_dir or f"/dev/shm/unbroken/{node}",
                job=ns.flash_job,
                node=node,
                persist_url=ns.persist_url,
                persist_every_s=ns.persist_every_s,
                copies=ns.flash_copies,
                local_ranks=ns.nproc_per_node,
                listen=ns.replica_listen,
                buddy=ns.buddy,
                replica_key=read_replica_key(ns.replica_key_file),
                tls=TlsConfig(cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca),
                replica_grants=ns.replica_grants,
            )
    kw = {"node_id": ns.node_id} if ns.node_id else {}
    return AgentConfig(
        drivers=[d.strip() for d in ns.driver.split(",") if d.strip()],
        heartbeat_interval_ms=ns.heartbeat_interval_ms,
        workers=spec,
        start_workers=not ns.no_start,
        socket_path=ns.socket,
        spare=ns.spare,
        max_disconnected_s=ns.max_disconnected_s,
        token=read_token(os.environ.get(TOKEN_ENV) or None, ns.token_file, argv_token=ns.token),
        tls=TlsConfig(cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca),
        fault=ns.inject_fault,
        selfcheck_timeout_s=ns.selfcheck_timeout_s,
        selfcheck_at_register=not ns.no_selfcheck,
        flash=flash,
        allow_remote_cmd=ns.allow_remote_cmd,
        metrics_port=ns.metrics_port,
        metrics_host=ns.metrics_host,
        pin_master_addr=ns.master_addr is not None,
        relay_listen=ns.relay_listen,
        relay=ns.relay,
        **kw,
    )


def read_replica_key(path: str | None) -> bytes | None:
    """The job's replica key from `--replica-key-file`, else UNBROKEN_REPLICA_KEY, else None."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--replica-key-file {path!r} does not exist")
        return p.read_bytes().strip() or None
    return os.environ.get(REPLICA_KEY_ENV, "").strip().encode() or None


async def _main(cfg: AgentConfig) -> int:
    from unbroken.common import reaper

    reaper.start()  # the workers and their children die with this agent, however it dies
    agent = Agent(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop.set)
    return await agent.run()


def run(ns: argparse.Namespace) -> int:
    """`unbroken agent`."""
    setup_logging(ns.log_format)
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        print(f"unbroken agent: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(cfg))
    except (UnsafeFlashRootError, UnsafeRuntimeDirError) as e:  # the node is not closed
        print(f"unbroken agent: {e}", file=sys.stderr)
        return 2
