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
import dataclasses
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import structlog

from unbroken.common import aio, reaper
from unbroken.common.config import add_config_flags
from unbroken.common.config import config_from_args as build
from unbroken.common.logsetup import setup_logging
from unbroken.common.tls import TlsConfig
from unbroken.driver.config import (
    DriverConfig,
    LoopConfig,
    ServiceConfig,
    exposure_problems,
    metrics_exposure,
)
from unbroken.driver.dashboard import Dashboard, DashboardConfig
from unbroken.driver.etcd import EmbeddedEtcd
from unbroken.driver.eventlog import (
    EventLogError,
    InMemoryEventLog,
    InMemoryStore,
    Leadership,
    LogUnavailableError,
)
from unbroken.driver.rendezvous import RendezvousService
from unbroken.driver.scheduler import Scheduler
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import DriverService, build_server
from unbroken.driver.slurm import SlurmScheduler
from unbroken.driver.term import Term
from unbroken.proto import events_pb2 as ev

__all__ = ["DriverConfig", "config_from_args", "configure", "run", "serve"]

log = structlog.get_logger(__name__)

ETCD_DOWN_LIMIT_S = 300.0  # a driver gives up after etcd was unreachable this long
ETCD_RETRY_S = 1.0  # between campaigns while etcd is unreachable


