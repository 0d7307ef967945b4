"""Node self-checks through real agents: reported at registration and on demand.

A real `unbroken driver` process (on the session's real etcd, no job: the recovery loop is
off) and two real `unbroken agent` processes: n0 healthy, n1 started with
`--inject-fault wrong_matmul` (a silently corrupt device). Each agent runs
`python -m unbroken.diagnostics.selfcheck` as a child right after registering and sends the
report up its session; the driver appends SelfCheckReported. The operator RPC
RunSelfCheck runs them again on demand. Assertions are on the log's events and the RPC's
replies, never on timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from unbroken.driver.etcd import EtcdConfig
from unbroken.driver.etcdlog import EtcdEventLog, connect
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

WAIT_S = 120.0  # torch imports on 2 shared cores: generous, the asserts are on events


def until(what: str, cond: Callable[[], bool], timeout_s: float, logs: Callable[[], str]) -> None:
    """Poll `cond` until true; fail with the processes' logs after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.2)


class Cluster:
    """A driver process on real etcd and agent processes; stops them all on close."""

    def __init__(self, tmp: Path, endpoint: str) -> None:
        self.tmp = tmp
        self.endpoint = endpoint
        self.job = f"sc-{uuid.uuid4().hex[:6]}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.address = ""

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.tmp / f"{name}.log", "ab")  # the child owns it
        p = subprocess.Popen(
            [sys.executable, "-m", "unbroken.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        out.close()
        self.procs[name] = p
        return p

    def start_driver(self) -> None:
        port_file = self.tmp / "driver.json"
        self.spawn(
            "driver",
            [
                "driver", "--etcd", self.endpoint, "--job-id", self.job,
                "--listen", "127.0.0.1:0", "--allow-fault-injection", "--port-file", str(port_file),
                "--miss-limit", "50",  # liveness is not under test; torch imports starve beats
            ],
        )  # fmt: skip
        until("the driver's port file", port_file.exists, 60, self.logs)
        self.address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"

    def start_agent(self, node: str, *extra: str) -> None:
        self.spawn(
            node,
            [
                "agent", "--driver", self.address, "--node-id", node,
                "--socket", str(self.tmp / f"{node}.sock"),
                "--log-dir", str(self.tmp / f"logs-{node}"), *extra,
            ],
        )  # fmt: skip

    def cli(self, *args: str, timeout_s: float = WAIT_S) -> subprocess.CompletedProcess[str]:
        """Run `unbroken ARGS --driver <ours>`."""
        return subprocess.run(
            [sys.executable, "-m", "unbroken.cli", *args, "--driver", self.address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
        )

    def events(self) -> list[ev.Event]:
        async def read() -> list[ev.Event]:
            client = await connect(EtcdConfig(endpoints=[self.endpoint]))
            try:
                return await EtcdEventLog(client, self.job, None).read()
            finally:
                await client.close()

        return asyncio.run(read())

    def self_checks(self) -> list[ev.SelfCheckReported]:
        return [e.self_check_reported for e in self.events() if e.HasField("self_check_reported")]

    def logs(self) -> str:
        parts = []
        for name in self.procs:
            p = self.tmp / f"{name}.log"
            text = p.read_text(errors="replace")[-2500:] if p.exists() else ""
            parts.append(f"--- {name}\n{text}")
        return "\n".join(parts)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, etcd_server: object) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("selfcheck"), etcd_server.endpoint)  # type: ignore[attr-defined]
    try:
        c.start_driver()
        c.start_agent("n0")
        c.start_agent("n1", "--inject-fault", "wrong_matmul")
        yield c
    finally:
        c.close()


async def _rpc(address: str, fn: Callable[[dgrpc.DriverStub], object]) -> object:
    async with grpc.aio.insecure_channel(address) as ch:
        return await fn(dgrpc.DriverStub(ch))  # type: ignore[misc]


def test_reported_at_registration(cluster: Cluster) -> None:
    def both() -> bool:
        return {c.node_id for c in cluster.self_checks()} >= {"n0", "n1"}

    until("both registration self-checks in the log", both, WAIT_S, cluster.logs)
    got = {c.node_id: c for c in cluster.self_checks() if c.trigger == "registration"}
    assert got["n0"].ok, got["n0"]
    assert not got["n1"].ok, got["n1"]
    assert any(f.startswith("matmul") for f in got["n1"].failures), got["n1"]
    items = {i["name"]: i for i in json.loads(got["n1"].details_json)}
    assert not items["matmul"]["ok"] and items["disk"]["ok"], items


def test_on_demand_and_unknown_node(cluster: Cluster) -> None:
    until(
        "both agents registered",
        lambda: {c.node_id for c in cluster.self_checks()} >= {"n0", "n1"},
        WAIT_S,
        cluster.logs,
    )
    before = len(cluster.self_checks())
    resp = asyncio.run(
        _rpc(
            cluster.address,
            lambda s: s.RunSelfCheck(
                dpb.RunSelfCheckRequest(node_ids=["n1", "n0"]), timeout=WAIT_S + 30
            ),
        )
    )
    assert isinstance(resp, dpb.RunSelfCheckResponse)
    by = {r.node_id: r for r in resp.results}
    assert [r.node_id for r in resp.results] == ["n1", "n0"]
    assert by["n0"].ok and not by["n0"].error, by["n0"]
    assert not by["n1"].ok and any("matmul" in f for f in by["n1"].failures), by["n1"]

    def logged() -> bool:
        return sum(c.trigger == "on demand" for c in cluster.self_checks()[before:]) >= 2

    until("the on-demand reports in the log", logged, 30, cluster.logs)
    actions = [e.operator_action for e in cluster.events() if e.HasField("operator_action")]
    assert any(a.action == "selfcheck" and a.target == "n1,n0" for a in actions), actions

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(
            _rpc(
                cluster.address,
                lambda s: s.RunSelfCheck(dpb.RunSelfCheckRequest(node_ids=["nope"]), timeout=30),
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unbroken nodes" in (info.value.details() or "")
