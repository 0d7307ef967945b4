"""The secured deployment of docs/operations/security.md, run as written: `unbroken certs`,
a driver with mTLS and a viewer token for its HTTPS dashboard, an agent with its node
certificate, an operator's CLI with hers. Real processes on loopback (the event log in
memory: etcd is not what is under test here)."""

from __future__ import annotations

import json
import os
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from unbroken.driver.etcd import free_port

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "unbroken.cli"]
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_TOKEN")},
    "OMP_NUM_THREADS": "1",
}


def unbroken(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=env or ENV, timeout=120
    )


def scrape(url: str) -> dict[str, list[Any]]:
    """Every sample of a /metrics page by family name (prometheus_client's parser)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_certificates_tokens_driver_agent_operator_dashboard(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    assert unbroken("certs", "ca", "--dir", str(pki)).returncode == 0
    again = unbroken("certs", "ca", "--dir", str(pki))
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    for who in ("driver:main", "node:gpu-017", "operator:alice"):
        hosts = ["--host", "127.0.0.1"] if who.startswith("driver:") else []
        r = unbroken("certs", "issue", "--dir", str(pki), who, *hosts)
        assert r.returncode == 0, r.stdout + r.stderr
    bad = unbroken("certs", "issue", "--dir", str(pki), "root")
    assert bad.returncode == 2 and "ROLE:NAME" in bad.stderr
    for key in ("ca.key", "driver-main.key", "node-gpu-017.key", "operator-alice.key"):
        assert stat.S_IMODE((pki / key).stat().st_mode) == 0o600, key
    viewer = "v-" + os.urandom(16).hex()
    (tmp_path / "viewer.tokens").write_text(viewer + "\n")
    (tmp_path / "viewer.tokens").chmod(0o600)  # token files must be private
    port_file = tmp_path / "driver.json"
    tls = ["--tls-ca", str(pki / "ca.pem")]
    drv = subprocess.Popen(
        [
            *CLI, "driver", "--event-log", "memory", "--listen", "127.0.0.1:0",
            "--tls-cert", str(pki / "driver-main.crt"), "--tls-key", str(pki / "driver-main.key"),
            *tls, "--token-file", f"viewer={tmp_path / 'viewer.tokens'}",
            "--dashboard-port", "0", "--port-file", str(port_file), "--metrics-port", "0",
        ],
        env=ENV, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "driver.log", "wb"),
    )  # fmt: skip
    agent = None
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text()):
            assert drv.poll() is None, (tmp_path / "driver.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        info = json.loads(port_file.read_text())
        addr = f"127.0.0.1:{info['grpc_port']}"
        agent_metrics = free_port()
        agent = subprocess.Popen(
            [
                *CLI, "agent", "--driver", addr, "--node-id", "gpu-017", "--no-flash",
                "--no-selfcheck", "--metrics-port", str(agent_metrics),
                "--tls-cert", str(pki / "node-gpu-017.crt"),
                "--tls-key", str(pki / "node-gpu-017.key"), *tls,
            ],
            env=ENV, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "agent.log", "wb"),
        )  # fmt: skip
        alice = ["--tls-cert", str(pki / "operator-alice.crt")]
        alice += ["--tls-key", str(pki / "operator-alice.key"), *tls]
        while True:
            r = unbroken("nodes", "--driver", addr, *alice, "--json")
            if r.returncode == 0 and "gpu-017" in r.stdout:
                break
            assert time.monotonic() < deadline, r.stdout + r.stderr
            time.sleep(0.5)
        # the node's certificate cannot act as an operator
        node = ["--tls-cert", str(pki / "node-gpu-017.crt")]
        node += ["--tls-key", str(pki / "node-gpu-017.key"), *tls]
        r = unbroken("evict", "gpu-017", "--driver", addr, *node)
        assert r.returncode == 2 and "node:gpu-017 may not call Evict" in r.stderr, r.stderr
        # the dashboard: HTTPS with the driver's certificate, the viewer token only
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        url = f"https://127.0.0.1:{info['dashboard_port']}/api/state"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {viewer}"})
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            assert json.loads(resp.read())["role"] == "leader"
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(url, context=ctx, timeout=10)
        assert ei.value.code == 401
        # both processes' metrics, read by Prometheus' own parser
        drv_m = scrape(f"http://127.0.0.1:{info['metrics_port']}/metrics")
        assert drv_m["unbroken_node_alive"] and "unbroken_agent_connected" not in drv_m
        agent_m = scrape(f"http://127.0.0.1:{agent_metrics}/metrics")
        assert agent_m["unbroken_agent_connected"][0].value == 1.0
        assert agent_m["unbroken_agent_heartbeats_sent"][0].value > 0
    finally:
        for p in (agent, drv):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