def _archive(cfg: DriverConfig) -> str | None:
    """The event log's archive_url ("none" -> "": keep every event in etcd)."""
    if cfg.archive_url == "none":
        return ""
    return cfg.archive_url or None


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken driver`: the config tree's (common/config.py), and the few that are
    not a field (credentials' files, the log format)."""
    add_config_flags(parser, DriverConfig)
    parser.add_argument("--tls-cert", default=None, help="server certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, help="server private key (mTLS)")
    parser.add_argument("--tls-ca", default=None, help="CA that signs agent certificates")
    parser.add_argument(
        "--token-file",
        action="append",
        default=[],
        metavar="ROLE=PATH",
        help="accepted bearer tokens of ROLE (node, operator, launcher, viewer, driver), one "
        "per line, optionally followed by the one name it may act as; repeat per role",
    )
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log-format", choices=("console", "json"), default="console")


def config_from_args(ns: argparse.Namespace) -> DriverConfig:
    """A `DriverConfig` from parsed flags.

    Every problem the flags have is found before any is reported, so a new user fixes them
    all in one go rather than meeting one per run.

    Raises:
        ValueError: one line per problem, each naming the flag and what to do.
    """
    problems: list[str] = []
    if ns.event_log == "etcd" and not ns.etcd and not ns.etcd_data_dir:
        problems.append(
            "the embedded etcd needs --etcd-data-dir DIR: the job's history (every event, "
            "the committed checkpoints) lives there and must survive a restart of this "
            "driver. Or pass --etcd URL of an etcd cluster (several drivers share it), or "
            "--event-log memory for a throwaway demo; `unbroken up` passes its run directory"
        )
    if ns.event_log == "etcd" and not ns.archive_url:
        problems.append(
            "the driver needs an archive every driver of the job shares: pass "
            "--archive-url URL (an fsspec URL or shared path, e.g. s3://bucket/unbroken or "
            "/shared/unbroken/archive; or $UNBROKEN_ARCHIVE), or --archive-url none to "
            "keep every event in etcd; `unbroken up` uses its run directory"
        )
    if ns.token is not None:
        problems.append(
            "--token is gone: a token on the command line is visible to every local user "
            "(ps). Put the tokens in files, one per role: --token-file node=PATH"
        )
    tokens: RoleTokens | None = None
    try:
        tokens = RoleTokens.from_files(ns.token_file) if ns.token_file else None
    except (ValueError, OSError) as e:
        problems.append(f"--token-file: {e}")
    tls = TlsConfig(cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca)
    problems += exposure_problems(
        ns.listen,
        ns.dashboard_host if ns.dashboard_port is not None else None,
        credentials=bool(ns.tls_cert or ns.token_file),
        insecure=ns.insecure,
    )
    if ns.metrics_port is not None:
        problems += [m for m in [metrics_exposure(ns.metrics_host, public=ns.metrics_public)] if m]
    try:
        service = build(ServiceConfig, ns, tls=tls, tokens=tokens)
        cfg: DriverConfig = build(
            DriverConfig,
            ns,
            service=service,
            # one --min-nodes: the machine's policy, checked against --nodes by the loop
            loop=build(LoopConfig, ns, min_nodes=ns.min_nodes),
        )
    except ValueError as e:
        if str(e) not in problems:
            problems.append(str(e))
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(
            f"{len(problems)} settings to fix:\n"
            + "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
        )
    return cfg


async def serve(cfg: DriverConfig) -> int:
    """Run the driver until SIGTERM/SIGINT; return the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = DriverService(cfg.service, driver_id=cfg.driver_id, job_id=cfg.job_id)
    server, port, health_servicer = await build_server(service, cfg.listen)
    RendezvousService.attach(server, service)  # torchrun --rdzv-backend=unbroken
    host = cfg.listen.rsplit(":", 1)[0]
    advertise = cfg.advertise or (
        f"{host if host not in ('0.0.0.0', '[::]', '') else socket.gethostname()}:{port}"
    )
    if cfg.insecure and not (cfg.service.tls.enabled or cfg.service.tokens):
        log.warning(
            "INSECURE: no TLS and no tokens; every caller may do everything", listen=cfg.listen
        )
    metrics_port = (
        service.metrics.serve(cfg.metrics_port, cfg.metrics_host)
        if cfg.metrics_port is not None
        else 0
    )
    dashboard: Dashboard | None = None
    if cfg.dashboard_port is not None:
        tls = cfg.service.tls
        dash_cfg = DashboardConfig(
            host=cfg.dashboard_host,
            port=cfg.dashboard_port,
            tokens=cfg.service.tokens,
            tls_cert=tls.cert,  # HTTPS with the driver's certificate when it has one
            tls_key=tls.key,
        )
        dashboard = Dashboard(dash_cfg, service)
        await dashboard.start()
    structlog.contextvars.bind_contextvars(driver=cfg.driver_id, job=cfg.job_id)
    log.info("driver listening", address=advertise, metrics_port=metrics_port)
    if cfg.port_file:
        tmp = Path(cfg.port_file + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "grpc_port": port,
                    "metrics_port": metrics_port,
                    "dashboard_port": dashboard.port if dashboard is not None else 0,
                    "address": advertise,
                    "driver_id": cfg.driver_id,
                }
            )
        )
        os.replace(tmp, cfg.port_file)
    service.start()
    watcher = (
        asyncio.create_task(_exit_when_finished(service, stop)) if cfg.exit_when_finished else None
    )
    scheduler = SlurmScheduler(cfg.slurm) if cfg.scheduler == "slurm" else None
    try:
        if cfg.event_log == "memory":
            store = InMemoryStore()
            leadership = store.elect(cfg.driver_id)
            mlog = InMemoryEventLog(store, cfg.job_id, leadership)
            term = _term(cfg, service, mlog, leadership, advertise, scheduler)
            await term.begin()
            await stop.wait()
            await term.end(step_down=False)  # the service closes the journal below
        else:
            await _lead_on_etcd(cfg, service, advertise, stop, dashboard, scheduler)
        return 0
    finally:
        log.info("driver shutting down")
        if watcher is not None:
            watcher.cancel()
        if isinstance(scheduler, SlurmScheduler):
            scheduler.stop_steps()
        if dashboard is not None:
            await dashboard.close()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(cfg.grace_s)
        await service.close()


async def _exit_when_finished(service: DriverService, stop: asyncio.Event) -> None:
    """Set `stop` once the journal this driver follows or leads says the job finished."""
    while not stop.is_set():
        j = service.journal
        if j is not None and j.state.phase == ev.PHASE_FINISHED:
            log.info("the job finished; exiting (--exit-when-finished)", step=j.state.step)
            await asyncio.sleep(1.0)  # the agents read the last command replies
            stop.set()
            return
        await asyncio.sleep(0.5)


def _term(
    cfg: DriverConfig,
    service: DriverService,
    elog: Any,
    leadership: Leadership,
    address: str,
    scheduler: Scheduler | None,
) -> Term:
    """The term this driver begins when `leadership` is granted."""
    return Term(
        service,
        elog,
        leadership,
        address,
        loop=cfg.loop,
        scheduler=scheduler,
        bridge=cfg.bridge,
        grace_s=cfg.service.live.session_grace_ms / 1000.0,
    )


async def _lead_on_etcd(
    cfg: DriverConfig,
    service: DriverService,
    address: str,
    stop: asyncio.Event,
    dashboard: Dashboard | None = None,
    scheduler: Scheduler | None = None,
) -> None:
    from unbroken.driver import election as electionlib
    from unbroken.driver import etcdlog

    embedded: EmbeddedEtcd | None = None
    etcd_cfg = cfg.etcd
    if not etcd_cfg.endpoints:
        reaper.start()  # the embedded etcd dies with this driver, however it dies
        embedded = EmbeddedEtcd(
            etcd_cfg.data_dir, quota_backend_bytes=etcd_cfg.quota_backend_bytes
        ).start()
        etcd_cfg = dataclasses.replace(
            embedded.config, connect_timeout_s=etcd_cfg.connect_timeout_s
        )
        log.info("embedded etcd started", endpoint=embedded.endpoint)
    client = await etcdlog.connect(etcd_cfg)
    if dashboard is not None:  # a standby's dashboard replays the log read-only
        dashboard.reader = etcdlog.EtcdEventLog(client, cfg.job_id, None, archive_url=_archive(cfg))
    # One Election for the driver's life: after a lease doubt (its TTL passed unconfirmed,
    # e.g. while etcd elected a leader) it keeps the lease, and the next campaign takes the
    # same term back when etcd confirms it, instead of waiting for it to expire
    election = electionlib.Election(
        client, cfg.job_id, cfg.driver_id, ttl_s=cfg.etcd.lease_ttl_s, address=address,
        probe_leader=cfg.etcd.probe_leader,
    )  # fmt: skip
    try:
        down_since: float | None = None
        while not stop.is_set():
            down_since = await _one_term(
                cfg, service, client, election, address, stop, scheduler, down_since
            )
    finally:
        with contextlib.suppress(Exception):
            await election.resign()  # stops its keeper thread; revokes a lease still held
        with contextlib.suppress(Exception):
            await client.close()
        if embedded is not None:
            embedded.stop()


async def _one_term(
    cfg: DriverConfig,
    service: DriverService,
    client: Any,
    election: Any,
    address: str,
    stop: asyncio.Event,
    scheduler: Scheduler | None,
    down_since: float | None,
) -> float | None:
    """Stand by until elected (or stopped), then lead one term until the lease is lost or
    the driver stops. Returns since when etcd has been down (None: it is up)."""
    stopped = asyncio.create_task(stop.wait())
    try:
        return await _stand_by_then_lead(
            cfg, service, client, election, address, stop, stopped, scheduler, down_since
        )
    finally:
        stopped.cancel()


async def _stand_by_then_lead(
    cfg: DriverConfig,
    service: DriverService,
    client: Any,
    election: Any,
    address: str,
    stop: asyncio.Event,
    stopped: asyncio.Task[Any],
    scheduler: Scheduler | None,
    down_since: float | None,
) -> float | None:
    from unbroken.driver import etcdlog

    follow = asyncio.create_task(_follow_leader(client, cfg.job_id, service))
    campaign = asyncio.create_task(election.campaign())
    await asyncio.wait({campaign, stopped}, return_when=asyncio.FIRST_COMPLETED)
    follow.cancel()
    if stop.is_set():
        campaign.cancel()
        with contextlib.suppress(BaseException):
            await campaign
        return down_since
    # etcd down (killed, restarting, partitioned): campaign again, for a while
    try:
        leadership: Leadership = campaign.result()
    except EventLogError as e:
        return await _etcd_down(down_since, e, stop)
    elog = etcdlog.EtcdEventLog(client, cfg.job_id, leadership, archive_url=_archive(cfg))
    term = _term(cfg, service, elog, leadership, address, scheduler)
    try:
        await term.begin()
    except EventLogError as e:
        with contextlib.suppress(Exception):
            await election.resign()
        await elog.close()
        return await _etcd_down(down_since, e, stop)
    lost = asyncio.create_task(election.lost.wait())
    await asyncio.wait({lost, stopped}, return_when=asyncio.FIRST_COMPLETED)
    lost.cancel()
    if stop.is_set():
        await term.end()
        with contextlib.suppress(Exception):
            await election.resign()
        await elog.close()
        return None
    log.error(
        "leadership lost; stepping down and campaigning again",
        lease_in_doubt=election.in_doubt,  # then the same term comes back if it lives
    )
    await term.end()
    await elog.close()
    return None


async def _etcd_down(since: float | None, error: Exception, stop: asyncio.Event) -> float:
    """Wait before campaigning again; re-raise `error` once etcd was down too long."""
    now = asyncio.get_running_loop().time()
    since = since or now
    if now - since > ETCD_DOWN_LIMIT_S:
        raise error
    log.warning("etcd unavailable while taking the lead; retrying", error=str(error))
    with contextlib.suppress(TimeoutError):
        await aio.wait_for(stop.wait(), ETCD_RETRY_S)
    return since


async def _follow_leader(client: Any, job_id: str, service: DriverService) -> None:
    """While standing by, keep `service.leader_address` pointing at the current leader."""
    from unbroken.driver import election as electionlib

    while True:
        try:
            cur = await aio.wait_for(electionlib.current_leader(client, job_id), 2.0)
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
    try:
        return asyncio.run(serve(cfg))
    except EventLogError as e:  # etcd unreachable, full, or refusing: said once, no traceback
        log.error("driver stopped", error=str(e))
        print(f"unbroken driver: {e}", file=sys.stderr)
        return 3 if isinstance(e, LogUnavailableError) else 1
