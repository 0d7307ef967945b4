"""The metrics endpoint: loopback unless told otherwise, and idle connections cannot hold it.

It takes no credential (Prometheus scrapes it) and names nodes, errors and steps, yet
`--metrics-host 0.0.0.0` was taken without a word; and prometheus_client's server took
any number of connections, a thread each, held for as long as the client kept it open.
The real driver and agent commands are started with a public host; the endpoint serves
real sockets.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from unbroken.common.promhttp import Endpoint

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("command", ["driver", "agent"])
def test_a_public_metrics_host_needs_an_explicit_opt_in(command: str) -> None:
    argv = [sys.executable, "-m", "unbroken.cli", command, "--metrics-port", "0",
            "--metrics-host", "0.0.0.0"]  # fmt: skip
    argv += ["--event-log", "memory"] if command == "driver" else ["--driver", "127.0.0.1:1"]
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--metrics-host 0.0.0.0 is not a loopback address" in run.stderr, run.stderr[-2000:]
    assert "--metrics-public" in run.stderr


def _conn_threads() -> int:
    """The endpoint's connection threads alive now. (Not `threading.active_count()`: in a
    test run's process, threads of earlier tests come and go meanwhile.)"""
    return sum(t.name.startswith("metrics-conn") for t in threading.enumerate())


def test_idle_connections_neither_pile_up_threads_nor_hold_the_port() -> None:
    ep = Endpoint(CollectorRegistry(), "driver")
    # idle connections are dropped after 3 s: long enough that the first 8 are still held
    # when the accept loop takes the 9th (with 1 s a loaded CI host's loop took the backlog
    # so slowly that each 8 had expired before the next came: nothing was refused)
    port = ep.serve(0, max_connections=8, idle_timeout_s=3.0)
    idle = []
    try:
        for _ in range(64):  # connect and say nothing
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                pass  # the listen backlog is full: the kernel holds back the rest
            assert ep.serving <= 8 and _conn_threads() <= 8  # one thread per served connection
        assert len(idle) > 8
        # over the cap: closed at once, no thread. The server's accept loop takes the
        # kernel's backlog at its own pace; asked at once, a loaded CI host saw none yet
        deadline = time.monotonic() + 10
        while ep.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ep.refused > 0
        assert ep.serving <= 8 and _conn_threads() <= 8
        # within the idle timeout the held ones are dropped and a scrape is served
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    assert b"unbroken_build_info" in r.read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the port stayed held by idle clients"
                time.sleep(0.2)
    finally:
        for s in idle:
            s.close()
        ep.close()
    # closed: its threads end (an idle one at once, a serving one at its idle timeout)
    deadline = time.monotonic() + 5
    while _conn_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _conn_threads() == 0
