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

import structlog

from unbroken.agent.config import AgentConfig
from unbroken.agent.daemon import Agent
from unbroken.agent.flash import NodeFlashConfig
from unbroken.agent.launch import WorkerSpec, warm_default
from unbroken.common.config import add_config_flags
from unbroken.common.config import config_from_args as build
from unbroken.common.logsetup import setup_logging
from unbroken.common.paths import UnsafeRuntimeDirError
from unbroken.common.tls import TOKEN_ENV, TOKEN_FILE_ENV, TlsConfig, read_token
from unbroken.recovery.flashowner import UnsafeFlashRootError
from unbroken.recovery.nodekey import NodeKey
from unbroken.recovery.replicaauth import KEY_ENV as REPLICA_KEY_ENV

log = structlog.get_logger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken agent`: the config tree's (common/config.py), and the few that are
    not a field (credentials' files, switches that leave a part out, the log format)."""
    add_config_flags(parser, AgentConfig)
    add_config_flags(parser, WorkerSpec)
    flash = add_config_flags(parser, NodeFlashConfig)["flash checkpoints"]
    parser.add_argument(
        "--token-file",
        default=os.environ.get(TOKEN_FILE_ENV),
        help="file holding this node's token (default $UNBROKEN_TOKEN_FILE; or the token itself "
        "in $UNBROKEN_TOKEN); never on the command line",
    )
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tls-cert", default=None, help="this node's certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, help="this node's private key (mTLS)")
    parser.add_argument("--tls-ca", default=None, help="CA that signed the driver's certificate")
    parser.add_argument("--log-format", choices=("console", "json"), default="console")
    flash.add_argument("--no-flash", action="store_true", help="own no flash-checkpoint memory")
    flash.add_argument(
        "--replica-key-file",
        default=None,
        help="file holding the job's replica key (HMAC of the buddy stream without TLS; the "
        f"same on every node; or env {REPLICA_KEY_ENV}). With --tls-* the stream is mTLS",
    )


NO_LOCAL_CMD = [
    sys.executable,
    "-c",
    "raise SystemExit('unbroken agent: no --worker-cmd here and none from the driver')",
]


def config_from_args(ns: argparse.Namespace) -> AgentConfig:
    """An `AgentConfig` from parsed flags (ValueError naming the bad one)."""
    spec = None
    flash = None
    tls = TlsConfig(cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca)
    token = read_token(os.environ.get(TOKEN_ENV) or None, ns.token_file, argv_token=ns.token)
    if ns.worker_cmd or ns.allow_remote_cmd:
        # --allow-remote-cmd alone: the driver's StartWorkers names the command (until it
        # does, a start says so and fails)
        own = {} if ns.worker_cmd else {"cmd": NO_LOCAL_CMD}
        spec = build(
            WorkerSpec,
            ns,
            **own,
            log_dir=ns.log_dir or tempfile.mkdtemp(prefix="unbroken-agent-logs-"),
            fault=ns.inject_fault,
            warm=warm_default(ns.nproc_per_node) if ns.warm_workers is None else ns.warm_workers,
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
            flash = build(
                NodeFlashConfig,
                ns,
                root=ns.flash_dir or f"/dev/shm/unbroken/{node}",
                node=node,
                local_ranks=ns.nproc_per_node,
                replica_key=read_replica_key(ns.replica_key_file),
                # without TLS the node's own key signs its copies and streams, from its token
                node_key=NodeKey.derive(token, node) if token and not tls.enabled else None,
                tls=tls,
            )
    return build(
        AgentConfig,
        ns,
        workers=spec,
        token=token,
        tls=tls,
        flash=flash,
        pin_master_addr=ns.master_addr is not None,
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
    if cfg.realtime:
        from unbroken.agent import starvation

        why = starvation.realtime_loop()
        if why:
            log.warning("agent loop not real-time: heartbeats may wait under load", reason=why)
    try:
        return asyncio.run(_main(cfg))
    except (UnsafeFlashRootError, UnsafeRuntimeDirError) as e:  # the node is not closed
        print(f"unbroken agent: {e}", file=sys.stderr)
        return 2
