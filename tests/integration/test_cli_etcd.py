"""`unbroken etcd`: an embedded etcd that serves until Ctrl-C, then leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_unbroken_etcd_serves_until_stopped_and_leaves_nothing(tmp_path: Path, how: str) -> None:
    """Ctrl-C (the group's SIGINT), a SIGTERM to the process alone (systemd, `kill`), or a
    SIGKILL (then its reaper stops the server): no etcd is left behind."""
    data = tmp_path / "etcd-data"
    p = subprocess.Popen(
        [sys.executable, "-m", "unbroken.cli", "etcd", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None
        line = ""
        deadline = time.monotonic() + 120
        while "etcd is up at" not in line:
            assert time.monotonic() < deadline and p.poll() is None, line
            line = p.stdout.readline()
        endpoint = re.search(r"etcd is up at (\S+)", line).group(1)  # type: ignore[union-attr]
        with urllib.request.urlopen(f"{endpoint}/health", timeout=10) as r:
            assert b'"health":"true"' in r.read()
        assert "etcdctl" in p.stdout.readline()  # how to look at it
        children = psutil.Process(p.pid).children(recursive=True)
        assert children, "the etcd server process"
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
            assert p.wait(60) == 0
        elif how == "sigterm":
            p.send_signal(signal.SIGTERM)
            assert p.wait(60) == 0
        else:
            p.kill()
            p.wait(60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, alive
        assert data.exists()  # the data dir asked for is kept
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
