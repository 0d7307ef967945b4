"""Driver failover in the middle of a recovery, and after a start that never reached agents.

1. Two drivers (leader + standby) run the tiny dp2 job on two `--no-start` agents. A
   worker is SIGKILLed; as soon as the incident's TrainingPaused is in the log the leader
   is SIGKILLed too. The standby wins the election, replays the log (mid-recovery), settles
   and resends the pending actions; training resumes and goes on. The log stays one
   history: contiguous sequence numbers, one JobStarted, a higher term for the new leader.
2. A leader that appended JobStarted and TrainingResumed but died before StartWorkers:
   the log is written as that leader would have (the test campaigns, appends, resigns;
   the agents registered with a real driver before). The next leader settles a RUNNING
   job whose world runs no worker, and must start the workers itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_loop_spike import inject
from tests.integration.test_recovery_loop import TRAIN, Job, until
from unbroken.diagnostics.check import free_port
from unbroken.driver.election import Election
from unbroken.driver.etcd import EtcdConfig
from unbroken.driver.etcdlog import EtcdEventLog, connect
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


class TwoDrivers(Job):
    """`Job` with named drivers; agents know every driver's address."""

    def start_named_driver(self, name: str, *, nodes: int = 2, port: int = 0) -> str:
        port_file = self.tmp / f"{name}.json"
        cmd = " ".join(
            [sys.executable, *TRAIN, "--steps", "100000", "--metrics-out", str(self.metrics)]
        )
        self._spawn(
            name,
            [
                "driver", "--etcd", self.endpoint, "--job-id", self.job, "--driver-id", name,
                "--listen", f"127.0.0.1:{port}", "--port-file", str(port_file),
                "--miss-limit", "30", "--allow-fault-injection",
                "--nodes", str(nodes), "--workers-per-node", "1", "--dp", str(nodes),
                "--worker-cmd", cmd, "--master-addr", "127.0.0.1",
            ],
        )  # fmt: skip
        until(f"{name}'s port file", port_file.exists, 120, self)
        return f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"

    def leader(self) -> str:
        events = self.events()
        elected = [e.leader_elected.driver_id for e in events if e.HasField("leader_elected")]
        return elected[-1] if elected else ""

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)


@pytest.fixture
def job(tmp_path: Path, etcd_server: object) -> Iterator[TwoDrivers]:
    j = TwoDrivers(tmp_path, etcd_server.endpoint)  # type: ignore[attr-defined]
    try:
        yield j
    finally:
        j.close()


def _after(events: list[ev.Event], kind: str, since: int) -> list[ev.Event]:
    return [e for e in events if e.seq > since and e.WhichOneof("payload") == kind]


def test_leader_killed_between_pause_and_resume_the_standby_finishes_the_recovery(
    job: TwoDrivers,
) -> None:
    a = job.start_named_driver("driver-a")
    until("driver-a to lead", lambda: job.leader() == "driver-a", 60, job)
    b = job.start_named_driver("driver-b")
    job.address = f"{a},{b}"
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until("training to start", lambda: job.max_step() >= 5, 180, job)

    inject(a, "n1", "crash", rank=0)  # the agent SIGKILLs its worker (not a warm standby)
    crash_step = job.max_step()
    failed_seq = 0

    def paused() -> bool:
        nonlocal failed_seq
        events = job.events()
        failed = [e.seq for e in events if e.HasField("worker_failed")]
        failed_seq = failed[0] if failed else 0
        return bool(failed) and bool(_after(events, "training_paused", failed_seq))

    until("the incident's pause", paused, 60, job)
    job.kill("driver-a")  # mid-recovery: paused, not yet resumed
    events = job.events()
    assert not _after(events, "training_resumed", failed_seq), "resumed before the kill"

    until("driver-b to lead", lambda: job.leader() == "driver-b", 60, job)
    until(
        "the recovery to finish under driver-b",
        lambda: bool(_after(job.events(), "training_resumed", failed_seq)),
        120,
        job,
    )
    until("training past the crash", lambda: job.max_step() >= crash_step + 3, 120, job)

    events = job.events()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds.count("job_started") == 1
    terms = [e.leader_elected for e in events if e.HasField("leader_elected")]
    assert [t.driver_id for t in terms] == ["driver-a", "driver-b"]
    assert terms[1].term > terms[0].term
    elected_b = next(e.seq for e in events if e.HasField("leader_elected") and
                     e.leader_elected.driver_id == "driver-b")  # fmt: skip
    assert _after(events, "training_resumed", elected_b), "driver-b did not resume the job"
    assert "job_finished" not in kinds


async def _append_as_dead_leader(endpoint: str, job_id: str, events: list[ev.Event]) -> None:
    client = await connect(EtcdConfig(endpoints=[endpoint]))
    try:
        election = Election(client, job_id, "dead-leader", ttl_s=2.0, address="dead:1")
        leadership = await election.campaign(timeout_s=60)
        elog = EtcdEventLog(client, job_id, leadership)
        for e in events:
            await elog.append(e)
        await election.resign()
    finally:
        await client.close()


@pytest.mark.slow  # CI keeps the mid-recovery failover above within its budget
def test_leader_dead_before_start_workers_the_next_leader_starts_them(job: TwoDrivers) -> None:
    b_port = free_port()
    # driver-a waits for 3 nodes and so never starts the job; the agents register with it
    a = job.start_named_driver("driver-a", nodes=3)
    job.address = f"{a},127.0.0.1:{b_port}"
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")

    def registered() -> bool:
        return sum(e.HasField("node_registered") for e in job.events()) >= 2

    until("both agents registered", registered, 120, job)
    job.kill("driver-a")
    world = ev.WorldLayout(dp=2, pp=1, tp=1, node_ids=["n0", "n1"], workers_per_node=1)
    asyncio.run(
        _append_as_dead_leader(
            job.endpoint,
            job.job,
            [
                ev.Event(
                    cause="driver",
                    job_started=ev.JobStarted(
                        trainer="gpt3d", world=world, min_nodes=1, max_nodes=1024
                    ),
                ),
                ev.Event(cause="driver", training_resumed=ev.TrainingResumed(world=world)),
            ],
        )
    )  # ... and died before sending StartWorkers
    job.start_named_driver("driver-b", port=b_port)
    until("the workers started by driver-b", lambda: job.max_step() >= 3, 180, job)

    events = job.events()
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds.count("job_started") == 1
    assert "recovery_transition" not in kinds, kinds  # started, not recovered
    log = (job.tmp / "driver-b.log").read_text()
    assert "world nodes run no workers after the takeover" in log, log[-3000:]
