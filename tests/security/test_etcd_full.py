"""A full etcd is news, not "0 lost": when etcd refuses the driver's writes (its NOSPACE
alarm), `unbroken status`, the metrics and the dashboard say so, and how many faults wait.

A real embedded etcd started with a tiny --quota-backend-bytes, a real `unbroken driver`
process on it, a node that registers and goes silent, and etcd filled to its quota by
another client: the node's loss cannot be recorded. Then space is freed and the alarm
disarmed: the loss is recorded and the status clears.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.security.conftest import running_driver
from unbroken.driver.etcd import EmbeddedEtcd
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "unbroken.cli"]
NODE_TOKEN = "etcd-full-node-token-0123456789"
VIEWER_TOKEN = "etcd-full-viewer-token-0123456789"
QUOTA = 6 * 1024 * 1024


@pytest.fixture
def full_setup(tmp_path: Path) -> Iterator[dict[str, Any]]:
    etcd = EmbeddedEtcd(tmp_path / "etcd", quota_backend_bytes=QUOTA).start()
    (tmp_path / "node").write_text(f"{NODE_TOKEN} n1\n")
    (tmp_path / "viewer").write_text(VIEWER_TOKEN + "\n")
    for f in ("node", "viewer"):
        (tmp_path / f).chmod(0o600)
    args = [
        "--etcd", etcd.endpoint, "--archive-url", "none", "--job-id", "full",
        "--token-file", f"node={tmp_path / 'node'}",
        "--token-file", f"viewer={tmp_path / 'viewer'}",
        "--metrics-port", "0", "--heartbeat-interval-ms", "200", "--miss-limit", "3",
    ]  # fmt: skip
    try:
        with running_driver(tmp_path, args, grace_s=15) as ports:
            yield {
                "etcd": etcd,
                "address": f"127.0.0.1:{ports['grpc_port']}",
                "metrics": f"http://127.0.0.1:{ports['metrics_port']}/metrics",
                "viewer": tmp_path / "viewer",
                "log": tmp_path / "driver.log",
            }
    finally:
        etcd.stop(remove=True)


def _status(s: dict[str, Any], *, json_out: bool = True) -> Any:
    args = ["--json"] if json_out else []
    r = subprocess.run(
        [*CLI, "status", "--driver", s["address"], "--token-file", str(s["viewer"]), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout) if json_out else r.stdout


def _metric(s: dict[str, Any], name: str) -> float:
    text = urllib.request.urlopen(s["metrics"], timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")


def _until(cond: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


async def _fill(etcd: EmbeddedEtcd) -> int:
    """Put 512 KiB values until etcd refuses for space; returns how many landed."""
    from aetcd import rpc

    from unbroken.driver import etcdlog

    client = await etcdlog.connect(etcd.config)
    try:
        for i in range(64):
            try:
                await client.kvstub.Put(
                    rpc.PutRequest(key=b"/filler/%d" % i, value=os.urandom(512 * 1024))
                )
            except grpc.aio.AioRpcError as e:
                assert "space exceeded" in (e.details() or ""), e
                return i
        raise AssertionError("etcd took 32 MiB past a 6 MiB quota")
    finally:
        await client.close()


async def _free(etcd: EmbeddedEtcd) -> None:
    """What an operator does: delete, compact, defragment, disarm the alarm."""
    from aetcd import rpc

    from unbroken.driver import etcdlog

    client = await etcdlog.connect(etcd.config)
    try:
        r = await client.kvstub.DeleteRange(
            rpc.DeleteRangeRequest(key=b"/filler/", range_end=b"/filler0")
        )
        await client.kvstub.Compact(rpc.CompactionRequest(revision=r.header.revision))
        await client.maintenancestub.Defragment(rpc.DefragmentRequest())
        raised = await client.maintenancestub.Alarm(rpc.AlarmRequest(action=rpc.AlarmRequest.GET))
        assert raised.alarms, "no alarm raised"
        for a in raised.alarms:  # `etcdctl alarm disarm`: each member's alarm by its id
            await client.maintenancestub.Alarm(
                rpc.AlarmRequest(
                    action=rpc.AlarmRequest.DEACTIVATE, alarm=a.alarm, memberID=a.memberID
                )
            )
    finally:
        await client.close()


def test_a_full_etcd_shows_in_status_metrics_and_dashboard(full_setup: dict[str, Any]) -> None:
    s = full_setup
    md = (("authorization", f"Bearer {NODE_TOKEN}"),)

    def register() -> bool:
        with grpc.insecure_channel(s["address"]) as ch:
            try:
                dgrpc.DriverStub(ch).Register(
                    dpb.RegisterRequest(node_id="n1", epoch=1), metadata=md, timeout=20
                )
                return True
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e  # not leading yet
                return False

    _until(register, 60, "the driver to lead and take n1's registration")
    _until(lambda: _status(s)["nodes_total"] == 1, 30, "n1's registration recorded")

    filled = asyncio.run(_fill(s["etcd"]))
    assert filled > 0
    # n1 never opens a session: it is declared lost, and that loss cannot be written
    st = _until(
        lambda: (x := _status(s)).get("log_full") and x.get("faults_unrecorded") and x,
        60,
        "the status to say etcd is full",
    )
    assert st["log_failing_s"] > 0 and "NOSPACE" in st["log_error"], st
    assert st.get("nodes_lost", 0) == 0  # what is durable: the loss is not, yet
    text = _status(s, json_out=False)
    assert "EVENT LOG FAILING" in text and "etcd is FULL" in text, text
    assert "1 fault waits to be recorded" in text, text
    assert _metric(s, "unbroken_event_log_full") == 1.0
    assert _metric(s, "unbroken_event_log_failing_seconds") > 0
    assert _metric(s, "unbroken_faults_pending") >= 1

    asyncio.run(_free(s["etcd"]))
    last: list[Any] = []

    def recorded() -> Any:
        last.append(_status(s))
        return last[-1] if last[-1].get("nodes_lost") == 1 else None

    try:
        st = _until(recorded, 60, "the loss recorded once etcd takes writes again")
    except AssertionError:
        raise AssertionError(f"{last[-1:]}\n{s['log'].read_text()[-6000:]}") from None
    assert not st.get("log_full") and not st.get("log_failing_s"), st
    assert _metric(s, "unbroken_event_log_full") == 0.0
