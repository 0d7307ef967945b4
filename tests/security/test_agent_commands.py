"""Attacks on what a driver (or whoever holds its credentials) can make an agent do.

- a driver's StartWorkers carries a `worker_cmd` of its choosing: an agent without
  --allow-remote-cmd refuses it and runs nothing;
- a driver answers with an `x-unbroken-leader` trailer naming the attacker's host: the
  agent never connects there (its token would follow);
- an agent with a token pointed at a non-loopback driver without TLS refuses to start
  (the token would travel in cleartext).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.security.conftest import CLI
from unbroken.agent import rdzv
from unbroken.cli.cluster import stop_groups

pytestmark = pytest.mark.integration
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _wait(
    cond: Any, what: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc is None or proc.poll() is None, f"{what}: the process exited"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def test_driver_sent_worker_cmd_is_refused_without_the_flag(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    port_file = tmp_path / "driver.json"
    cmd = [
        *CLI, "driver", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
        "--event-log", "memory", "--nodes", "1", "--workers-per-node", "1",
        "--worker-cmd", f"touch {marker}", "--master-addr", "127.0.0.1",
    ]  # fmt: skip
    with open(tmp_path / "driver.log", "wb") as out:
        driver = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )
    agent = None
    try:
        _wait(port_file.exists, "driver start", 60, driver)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"
        log = tmp_path / "agent.log"
        cmd = [
            *CLI, "agent", "--driver", address, "--node-id", "node-a", "--no-start",
            "--worker-cmd", f"{sys.executable} -c pass", "--no-selfcheck",
            "--no-flash", "--log-dir", str(tmp_path / "logs"),
            "--socket", str(tmp_path / "a.sock"),
        ]  # fmt: skip
        with open(log, "wb") as out:
            agent = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
            )
        _wait(lambda: "--allow-remote-cmd" in log.read_text(), "the refusal", 60, agent)
        time.sleep(1.0)
        assert not marker.exists(), "the driver's command ran"
        assert "Traceback" not in log.read_text()
    finally:
        stop_groups([driver, *([agent] if agent else [])], grace_s=10)
    assert not marker.exists()


def test_leader_redirect_to_an_unconfigured_host_is_not_followed(tmp_path: Path) -> None:
    """A 'driver' that redirects every Register to the attacker's listener."""
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.2)
    evil = f"127.0.0.1:{trap.getsockname()[1]}"
    caught: list[bytes] = []
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            try:
                conn, _ = trap.accept()
            except TimeoutError:
                continue
            conn.settimeout(1)
            try:
                caught.append(conn.recv(65536))
            except OSError:
                caught.append(b"")
            conn.close()

    def redirect(request: Any, context: grpc.ServicerContext) -> None:
        context.abort_with_status(_Status(evil))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler(
        "unbroken.driver.v1.Driver",
        {"Register": grpc.unary_unary_rpc_method_handler(redirect, lambda b: b, lambda b: b)},
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    t = threading.Thread(target=listen, daemon=True)
    t.start()
    token = tmp_path / "token"
    token.write_text("agent-secret-token-0123456789")
    token.chmod(0o600)  # token files must be private
    try:
        cmd = [
            *CLI, "agent", "--driver", f"127.0.0.1:{port}", "--node-id", "node-a",
            "--token-file", str(token), "--max-disconnected-s", "3", "--no-selfcheck",
            "--socket", str(tmp_path / "a.sock"),
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV)
        assert "ignoring a redirect" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
        assert caught == [], "the agent connected to the redirect's host"
    finally:
        stop.set()
        t.join(5)
        server.stop(None)
        trap.close()


class _Status(grpc.Status):  # type: ignore[misc]
    def __init__(self, leader: str) -> None:
        self.code = grpc.StatusCode.UNAVAILABLE
        self.details = "not the leader"
        self.trailing_metadata = (("x-unbroken-leader", leader),)


def test_token_is_never_sent_in_cleartext_to_a_remote_driver(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("agent-secret-token-0123456789")
    token.chmod(0o600)  # token files must be private
    cmd = [*CLI, "agent", "--driver", "10.255.0.1:50051", "--token-file", str(token)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 2 and "cleartext" in out.stderr, out.stderr[-2000:]
    with pytest.raises(ValueError, match="cleartext"):
        rdzv.RdzvClientConfig(
            endpoint="10.255.0.1:50051", run_id="r", node_id="n", token="agent-secret-token"
        )
