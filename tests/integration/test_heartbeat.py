"""The heartbeat plane end to end: a real driver process, real agents, real workers, etcd.

The issue's "Done when": a driver and 3 agent processes with 2 workers each (a small
python script using trainer/hooks.py). SIGKILL of an agent -> NodeLost by heartbeat
timeout (how fast at the default interval is measured by bench/heartbeat.py, detect_p50_ms
and detect_p99_ms; tests never assert on wall time); a worker exiting 1 -> WorkerFailed; a
SIGSTOPped worker -> HangSuspected; a worker printing `NCCL WARN` -> LogAlert carrying the
line; every event read back from etcd.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from unbroken.agent.hang import STOPPED_AFTER_MS
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

WORKER = """
import os, sys, time
from unbroken.trainer import hooks
h = hooks.install()
rank = int(os.environ["LOCAL_RANK"])
mode = os.environ.get("HB_TEST_MODE", "")
step = 0
while True:
    step += 1
    time.sleep(0.05)
    h.step(step, loss=1.0 / step)
    if mode == f"exit1:{rank}" and step == 10:
        sys.exit(1)
    if mode == f"nccl:{rank}" and step == 10:
        print("NCCL WARN test: simulated transport error on rank", rank, flush=True)
"""


class Procs:
    """Processes a test started; all are killed at the end, also on failure."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.metrics_port = 0

    def start(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        out = open(self.tmp / f"{name}.log", "wb")
        p = subprocess.Popen(
            [sys.executable, "-m", "unbroken.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            start_new_session=True,
        )
        out.close()
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(8)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            # workers run in their own sessions; a SIGKILLed agent leaves them behind
        for pid in _leftover_workers(self.tmp):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


def _leftover_workers(tmp: Path) -> list[int]:
    f = tmp / "worker-pids"
    return [int(x) for x in f.read_text().split()] if f.exists() else []


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def start_driver(
    procs: Procs, tmp: Path, *extra: str, name: str = "driver"
) -> tuple[str, dgrpc.DriverStub]:
    port_file = tmp / f"{name}.json"
    procs.start(
        name,
        [
            "driver",
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--metrics-port",
            "0",
            *extra,
        ],
    )
    info = wait_for(
        lambda: port_file.exists() and json.loads(port_file.read_text()),
        30,
        "the driver's port file",
    )
    addr = f"127.0.0.1:{info['grpc_port']}"
    stub = dgrpc.DriverStub(grpc.insecure_channel(addr))
    procs.metrics_port = int(info["metrics_port"])
    return addr, stub


def start_agent(
    procs: Procs, tmp: Path, addr: str, node: str, mode: str = "", nproc: int = 2
) -> subprocess.Popen[bytes]:
    script = tmp / "worker.py"
    # record worker pids for cleanup: the wrapper appends its pid, then execs python
    script.write_text(
        f"import os\nopen({str(tmp / 'worker-pids')!r}, 'a').write("
        f"str(os.getpid()) + ' ')\n" + WORKER
    )
    return procs.start(
        f"agent-{node}",
        [
            "agent",
            "--driver",
            addr,
            "--node-id",
            node,
            "--nproc-per-node",
            str(nproc),
            "--worker-cmd",
            f"{sys.executable} {script}",
            "--persist-url",
            str(tmp / "storage"),
            "--log-dir",
            str(tmp / f"logs-{node}"),
            "--socket",
            str(tmp / f"{node}.sock"),
        ],
        env={"HB_TEST_MODE": mode},
    )


def live(stub: dgrpc.DriverStub) -> dict[str, dpb.NodeLive]:
    try:
        return {n.node_id: n for n in stub.LiveView(dpb.LiveViewRequest(), timeout=2).nodes}
    except grpc.RpcError:
        return {}


def read_events(etcd_config: Any, job_id: str) -> list[ev.Event]:
    from unbroken.driver import etcdlog

    async def go() -> list[ev.Event]:
        client = await etcdlog.connect(etcd_config)
        try:
            return await etcdlog.EtcdEventLog(client, job_id, None).read()
        finally:
            await client.close()

    return asyncio.run(go())


def test_detectors_end_to_end(procs: Procs, tmp_path: Path, etcd_server: Any) -> None:
    job = f"hb-{uuid.uuid4().hex[:8]}"
    addr, stub = start_driver(procs, tmp_path, "--etcd", etcd_server.endpoint, "--job-id", job)
    victim = start_agent(procs, tmp_path, addr, "n0")
    start_agent(procs, tmp_path, addr, "n1", mode="exit1:1")
    start_agent(procs, tmp_path, addr, "n2", mode="nccl:0")

    def running() -> bool:
        v = live(stub)
        return len(v) == 3 and all(
            n.alive and len(n.workers) == 2 and any(w.step >= 5 for w in n.workers)
            for n in v.values()
        )

    wait_for(running, 60, "3 agents with 2 stepping workers each")

    # a SIGSTOPped worker stops making progress -> HangSuspected
    hung = next(w for w in live(stub)["n2"].workers if w.local_rank == 1)
    os.kill(hung.pid, signal.SIGSTOP)

    # SIGKILL an agent -> NodeLost (its latency: bench/heartbeat.py)
    killed_at_ns = time.time_ns()
    victim.kill()

    def kinds() -> dict[str, list[ev.Event]]:
        out: dict[str, list[ev.Event]] = {}
        for e in read_events(etcd_server.config, job):
            out.setdefault(str(e.WhichOneof("payload")), []).append(e)
        return out

    wanted = ("node_lost", "worker_failed", "hang_suspected", "log_alert")
    got = wait_for(
        lambda: (k := kinds()) and all(w in k for w in wanted) and k,
        30,
        f"events {wanted} in etcd",
        step_s=0.3,
    )
    os.kill(hung.pid, signal.SIGCONT)

    lost = got["node_lost"]
    assert [e.node_lost.node_id for e in lost] == ["n0"], lost
    assert lost[0].wall_time_unix_ns > killed_at_ns  # declared after the kill, not before
    assert lost[0].node_lost.reason == "heartbeat timeout"
    assert lost[0].node_lost.silent_ms > 0

    failed = got["worker_failed"]
    assert [
        (e.worker_failed.node_id, e.worker_failed.local_rank, e.worker_failed.exit_code)
        for e in failed
    ] == [("n1", 1, 1)]
    assert failed[0].worker_failed.global_rank == 1
    assert failed[0].worker_failed.last_step >= 9

    hang = got["hang_suspected"][0].hang_suspected
    assert (hang.node_id, hang.local_rank) == ("n2", 1)
    # its process is stopped: hung STOPPED_AFTER_MS after its last step, named as such
    assert hang.phase == "stopped" and hang.silent_ms > hang.threshold_ms == STOPPED_AFTER_MS

    alerts = [e.log_alert for e in got["log_alert"]]
    nccl = [a for a in alerts if a.keyword == "NCCL WARN"]
    assert len(nccl) == 1 and nccl[0].node_id == "n2" and nccl[0].local_rank == 0
    assert "NCCL WARN test: simulated transport error on rank 0" in nccl[0].line

    # Prometheus: heartbeats counted, nodes by state, the detection latency observed
    with urllib.request.urlopen(f"http://127.0.0.1:{procs.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'unbroken_nodes{state="lost"} 1.0' in text
    assert "unbroken_detection_latency_seconds_count 1.0" in text
    beats = next(x for x in text.splitlines() if x.startswith("unbroken_heartbeats_total"))
    assert float(beats.split()[1]) > 30

    regs = sorted(e.node_registered.node_id for e in got["node_registered"])
    assert regs == ["n0", "n1", "n2"]
    assert "leader_elected" in got
    seqs = [e.seq for k in got.values() for e in k]
    assert sorted(seqs) == list(range(1, len(seqs) + 1)), "dense sequence numbers"


def test_agent_follows_the_leader_across_a_failover(
    procs: Procs, tmp_path: Path, etcd_server: Any
) -> None:
    """A standby sends the agent to the leader; when the leader dies the agent moves on."""
    job = f"hb-{uuid.uuid4().hex[:8]}"
    common = ["--etcd", etcd_server.endpoint, "--job-id", job]
    lead_addr, lead_stub = start_driver(procs, tmp_path, *common, "--driver-id", "d-a")
    wait_for(lambda: live_leader(lead_stub), 30, "the first driver to lead")
    stand_dir = tmp_path / "standby"
    stand_dir.mkdir()
    stand_addr, stand_stub = start_driver(
        procs, stand_dir, *common, "--driver-id", "d-b", name="standby"
    )
    # the agent knows the standby first: it is redirected to the leader
    agent_args = ["agent", "--driver", f"{stand_addr},{lead_addr}", "--node-id", "n0"]
    procs.start("agent-n0", agent_args)
    wait_for(
        lambda: "n0" in live(lead_stub) and live(lead_stub)["n0"].heartbeats > 3,
        30,
        "the agent heartbeating to the leader",
    )
    assert "n0" not in live(stand_stub)
    procs.procs[0].kill()  # the leader driver dies
    wait_for(
        lambda: (
            live_leader(stand_stub)
            and "n0" in live(stand_stub)
            and live(stand_stub)["n0"].alive
            and live(stand_stub)["n0"].heartbeats > 3
        ),
        30,
        "the standby to lead and the agent to follow",
    )
    kinds = [str(e.WhichOneof("payload")) for e in read_events(etcd_server.config, job)]
    assert kinds.count("leader_elected") == 2
    assert kinds.count("node_registered") >= 1


def live_leader(stub: dgrpc.DriverStub) -> bool:
    try:
        return bool(stub.LiveView(dpb.LiveViewRequest(summary_only=True), timeout=2).leader)
    except grpc.RpcError:
        return False
