"""A failed job has a way back: `unbroken resume` on a real driver, etcd and agents.

The job (tests/jobs.py: `unbroken driver --nodes 2`, two `unbroken agent --no-start`, the
tiny trainer flash-saving every step) runs with `--max-restore-attempts 1` and a worker
command that exits at once while a marker file exists (a node whose software broke). With
the marker in place a worker is SIGKILLed: the restore starts workers that die at once, the
one restore the budget allows fails, and the job stops in PHASE_FAILED. The marker is
removed (the operator fixed the node) and `unbroken resume --reason ...` is run as an
operator would: the log records who resumed it and why, a new incident with a fresh budget
restores the job, and it trains on from the restored step.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import urllib.request
from typing import Any

import grpc
import pytest

from tests.jobs import Job
from unbroken.cli.cluster import until
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


def _phase(address: str) -> str:
    with grpc.insecure_channel(address) as ch:
        st = dgrpc.DriverStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=30)
    return ev.Phase.Name(st.phase)


def _dashboard(job: Job) -> dict[str, Any]:
    port = json.loads(job.port_file("driver").read_text())["dashboard_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=10) as r:
        return dict(json.loads(r.read()))


def test_a_job_that_used_up_its_restores_is_resumed(job: Job) -> None:
    mark = job.tmp / "node-broken"
    cmd = f"test -e {shlex.quote(str(mark))} && exit 1; exec {job.worker_cmd(2)}"
    job.start_driver(
        "--max-restore-attempts", "1", "--worker-cmd", f"sh -c {shlex.quote(cmd)}",
        "--dashboard-port", "0",
    )  # fmt: skip
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= 3, 180, "training to start", job)

    mark.write_text("")  # from now on every worker start fails
    victim = job.worker("n1")
    assert victim is not None
    victim.kill()
    until(lambda: "FAILED" in _phase(job.address), 240, "the job to fail", job)
    failed_step = job.max_step()
    events = job.events()
    finished = [e.job_finished for e in events if e.HasField("job_finished")]
    assert finished and not finished[-1].ok, finished
    assert "max_restore_attempts" in finished[-1].reason, finished[-1].reason
    assert "unbroken resume" in finished[-1].reason
    status = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "status", "--driver", job.address],
        capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", **os.environ},
    )  # fmt: skip
    assert "FAILED" in status.stdout and "unbroken resume" in status.stdout, status.stdout
    page = _dashboard(job)  # what the dashboard's red banner is drawn from
    assert page["phase"] == "failed" and page["finished_reason"] == finished[-1].reason, page

    mark.unlink()  # the operator repaired the node
    r = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "resume", "--driver", job.address,
         "--reason", "node software repaired"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "failed -> " in r.stdout, r.stdout
    until(
        lambda: "RUNNING" in _phase(job.address) and job.max_step() >= failed_step + 3,
        240,
        "training past the resume",
        job,
    )
    events = job.events()
    resumes = [
        e for e in events if e.HasField("operator_action") and e.operator_action.action == "resume"
    ]
    assert len(resumes) == 1, resumes
    assert resumes[0].operator_action.target == "node software repaired"
    assert resumes[0].operator_action.who  # who resumed it is in the log
    rearm = [
        e.recovery_transition
        for e in events
        if e.HasField("recovery_transition") and e.recovery_transition.rearm
    ]
    assert len(rearm) == 1 and rearm[0].from_phase == ev.PHASE_FAILED, rearm
    after = events[events.index(resumes[0]) :]
    assert any(e.HasField("training_resumed") for e in after), [
        e.WhichOneof("payload") for e in after
    ]
    page = _dashboard(job)
    assert page["phase"] == "running" and page["finished_reason"] == "", page
    # resuming a running job is refused with a reason (exit 1)
    again = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "resume", "--driver", job.address],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 1 and "nothing to resume" in again.stderr, again.stderr
