"""`unbroken driver`: one driver process (leader or standby) serving agents.

Thin entry point: logging -> flags -> config -> run -> always close. The process connects
to etcd (an embedded one when `--etcd` is not given), campaigns for leadership, and while
it waits answers agents with UNAVAILABLE plus the leader's address. Once elected it
replays the event log, appends LeaderElected and starts the detectors. Losing the lease
steps it down and it campaigns again. `--event-log memory` skips etcd (benchmarks, demos).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from unbroken.driver import detectors
from unbroken.driver.etcd import EmbeddedEtcd, EtcdConfig, add_etcd_flags
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore, Leadership
from unbroken.driver.liveview import LiveViewConfig
from unbroken.driver.loop import LoopConfig, RecoveryLoop
from unbroken.driver.machine import Policy
from unbroken.driver.security import TlsConfig, read_token
from unbroken.driver.service import DriverService, ServiceConfig, build_server
from unbroken.proto import events_pb2 as ev
from unbroken.proto.logsetup import setup_logging

log = structlog.get_logger(__name__)


@dataclass(kw_only=True, slots=True)
class DriverConfig:
    """The root config of `unbroken driver`."""

    job_id: str = "default"
    driver_id: str = ""
    listen: str = "0.0.0.0:50051"
    advertise: str = ""  # host:port agents should use; default: hostname + bound port
    metrics_port: int | None = None  # None: no metrics endpoint; 0: a free port
    event_log: str = "etcd"
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    port_file: str | None = None
    grace_s: float = 2.0
    loop: LoopConfig = field(default_factory=LoopConfig)

    def __post_init__(self) -> None:
        if not self.job_id or len(self.job_id) > 64 or "/" in self.job_id:
            raise ValueError(f"job_id must be 1-64 characters without '/', got {self.job_id!r}")
        if self.event_log not in ("etcd", "memory"):
            raise ValueError(f"event_log must be 'etcd' or 'memory', got {self.event_log!r}")
        if ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if not self.driver_id:
            self.driver_id = f"driver-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken driver`."""
    parser.add_argument("--job-id", default="default", help="job name (etcd key prefix)")
    parser.add_argument("--driver-id", default="", help="this driver's id (default: random)")
    parser.add_argument(
        "--listen",
        default="0.0.0.0:50051",
        help="gRPC listen address host:port (port 0 picks a free one)",
    )
    parser.add_argument("--advertise", default="", help="address agents should use")
    parser.add_argument(
        "--heartbeat-interval-ms",
        type=int,
        default=100,
        help="agent heartbeat interval (10-60000, default 100)",
    )
    parser.add_argument(
        "--miss-limit",
        type=int,
        default=3,
        help="missed heartbeats before a node is lost (default 3)",
    )
    parser.add_argument(
        "--hang-k",
        type=float,
        default=5.0,
        help="hang = no progress for k x median step time (default 5)",
    )
    parser.add_argument(
        "--hang-floor-ms",
        type=float,
        default=30_000.0,
        help="...but at least this long (default 30000)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus HTTP port (0: a free one; default: off)",
    )
    parser.add_argument("--reflection", action="store_true", help="enable gRPC reflection")
    parser.add_argument("--tls-cert", default=None, help="server certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, help="server private key (mTLS)")
    parser.add_argument("--tls-ca", default=None, help="CA that signs agent certificates")
    parser.add_argument("--token", default=None, help="bearer token agents must present")
    parser.add_argument("--token-file", default=None, help="file holding the bearer token")
    parser.add_argument(
        "--event-log",
        choices=("etcd", "memory"),
        default="etcd",
        help="where events go (memory: no etcd, for demos and benches)",
    )
    parser.add_argument(
        "--port-file", default=None, help="write {grpc_port, metrics_port, address} as JSON here"
    )
    parser.add_argument("--log-format", choices=("console", "json"), default="console")
    g = parser.add_argument_group(
        "the job (with --nodes the driver starts and recovers it; agents run --no-start)"
    )
    g.add_argument(
        "--nodes", type=int, default=0, help="nodes in the world (default 0: no recovery loop)"
    )
    g.add_argument("--workers-per-node", type=int, default=1, help="workers per node")
    g.add_argument("--dp", type=int, default=0, help="data parallel (default: the rest)")
    g.add_argument("--pp", type=int, default=1, help="pipeline parallel degree")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    g.add_argument("--min-nodes", type=int, default=1, help="fail below this many nodes")
    g.add_argument(
        "--worker-cmd", default="", help="worker command (default: each agent's --worker-cmd)"
    )
    g.add_argument("--master-addr", default="", help="rendezvous host (default: rank 0's node IP)")
    g.add_argument("--trainer", default="external", help="trainer name recorded in JobStarted")
    add_etcd_flags(parser)


def config_from_args(ns: argparse.Namespace) -> DriverConfig:
    """A `DriverConfig` from parsed flags (ValueError naming the bad one)."""
    service = ServiceConfig(
        live=LiveViewConfig(
            heartbeat_interval_ms=ns.heartbeat_interval_ms, miss_limit=ns.miss_limit
        ),
        detectors=detectors.DetectorConfig(hang_k=ns.hang_k, hang_floor_ms=ns.hang_floor_ms),
        reflection=ns.reflection,
        tls=TlsConfig(cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca),
        token=read_token(ns.token, ns.token_file),
    )
    return DriverConfig(
        job_id=ns.job_id,
        driver_id=ns.driver_id,
        listen=ns.listen,
        advertise=ns.advertise,
        metrics_port=ns.metrics_port,
        event_log=ns.event_log,
        etcd=_etcd_config(ns),
        service=service,
        port_file=ns.port_file,
        loop=LoopConfig(
            nodes=ns.nodes,
            workers_per_node=ns.workers_per_node,
            dp=ns.dp,
            pp=ns.pp,
            tp=ns.tp,
            worker_cmd=ns.worker_cmd,
            master_addr=ns.master_addr,
            trainer=ns.trainer,
            policy=Policy(min_nodes=ns.min_nodes, diagnose_kinds=frozenset()),
        ),
    )


def _etcd_config(ns: argparse.Namespace) -> EtcdConfig:
    from unbroken.driver import etcd as etcdmod

    return etcdmod.config_from_args(ns)


async def serve(cfg: DriverConfig) -> int:
    """Run the driver until SIGTERM/SIGINT; return the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = DriverService(cfg.service, driver_id=cfg.driver_id, job_id=cfg.job_id)
    server, port, health_servicer = await build_server(service, cfg.listen)
    host = cfg.listen.rsplit(":", 1)[0]
    advertise = cfg.advertise or (
        f"{host if host not in ('0.0.0.0', '[::]', '') else socket.gethostname()}:{port}"
    )
    metrics_port = service.metrics.serve(cfg.metrics_port) if cfg.metrics_port is not None else 0
    structlog.contextvars.bind_contextvars(driver=cfg.driver_id, job=cfg.job_id)
    log.info("driver listening", address=advertise, metrics_port=metrics_port)
    if cfg.port_file:
        tmp = Path(cfg.port_file + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "grpc_port": port,
                    "metrics_port": metrics_port,
                    "address": advertise,
                    "driver_id": cfg.driver_id,
                }
            )
        )
        os.replace(tmp, cfg.port_file)
    service.start()
    try:
        if cfg.event_log == "memory":
            store = InMemoryStore()
            leadership = store.elect(cfg.driver_id)
            mlog = InMemoryEventLog(store, cfg.job_id, leadership)
            rloop = await _take_lead(service, mlog, leadership, advertise, cfg.loop)
            await stop.wait()
            if rloop is not None:
                await rloop.close()
        else:
            await _lead_on_etcd(cfg, service, advertise, stop)
        return 0
    finally:
        log.info("driver shutting down")
        await health_servicer.enter_graceful_shutdown()
        await server.stop(cfg.grace_s)
        await service.close()


async def _take_lead(
    service: DriverService,
    elog: Any,
    leadership: Leadership,
    address: str,
    loop_cfg: LoopConfig,
) -> RecoveryLoop | None:
    """Replay, append LeaderElected, lead; start the recovery loop when a job is configured."""
    state = await elog.replay()
    await elog.append(
        ev.Event(
            cause="election",
            leader_elected=ev.LeaderElected(
                driver_id=leadership.driver_id,
                lease_id=leadership.lease_id,
                term=leadership.term,
                address=address,
            ),
        )
    )
    service.lead(elog, address)
    log.info("leading", term=leadership.term, last_seq=state.last_seq, nodes=len(state.nodes))
    if not loop_cfg.nodes:
        return None
    rloop = RecoveryLoop(loop_cfg, service, elog, state)
    rloop.start()
    return rloop


async def _lead_on_etcd(
    cfg: DriverConfig, service: DriverService, address: str, stop: asyncio.Event
) -> None:
    from unbroken.driver import election as electionlib
    from unbroken.driver import etcdlog

    embedded: EmbeddedEtcd | None = None
    etcd_cfg = cfg.etcd
    if not etcd_cfg.endpoints:
        embedded = EmbeddedEtcd(etcd_cfg.data_dir).start()
        etcd_cfg = embedded.config
        log.info("embedded etcd started", endpoint=embedded.endpoint)
    client = await etcdlog.connect(etcd_cfg)
    try:
        while not stop.is_set():
            election = electionlib.Election(client, cfg.job_id, cfg.driver_id, address=address)
            follow = asyncio.create_task(_follow_leader(client, cfg.job_id, service))
            campaign = asyncio.create_task(election.campaign())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({campaign, stopped}, return_when=asyncio.FIRST_COMPLETED)
            follow.cancel()
            if stop.is_set():
                campaign.cancel()
                with contextlib.suppress(BaseException):
                    await campaign
                break
            leadership = campaign.result()
            elog = etcdlog.EtcdEventLog(client, cfg.job_id, leadership)
            rloop = await _take_lead(service, elog, leadership, address, cfg.loop)
            lost = asyncio.create_task(election.lost.wait())
            await asyncio.wait({lost, stopped}, return_when=asyncio.FIRST_COMPLETED)
            lost.cancel()
            if rloop is not None:
                await rloop.close()
            if stop.is_set():
                service.step_down()
                with contextlib.suppress(Exception):
                    await election.resign()
                await elog.close()
                break
            log.error("leadership lost; stepping down and campaigning again")
            service.step_down()
            await elog.close()
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        if embedded is not None:
            embedded.stop()


async def _follow_leader(client: Any, job_id: str, service: DriverService) -> None:
    """While standing by, keep `service.leader_address` pointing at the current leader."""
    from unbroken.driver import election as electionlib

    while True:
        try:
            cur = await asyncio.wait_for(electionlib.current_leader(client, job_id), 2.0)
            service.leader_address = cur[1] if cur else ""
        except Exception as e:
            log.warning("could not read the current leader", error=str(e))
        await asyncio.sleep(1.0)


def run(ns: argparse.Namespace) -> int:
    """`unbroken driver`."""
    setup_logging(ns.log_format)
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        print(f"unbroken driver: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(cfg))
