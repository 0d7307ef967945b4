"""`stop_groups` ends every process it is given: the group of one started in its own
session, and one that leads no group (started without `start_new_session`) by itself. A
bench that spawned its agent plainly once left it running, and the agent later registered
with another test's driver on the same port."""

from __future__ import annotations

import subprocess
import sys

import pytest

from unbroken.cli.cluster import stop_groups

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
