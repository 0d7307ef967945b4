"""Fixtures of the security suite: a real driver process (in-memory event log, a token)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CLI = [sys.executable, "-m", "unbroken.cli"]
TOKEN = "security-suite-token-0123456789"
# node tokens bound to one node id each (a principal of its own: node:<id>)
BOUND = {f"n-p{i}": f"security-suite-bound-{i}-0123456789" for i in range(6)}


def bound_md(node: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata authenticating as node:`node` (one of `BOUND`)."""
    return (("authorization", f"Bearer {BOUND[node]}"),)


@pytest.fixture(scope="package")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`unbroken driver --event-log memory` on loopback with a token (no etcd needed)."""
    tmp = tmp_path_factory.mktemp("driver")
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    bound_file = tmp / "bound-tokens"
    bound_file.write_text("".join(f"{t} {n}\n" for n, t in BOUND.items()))
    bound_file.chmod(0o600)
    args = [
        "--event-log", "memory", "--token-file", f"node={token_file}",
        "--token-file", f"node={bound_file}", "--job-id", "sec",
    ]  # fmt: skip
    with running_driver(tmp, args) as ports:
        yield {"address": f"127.0.0.1:{ports['grpc_port']}", "tmp": tmp, "token_file": token_file}


@contextlib.contextmanager
def running_driver(tmp: Path, args: list[str], grace_s: float = 10.0) -> Iterator[dict[str, Any]]:
    """`unbroken driver --listen 127.0.0.1:0 ARGS` logging to tmp/driver.log; its port file
    (grpc_port, metrics_port, ...) and its "pid" once written; stopped (SIGTERM, then
    SIGKILL) after."""
    port_file = tmp / "driver.json"
    log = open(tmp / "driver.log", "wb")
    cmd = [*CLI, "driver", "--listen", "127.0.0.1:0", "--port-file", str(port_file), *args]
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    log.close()
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, (tmp / "driver.log").read_text()
            assert time.monotonic() < deadline, "driver did not start within 60 s"
            time.sleep(0.1)
        yield {**json.loads(port_file.read_text()), "pid": proc.pid}
    finally:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def marker_payload(marker: Path) -> bytes:
    """A pickle that creates `marker` when anything unpickles it."""

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    import pickle

    return pickle.dumps(Boom())
