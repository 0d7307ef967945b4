"""Processes with hand-written command lines, for tests of one plane (heartbeats, relays,
hang flags, log storms) that want a driver on the session's etcd and agents running their
own small worker scripts rather than the training job (that is `tests/jobs.py`).

`Procs` is a `LocalCluster` without an etcd of its own: `start(name, args)` spawns
`python -m unbroken.cli <args>` as `name`; `stop_all()` stops agents first, then drivers,
and kills the workers a SIGKILLed agent left behind (worker scripts append their pid to
`<tmp>/worker-pids`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from unbroken.cli.cluster import LocalCluster, until
from unbroken.driver import paging
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

GRACE_S = 8.0


class Procs(LocalCluster):
    """Processes a test started; all are stopped at the end, also on failure."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, etcd="", grace_s=GRACE_S)  # no etcd of its own
        self.tmp = self.run
        self.metrics_port = 0

    def start(  # type: ignore[override]  # LocalCluster.start starts an etcd; none here
        self, name: str, args: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        role = args[0] if args and args[0] in ("driver", "agent") else "other"
        return self.spawn(name, args, role=role, env={**self.env, **(env or {})})

    def stop_all(self) -> None:
        self.stop()
        # workers run in their own sessions; a SIGKILLed agent leaves them behind
        f = self.tmp / "worker-pids"
        for pid in [int(x) for x in f.read_text().split()] if f.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def start_driver(
    procs: Procs, tmp: Path, *extra: str, name: str = "driver"
) -> tuple[str, dgrpc.DriverStub]:
    """A driver on port 0 (metrics too) with `extra` flags; its address and a stub."""
    port_file = tmp / f"{name}.json"
    args = ["driver", "--listen", "127.0.0.1:0", "--port-file", str(port_file)]
    procs.start(name, [*args, "--metrics-port", "0", *extra])
    info = until(
        lambda: port_file.exists() and json.loads(port_file.read_text()),
        30,
        "the driver's port file",
        procs,
        poll_s=0.05,
    )
    addr = f"127.0.0.1:{info['grpc_port']}"
    procs.metrics_port = int(info["metrics_port"])
    return addr, dgrpc.DriverStub(grpc.insecure_channel(addr))


def live(stub: dgrpc.DriverStub) -> dict[str, dpb.NodeLive]:
    """The driver's live view by node (empty while it does not answer)."""
    try:
        return {
            n.node_id: n for n in paging.all_nodes(stub.LiveView, dpb.LiveViewRequest(), timeout=2)
        }
    except grpc.RpcError:
        return {}


def read_events(etcd_config: Any, job_id: str) -> list[ev.Event]:
    """The job's whole event log, read from etcd."""
    from unbroken.driver import etcdlog

    async def go() -> list[ev.Event]:
        client = await etcdlog.connect(etcd_config)
        try:
            return await etcdlog.EtcdEventLog(client, job_id, None).read()
        finally:
            await client.close()

    return asyncio.run(go())


def start_agent(
    procs: Procs,
    addr: str,
    node: str,
    *extra: str,
    env: Mapping[str, str] | None = None,
    selfcheck: bool = False,
) -> subprocess.Popen[bytes]:
    """An agent of `node` reaching `addr`, its socket, worker logs, flash copies and storage
    under the run folder; without the GPU self-check (it imports torch on start) unless
    `selfcheck`."""
    argv = [
        "agent", "--driver", addr, "--node-id", node,
        "--socket", str(procs.tmp / f"{node}.sock"),
        "--log-dir", str(procs.tmp / f"logs-{node}"),
        "--persist-url", str(procs.tmp / "storage"),
        # not the default /dev/shm/unbroken/<node>: tests running side by side (pytest-xdist)
        # name their nodes alike; a later --flash-dir in `extra` wins
        "--flash-dir", str(procs.tmp / f"shm-{node}"),
    ]  # fmt: skip
    if not selfcheck:
        argv.append("--no-selfcheck")
    return procs.start(f"agent-{node}", [*argv, *extra], env)


def wait_nodes(stub: dgrpc.DriverStub, nodes: list[str], what: str, timeout_s: float = 60) -> None:
    """Until every node in `nodes` is alive and connected (and, for "stepping", training)."""
    got: dict[str, dpb.NodeInfo] = {}

    def ready() -> bool:
        try:
            listed = list(paging.all_nodes(stub.ListNodes, dpb.ListNodesRequest(), timeout=10))
        except grpc.RpcError:  # not leading yet (the election is still running)
            return False
        got.clear()
        got.update({n.node_id: n for n in listed})
        return all(
            n in got
            and got[n].alive
            and got[n].connected
            and (what != "stepping" or got[n].step > 0)
            for n in nodes
        )

    until(ready, timeout_s, f"nodes {nodes} {what}", lambda: str(got), poll_s=0.3)


def native_stacks(pid: int, timeout_s: float = 30.0) -> str:
    """Every thread's stack of process `pid`, native frames too (py-spy, a dev dependency):
    what a process stuck in C++ is waiting on, which Python's own stack dump cannot show.
    A line saying why instead when py-spy is missing or cannot attach."""
    spy = Path(sys.executable).parent / "py-spy"  # the venv's scripts, PATH or not
    if not spy.exists():
        return f"(no native stacks of {pid}: py-spy is not installed beside {sys.executable})"
    try:
        r = subprocess.run(
            [str(spy), "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(no native stacks of {pid}: {e})"
    return (r.stdout + r.stderr).strip()
