"""The recovery loop end to end: a real driver process recovers a worker crash and a lost node.

`unbroken driver --nodes 2 --dp 2` (on the session's real etcd) starts the job itself on
two `unbroken agent --no-start` processes (one worker each: the tiny trainer, dp2,
flash-saving every step) and keeps a third agent registered as a spare. Nothing in this
test sends a command: the driver's loop does everything.

1. A worker is SIGKILLed: the loop stops both workers and restarts them with a fresh
   master port; they restore from flash memory and training continues past the crash.
2. A node's agent is SIGKILLed (its worker dies with it): the spare takes its rank and
   restores from the buddy replica or storage; training continues.

Every step that ran twice (before a crash and again after the restore) has the same loss
both times (deterministic data; the restored state is exact). The log holds the
transitions, the spare's assignment, the world change and two TrainingResumed after the
start's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.trainenv import plain_worker_env
from unbroken.diagnostics.check import free_port
from unbroken.driver.etcd import EtcdConfig
from unbroken.driver.etcdlog import EtcdEventLog, connect
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

TRAIN = ["-m", "unbroken.trainer.run", "--preset", "tiny", "--dp", "2", "--log-every", "1000"]


class Job:
    """A driver process, agents, and what they wrote."""

    def __init__(self, tmp: Path, endpoint: str) -> None:
        self.tmp = tmp
        self.endpoint = endpoint
        self.job = f"loop-{uuid.uuid4().hex[:6]}"
        self.metrics = tmp / "metrics.jsonl"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.replica: dict[str, int] = {}
        self.address = ""

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.tmp / f"{name}.log", "ab")  # the child owns it
        p = subprocess.Popen(
            [sys.executable, "-m", "unbroken.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "UNBROKEN_REPLICA_KEY": "test-job-replica-key-0123456789",
            },
        )
        out.close()
        self.procs[name] = p
        return p

    def start_driver(self) -> None:
        port_file = self.tmp / "driver.json"
        cmd = " ".join(
            [sys.executable, *TRAIN, "--steps", "100000", "--metrics-out", str(self.metrics)]
        )
        self._spawn(
            "driver",
            [
                "driver", "--etcd", self.endpoint, "--job-id", self.job,
                "--listen", "127.0.0.1:0", "--allow-fault-injection", "--port-file", str(port_file),
                "--miss-limit", "30",  # 3 s: torch imports on 2 cores starve heartbeats
                "--nodes", "2", "--workers-per-node", "1", "--dp", "2",
                "--worker-cmd", cmd, "--master-addr", "127.0.0.1",
            ],
        )  # fmt: skip
        until("the driver's port file", port_file.exists, 30)
        self.address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"

    def port(self, node: str) -> int:
        if node not in self.replica:
            self.replica[node] = free_port()
        return self.replica[node]

    def start_agent(
        self, node: str, buddy: str, *, spare: bool = False, extra: tuple[str, ...] = ()
    ) -> None:
        args = [
            "agent", "--driver", self.address, "--node-id", node, "--no-start",
            "--worker-cmd", sys.executable + " -c pass",  # the driver's --worker-cmd wins
            "--allow-remote-cmd",
            "--log-dir", str(self.tmp / f"logs-{node}"),
            "--socket", str(self.tmp / f"{node}.sock"),
            "--flash-dir", str(self.tmp / f"shm-{node}"), "--flash-job", self.job,
            "--persist-url", str(self.tmp / "storage"),
            "--replica-listen", f"127.0.0.1:{self.port(node)}",
            "--buddy", f"127.0.0.1:{self.port(buddy)}",
            # 10 s: these tests are not about hangs, and on 2 busy cores a peer's hiccup
            # inside FSDP's all-gather can pass the 1 s default (a false hang, a diagnosis)
            "--hang-floor-ms", "10000",
        ]  # fmt: skip
        if spare:
            args.append("--spare")
        self._spawn(node, [*args, *extra])

    def worker(self, node: str) -> psutil.Process | None:
        kids = psutil.Process(self.procs[node].pid).children()
        return kids[0] if kids else None

    def steps(self) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        if self.metrics.exists():
            for line in self.metrics.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    m = json.loads(line)
                    out.setdefault(int(m["step"]), []).append(float(m["loss"]))
        return out

    def max_step(self) -> int:
        return max(self.steps(), default=0)

    def worker_log(self, node: str) -> str:
        p = self.tmp / f"logs-{node}" / "worker-0.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def logs(self) -> str:
        parts = []
        for name in self.procs:
            p = self.tmp / f"{name}.log"
            parts.append(f"--- {name}\n{p.read_text(errors='replace')[-2500:]}")
            parts.append(f"--- {name} worker\n{self.worker_log(name)[-1500:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)

    def events(self) -> list[ev.Event]:
        async def read() -> list[ev.Event]:
            client = await connect(EtcdConfig(endpoints=[self.endpoint]))
            try:
                return await EtcdEventLog(client, self.job, None).read()
            finally:
                await client.close()

        return asyncio.run(read())


def until(what: str, cond: Callable[[], bool], timeout_s: float, job: Job | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{job.logs() if job else ''}")
        time.sleep(0.1)


@pytest.fixture
def job(tmp_path: Path, etcd_server: object) -> Iterator[Job]:
    j = Job(tmp_path, etcd_server.endpoint)  # type: ignore[attr-defined]
    try:
        yield j
    finally:
        j.close()


def test_worker_crash_and_lost_node_are_recovered(job: Job) -> None:
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    # the spare's own buddy is n1, the node it will replace: n1's copies are on n0, and the
    # driver tells the spare so (n1's registration named its replica holder)
    job.start_agent("s0", buddy="n1", spare=True)
    until("training to start", lambda: job.max_step() >= 3, 120, job)

    # 1. A worker crash: both workers restart and restore; training goes on.
    victim = job.worker("n1")
    assert victim is not None
    victim.kill()
    crash_step = job.max_step()
    until(
        "training past the crash",
        lambda: (
            (w := job.worker("n1")) is not None
            and w.pid != victim.pid
            and job.max_step() >= crash_step + 3
        ),
        120,
        job,
    )

    # 2. A lost node: the spare takes its place.
    job.procs["n1"].kill()  # SIGKILL the agent; its worker dies with it
    job.procs["n1"].wait(10)
    lost_step = job.max_step()
    until(
        "the spare to train past the loss",
        lambda: job.worker("s0") is not None and job.max_step() >= lost_step + 3,
        150,
        job,
    )
    assert "restored" in job.worker_log("s0"), job.worker_log("s0")[-3000:]
    took = [ln for ln in (job.tmp / "s0.log").read_text().splitlines() if "flash.took_over" in ln]
    assert took and f"source=127.0.0.1:{job.port('n0')}" in took[0], took

    events = job.events()
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds.count("job_started") == 1
    resumed = [e.training_resumed for e in events if e.HasField("training_resumed")]
    assert len(resumed) >= 3, kinds  # the start, after the crash, after the loss
    start = next(e.job_started.world for e in events if e.HasField("job_started"))
    replaced = ["s0" if n == "n1" else n for n in start.node_ids]  # the spare in n1's rank
    assert sorted(start.node_ids) == ["n0", "n1"], start
    assert list(resumed[-1].world.node_ids) == replaced, resumed[-1]
    spares = [e.spare_assigned for e in events if e.HasField("spare_assigned")]
    assert [(s.spare_node_id, s.replaces_node_id) for s in spares] == [("s0", "n1")]
    assert "world_resized" in kinds and "worker_failed" in kinds and "node_lost" in kinds
    phases = [
        ev.Phase.Name(e.recovery_transition.to_phase)
        for e in events
        if e.HasField("recovery_transition")
    ]
    for p in ("PHASE_SUSPECTED", "PHASE_DIAGNOSED", "PHASE_RESHAPED"):
        assert p in phases, phases
    assert "training_paused" in kinds and "restore_started" in kinds

    # Every step's loss, before and after each restore, equals an uninterrupted run's.
    got = job.steps()
    last = max(got)
    assert sorted(got) == list(range(1, last + 1)), sorted(got)
    ref = reference(job.tmp / "reference", last)
    for step, values in got.items():
        for v in values:
            assert v == ref[step], (step, v, ref[step])


def reference(tmp: Path, steps: int) -> dict[int, float]:
    """The same training, uninterrupted and without agents, until `steps` (then killed)."""
    tmp.mkdir()
    metrics = tmp / "metrics.jsonl"
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = plain_worker_env(rank, 2, port)
            out = open(tmp / f"rank{rank}.log", "wb")  # the child owns it
            cmd = [*TRAIN, "--steps", "100000", "--metrics-out", str(metrics)]
            procs.append(subprocess.Popen([sys.executable, *cmd], env=env, stdout=out, stderr=out))
            out.close()

        def done() -> bool:
            assert all(p.poll() is None for p in procs), (tmp / "rank0.log").read_text()[-3000:]
            return metrics.exists() and str(f'"step": {steps},') in metrics.read_text()

        until("the reference run", done, 300)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    losses: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        with contextlib.suppress(ValueError):
            m = json.loads(line)
            losses.setdefault(int(m["step"]), float(m["loss"]))
    return losses


def test_an_operator_eviction_starts_the_recovery_at_once(job: Job) -> None:
    """`unbroken evict n1`: the spare takes n1's rank without waiting for a NodeLost."""
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    job.start_agent("s0", buddy="n0", spare=True)
    until("training to start", lambda: job.max_step() >= 3, 120, job)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken.cli.main",
            "evict",
            "n1",
            "--driver",
            job.address,
            "--reason",
            "bad ECC counts",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "recovery loop" in out.stdout, out.stdout
    evicted_step = job.max_step()
    until(
        "the spare to train past the eviction",
        lambda: job.worker("s0") is not None and job.max_step() >= evicted_step + 3,
        150,
        job,
    )
    events = job.events()
    kinds = [e.WhichOneof("payload") for e in events]
    at = kinds.index("operator_action")
    after = events[at:]
    evicted = next(i for i, e in enumerate(after) if e.HasField("node_evicted"))
    assert after[evicted].node_evicted.node_id == "n1"
    spare = next(i for i, e in enumerate(after) if e.HasField("spare_assigned"))
    assert (
        after[spare].spare_assigned.spare_node_id,
        after[spare].spare_assigned.replaces_node_id,
    ) == ("s0", "n1")
    assert evicted < spare
    lost = [
        i for i, e in enumerate(after) if e.HasField("node_lost") and e.node_lost.node_id == "n1"
    ]
    assert not lost or lost[0] > spare, kinds[at:]  # no NodeLost was needed to start it
    assert after[0].operator_action.action == "evict"
    assert after[1].HasField("recovery_transition"), kinds[at:]  # decided in the same breath
