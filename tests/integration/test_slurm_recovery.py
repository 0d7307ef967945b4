"""End to end on a real 4-node Slurm cluster: a node crash is recovered with a spare from Slurm.

An `sbatch --no-kill` job holds n1..n4. The driver (`--scheduler slurm --scheduler-spares 1`)
starts the job on three agents that run as one-node job steps (`srun --jobid -w nX`, as
`unbroken slurm submit` does) and itself starts the spare's agent on n4 through Slurm
(`srun --jobid=J -N1 -n1 -w n4 ...`). Then n2 crashes: its slurmd, its slurmstepd and the
agent and worker it ran are SIGKILLed. The driver records NodeLost, the spare takes n2's
rank, training resumes with every loss equal to an uninterrupted run's, and n2 is drained
in Slurm with the incident in its reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs import SLURM_TRAIN, Job, reference, slurm_agent_script, start_slurm_driver
from tests.slurmcluster import SlurmCluster, running
from unbroken.cli.cluster import until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUDDY = {"n1": "n2", "n2": "n1", "n3": "n1", "n4": "n1"}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    with running(tmp_path / "slurm") as c:
        yield c


def test_a_crashed_node_is_replaced_by_a_spare_from_slurm(
    cluster: SlurmCluster, tmp_path: Path, etcd_server: object
) -> None:
    job = Job(tmp_path, etcd_server.endpoint)  # type: ignore[attr-defined]
    agent = slurm_agent_script(job, tmp_path, BUDDY)
    script = tmp_path / "hold.sh"
    script.write_text("#!/bin/bash\nsleep 3600\n")
    r = cluster.cmd("sbatch", "--parsable", "--no-kill", "-N4", "-o", "/dev/null", str(script))
    jid = r.stdout.strip().split(";")[0]
    steps: list[subprocess.Popen[bytes]] = []
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SLURM_CONF": str(cluster.conf),
        "UNBROKEN_REPLICA_KEY": "test-job-replica-key-0123456789",  # as Job._spawn's
    }
    try:
        until(
            lambda: cluster.cmd("squeue", "-h", "-j", jid, "-o", "%t").stdout.strip() == "R",
            30,
            "the allocation",
        )
        port_file = tmp_path / "driver.json"
        start_slurm_driver(
            job, cluster.conf, port_file,
            "--scheduler", "slurm", "--slurm-job-id", jid,
            "--slurm-conf", str(cluster.conf), "--scheduler-spares", "1",
            "--slurm-agent-cmd", f"bash {agent} {{node}} --spare",
        )  # fmt: skip
        for n in ("n1", "n2", "n3"):
            steps.append(
                subprocess.Popen(
                    [
                        "srun",
                        f"--jobid={jid}",
                        "--overlap",
                        "-N1",
                        "-n1",
                        f"-w{n}",
                        "bash",
                        str(agent),
                        n,
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        until(lambda: job.max_step() >= 3, 240, "training to start", job)
        until(
            lambda: '"n4"' in _nodes(job),
            120,
            "the spare's agent started through Slurm",
            job,
        )
        cluster.crash_node("n2")
        t_crash = time.monotonic()
        crash_step = job.max_step()
        until(
            lambda: job.max_step() >= crash_step + 3 and _worker_on("n4", tmp_path),
            240,
            "training on n4 past the crash",
            job,
        )
        t_resumed = time.monotonic()
        until(
            lambda: "DRAIN" in _slurm_state(cluster, "n2"),
            60,
            "n2 drained in Slurm",
            job,
        )
        reason = cluster.reason("n2")
        assert reason.startswith("unbroken: i") and "n2 lost" in reason, reason

        events = job.events()
        kinds = [e.WhichOneof("payload") for e in events]
        lost = next(e for e in events if e.HasField("node_lost") and e.node_lost.node_id == "n2")
        spares = [e.spare_assigned for e in events if e.HasField("spare_assigned")]
        assert [(s.spare_node_id, s.replaces_node_id) for s in spares] == [("n4", "n2")]
        calls = [e.scheduler_call for e in events if e.HasField("scheduler_call")]
        started = [c for c in calls if c.action == "replace" and c.ok]
        assert started and started[0].detail == "n4", calls
        drains = [c for c in calls if c.action == "drain" and c.node_id == "n2"]
        assert drains and drains[0].ok and drains[0].reason == reason, (drains, reason)
        incident = reason.split()[1]
        opened = [
            e.recovery_transition
            for e in events
            if e.HasField("recovery_transition") and e.recovery_transition.incident_id
        ]
        assert incident in {t.incident_id for t in opened}, (incident, opened)
        resumed = [e for e in events if e.HasField("training_resumed")]
        start = events[kinds.index("job_started")].job_started.world.node_ids
        world = list(resumed[-1].training_resumed.world.node_ids)
        assert world == [n if n != "n2" else "n4" for n in start], (list(start), world)
        crash_wall = time.time() - (time.monotonic() - t_crash)
        detect = lost.wall_time_unix_ns / 1e9 - crash_wall
        print(
            f"\nslurm replacement: crash -> NodeLost {detect:.1f} s, "
            f"crash -> training past it {t_resumed - t_crash:.1f} s"
        )

        # Every step's loss, before and after the restore, equals an uninterrupted run's.
        got = job.steps()
        last = max(got)
        assert sorted(got) == list(range(1, last + 1)), sorted(got)
        ref = reference(tmp_path / "reference", last, world=3, train=SLURM_TRAIN)
        for step, values in got.items():
            for v in values:
                assert v == ref[step], (step, v, ref[step])
    finally:
        job.close()
        cluster.end_job(steps, jid)


def _nodes(job: Job) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "nodes", "--json", "--driver", job.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.stdout


def _worker_on(node: str, tmp: Path) -> bool:
    p = tmp / f"logs-{node}" / "worker-0.log"
    return p.exists() and "restored" in p.read_text(errors="replace")


def _slurm_state(cluster: SlurmCluster, node: str) -> str:
    out = cluster.cmd("scontrol", "show", "node", "-o", node, check=False).stdout
    return next((f for f in out.split() if f.startswith("State=")), "")
