"""In-job recovery behind a relay: the member's fresh rings reach the driver before its ack.

`unbroken driver --nodes 2 --dp 2` trains the tiny trainer on two real agents: n0 is a relay
(`--relay-listen`) and n1 its member (`--relay n0@...`), so n1's heartbeats, acks and rings
all go up n0's stream. n1's worker is SIGKILLed; the survivor rejoins in its own process.

A stop's ack says `ring_fresh` when the agent sent its rings rescanned in a heartbeat just
before; the driver then reads the steps every rank holds without waiting for more. Behind
a relay that heartbeat waited for the relay's periodic batch, behind the ack (and went as
"alive" only: a new copy changes no step), and the relay's own was not sent at all: the
driver chose the restore step from rings a heartbeat old. Now both nodes' acks are fresh
(the driver's "workers paused" line counts them) and the restore step is the crash's.
"""

from __future__ import annotations

import re

import psutil
import pytest

from tests.jobs import Job
from unbroken.cli.cluster import until
from unbroken.diagnostics.check import free_port
from unbroken.recovery.flashcopy import LOCAL_STORE, list_copies

pytestmark = pytest.mark.integration


def test_a_member_behind_a_relay_is_replaced_in_job_from_its_fresh_rings(job: Job) -> None:
    job.start_driver(steps=100000)
    port = free_port()
    job.start_agent("n0", buddy="n1", extra=("--relay-listen", f"127.0.0.1:{port}"))
    until(lambda: "relay listening" in job.log("n0"), 60, "the relay to listen", job)
    job.start_agent("n1", buddy="n0", extra=("--relay", f"n0@127.0.0.1:{port}"))
    until(lambda: job.max_step() >= 5, 180, "training to start", job)
    assert "relay" in job.log("n1") and "n0" in job.log("n1")

    # what the victim's ring held when it died: the copy of its last reported step may
    # still have been in flight (it completes during the next step), and then the newest
    # step every rank holds is the one before
    held: list[int] = []
    ring = job.tmp / "shm-n1" / job.job / LOCAL_STORE / "rank-00001"

    def newest_copy(killed: psutil.Process) -> None:
        psutil.wait_procs([killed], timeout=10)
        held.extend(r.manifest.step for r in list_copies(ring)[:1])

    job.kill_peer_keep_survivor(past=5, on_kill=newest_copy)
    assert "rejoining the new world in this process" in job.worker_log("n0")
    events = job.events()
    resumed = [e.training_resumed for e in events if e.HasField("training_resumed")]
    assert resumed[-1].mode == "in_job", resumed
    paused = re.findall(r"workers paused .*", job.log("driver"))
    assert paused, job.log("driver")[-3000:]
    assert re.search(r"\bfresh=2\b", paused[-1]), paused[-1]  # the relay's and its member's
    failed = next(e.worker_failed for e in events if e.HasField("worker_failed"))
    pause = next(e.training_paused for e in events if e.HasField("training_paused"))
    # every rank's last copy before the crash is in the rings the driver read. (How new
    # that copy is depends on the host: the flash writer runs at SCHED_IDLE, and with two
    # test files beside each other on 2 cores the victim's ring once held step 3 when it
    # reported step 5; the driver read it all the same.)
    assert held, (held, failed)
    assert pause.restore_step >= held[0], (pause, held, failed)
