"""`stop_groups` ends every process it is given: the group of one started in its own
session, and one that leads no group (started without `start_new_session`) by itself. A
bench that spawned its agent plainly once left it running, and the agent later registered
with another test's driver on the same port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken.cli.cluster import LocalCluster, stop_groups

pytestmark = pytest.mark.integration

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_stop_groups_ends_group_leaders_and_plain_children() -> None:
    leader = subprocess.Popen(SLEEP, start_new_session=True)
    plain = subprocess.Popen(SLEEP)  # in our own process group: no group of its own
    try:
        stop_groups([leader, plain], grace_s=5)
        assert leader.poll() is not None and plain.poll() is not None
    finally:
        for p in (leader, plain):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_local_clusters_processes_share_our_session_each_in_a_group(tmp_path: Path) -> None:
    """One host, one scheduling group: Linux's autogroup shares CPU among sessions first,
    so a simulated node's idle-priority flash threads in a session of their own competed
    with another node's training as equals. Each process still leads its own group (it is
    signalled as a group) and `stop_groups` ends it."""
    probe = (
        "import os, time; print(os.getsid(0), os.getpgid(0), os.getpid(), flush=True); "
        "time.sleep(60)"
    )
    c = LocalCluster(tmp_path)
    p = c.spawn("probe", [], launcher=[sys.executable, "-c", probe])
    try:
        log = tmp_path / "probe.log"
        deadline = time.monotonic() + 30
        while not log.read_text().strip():
            assert time.monotonic() < deadline, "the probe printed nothing"
            time.sleep(0.05)
        sid, pgid, pid = (int(x) for x in log.read_text().split()[:3])
        assert (sid, pgid, pid) == (os.getsid(0), p.pid, p.pid)
        stop_groups([p], grace_s=5)
        assert p.poll() is not None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
