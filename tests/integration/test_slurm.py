"""The scheduler interface on a real Slurm cluster (munged, slurmctld, one slurmd per node).

- One contract, run against the in-memory pool and Slurm: drain with a reason, resume,
  refusals with a clear error.
- A node drained by unbroken is avoided by a new allocation in the same cluster.
- A replacement's agent starts as a step of the job's allocation on the spare node.
- The bridge on a real journal: NodeEvicted drains the node with `unbroken: <incident>
  <cause>` and the answer is a SchedulerCall event; `unbroken slurm resume` clears it and
  the bridge records that; a DRAIN by someone else is a fault signal.
- A real driver process (`--scheduler slurm`) and `unbroken evict`: the node is drained.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.slurmcluster import SlurmCluster, ensure_installed
from unbroken.driver import state as statelib
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.journal import Journal
from unbroken.driver.scheduler import (
    BridgeConfig,
    InMemoryScheduler,
    NodeHealth,
    Scheduler,
    SchedulerBridge,
    SchedulerError,
    drain_reason,
)
from unbroken.driver.slurm import SlurmConfig, SlurmScheduler, health_of, parse_show_node
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = ensure_installed()
    if why:
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), 4).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The module's cluster, every node idle again after the test."""
    yield slurm
    slurm.settle()


def sched_of(c: SlurmCluster, **kw: object) -> SlurmScheduler:
    return SlurmScheduler(SlurmConfig(slurm_conf=str(c.conf), timeout_s=10, **kw))  # type: ignore[arg-type]


def until(what: str, cond: Callable[[], bool], timeout_s: float, logs: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.1)


# ---------------------------------------------------------------- parsing (no Slurm needed)
def test_slurm_states_map_onto_health() -> None:
    assert health_of("IDLE") is NodeHealth.IDLE
    assert health_of("IDLE+DRAIN") is NodeHealth.DRAINED
    assert health_of("IDLE+COMPLETING+DRAIN") is NodeHealth.DRAINED
    assert health_of("ALLOCATED+DRAIN") is NodeHealth.DRAINING
    assert health_of("MIXED") is NodeHealth.ALLOCATED
    assert health_of("DOWN+NOT_RESPONDING") is NodeHealth.DOWN
    assert health_of("IDLE+NOT_RESPONDING") is NodeHealth.IDLE  # just resumed, not a fault
    assert health_of("FUTURE") is NodeHealth.FUTURE
    line = (
        "NodeName=n2 Arch=x86_64 OS=Linux 6.1 #1 SMP State=IDLE+DRAIN ThreadsPerCore=1 "
        "Reason=unbroken: i5 node n2 lost (no heartbeat) [root@2026-11-23T13:04:08]"
    )
    (info,) = parse_show_node(line)
    assert (info.node_id, info.health, info.reason) == (
        "n2",
        NodeHealth.DRAINED,
        "unbroken: i5 node n2 lost (no heartbeat)",
    )
    assert drain_reason("i5", "node n2\nlost") == "unbroken: i5 node n2 lost"


# ---------------------------------------------------------------- the contract
@pytest.fixture(params=["memory", "slurm"])
def scheduler(request: pytest.FixtureRequest) -> Scheduler:
    if request.param == "memory":
        return InMemoryScheduler.of(["n1", "n2", "n3"], ["n4"])
    return sched_of(request.getfixturevalue("cluster"))


def test_scheduler_contract(scheduler: Scheduler) -> None:
    async def body() -> None:
        health = {i.node_id: i.health for i in await scheduler.nodes()}
        assert {"n1", "n2", "n3", "n4"} <= set(health)
        assert not any(h.faulty for h in health.values())
        answer = await scheduler.drain("n2", drain_reason("i9", "node n2 lost"))
        assert "n2" in answer
        n2 = next(i for i in await scheduler.nodes() if i.node_id == "n2")
        assert n2.health.faulty and n2.reason == "unbroken: i9 node n2 lost", n2
        await scheduler.resume("n2")
        n2 = next(i for i in await scheduler.nodes() if i.node_id == "n2")
        assert not n2.health.faulty, n2
        with pytest.raises(SchedulerError, match="not drained"):
            await scheduler.resume("n2")
        with pytest.raises(SchedulerError):
            await scheduler.drain("nope", "unbroken: x")
        # a drain for someone else's reason is theirs to clear: only with force
        await scheduler.drain("n3", "bad fan")
        with pytest.raises(SchedulerError, match="someone else"):
            await scheduler.resume("n3")
        await scheduler.resume("n3", force=True)
        n3 = next(i for i in await scheduler.nodes() if i.node_id == "n3")
        assert not n3.health.faulty, n3

    asyncio.run(body())


# ---------------------------------------------------------------- Slurm only
def test_a_new_allocation_avoids_a_drained_node(cluster: SlurmCluster) -> None:
    sched = sched_of(cluster)
    asyncio.run(sched.drain("n2", drain_reason("i3", "diagnosis: bad matmul")))
    r = cluster.cmd("srun", "-N3", "--immediate=5", "bash", "-c", "echo $SLURMD_NODENAME")
    assert sorted(r.stdout.split()) == ["n1", "n3", "n4"], r.stdout
    r = cluster.cmd("srun", "-N4", "--immediate=2", "true", check=False)
    assert r.returncode != 0  # only three nodes take work
    assert cluster.reason("n2") == "unbroken: i3 diagnosis: bad matmul"
    # someone else's drain is not ours to clear
    cluster.cmd("scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=bad fan")
    with pytest.raises(SchedulerError, match="someone else"):
        asyncio.run(sched.resume("n3"))


def test_a_replacement_agent_starts_as_a_step_of_the_job(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """An sbatch --no-kill job on 4 nodes (3 working, 1 spare): the spare's 'agent' runs as
    a one-node step on the spare and sees its Slurm node name."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    r = cluster.cmd("sbatch", "--parsable", "--no-kill", "-N4", "-o", "/dev/null", str(script))
    job = r.stdout.strip().split(";")[0]
    until(
        "the job to run",
        lambda: cluster.cmd("squeue", "-h", "-j", job, "-o", "%t").stdout.strip() == "R",
        30,
    )
    out = tmp_path / "agent-{node}.txt"
    sched = sched_of(
        cluster, job_id=job, agent_cmd=f"bash -c 'echo $SLURMD_NODENAME > {out}; sleep 300'"
    )
    try:
        got = asyncio.run(sched.request_replacement(1, exclude={"n1", "n2", "n3"}))
        assert got == ["n4"]
        spare = Path(str(out).format(node="n4"))
        until("the agent step on n4", spare.exists, 30, cluster.logs())
        assert spare.read_text().strip() == "n4"
        # nothing more to give: every other node is excluded or already used
        assert asyncio.run(sched.request_replacement(1, exclude={"n1", "n2", "n3"})) == []
        # the job gives a node back and goes on with the rest
        # (not n1: the batch script runs there, and Slurm keeps a job's batch host)
        asyncio.run(sched.release("n2"))
        assert asyncio.run(sched.job_nodes(job)) == ["n1", "n3", "n4"]
    finally:
        sched.stop_steps()
        cluster.cmd("scancel", job, check=False)


def test_spares_beyond_the_allocation_held_expanded_and_new(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """`--slurm-spares job,held,expand,new` on a job of n1,n2 with n4 held back by an
    administrator (DRAIN, reason "spare"): the job has no spare, so the held n4 is resumed
    and added to the job, then n3 by growing the job; with "new" alone, n3 is taken in an
    allocation of its own. Each agent runs as a step of the allocation that holds its node."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    r = cluster.cmd(
        "sbatch", "--parsable", "--no-kill", "-N2", "-w", "n1,n2", "-o", "/dev/null", str(script)
    )
    job = r.stdout.strip().split(";")[0]
    cluster.cmd("scontrol", "update", "NodeName=n4", "State=DRAIN", "Reason=spare (held)")
    until(
        "the job to run",
        lambda: cluster.cmd("squeue", "-h", "-j", job, "-o", "%t").stdout.strip() == "R",
        30,
    )
    out = tmp_path / "agent-{node}.txt"
    sched = sched_of(
        cluster,
        job_id=job,
        spares=("job", "held", "expand", "new"),
        agent_cmd=f"bash -c 'echo $SLURMD_NODENAME $SLURM_JOB_ID > {out}; sleep 300'",
    )

    def agent_on(node: str) -> list[str]:
        f = Path(str(out).format(node=node))
        until(f"the agent step on {node}", lambda: f.exists() and f.read_text().strip(), 30)
        return f.read_text().split()

    try:
        world = {"n1", "n2"}
        # "new" alone: n3 (free) in an allocation of its own, not the job's
        alone = sched_of(cluster, job_id=job, spares=("new",), agent_cmd=sched.config.agent_cmd)
        assert asyncio.run(alone.request_replacement(1, exclude=world)) == ["n3"]
        node, new_job = agent_on("n3")
        assert node == "n3" and new_job != job
        names = cluster.cmd("squeue", "-h", "-j", new_job, "-o", "%j").stdout.strip()
        assert names == "unbroken-spare", names
        assert asyncio.run(alone.request_replacement(1, exclude=world)) == []  # n4 is held
        alone.stop_steps()
        cluster.cmd("scancel", new_job)
        Path(str(out).format(node="n3")).unlink()
        until("n3 idle", lambda: cluster.state("n3") == "idle", 30)
        # every source in order: the job has no spare, the held n4, then the job grows
        assert asyncio.run(sched.request_replacement(1, exclude=world)) == ["n4"]
        assert agent_on("n4") == ["n4", job]
        assert cluster.state("n4") == "alloc", cluster.state("n4")
        assert asyncio.run(sched.job_nodes(job)) == ["n1", "n2", "n4"]
        assert asyncio.run(sched.request_replacement(1, exclude=world | {"n4"})) == ["n3"]
        assert agent_on("n3") == ["n3", job]
        assert asyncio.run(sched.job_nodes(job)) == ["n1", "n2", "n3", "n4"]
        # nothing left anywhere
        assert asyncio.run(sched.request_replacement(1, exclude=world)) == []
    finally:
        sched.stop_steps()
        cluster.cmd("scancel", job, check=False)


def test_a_spare_source_name_is_checked() -> None:
    with pytest.raises(ValueError, match="spare sources must be some of job, held, expand"):
        SlurmConfig(spares=("job", "cloud"))


# ---------------------------------------------------------------- the bridge on a real journal
def test_the_bridge_drains_evicted_nodes_and_records_the_answers(cluster: SlurmCluster) -> None:
    async def body() -> list[ev.Event]:
        store = InMemoryStore()
        elog = InMemoryEventLog(store, "j", store.elect("d"))
        journal = Journal(elog, statelib.initial("j"))
        journal.start()
        bridge = SchedulerBridge(sched_of(cluster), journal, BridgeConfig(poll_s=0.2))
        bridge.start()
        actions: list[str] = []
        journal.subscribers.append(
            lambda e: (
                actions.append(e.scheduler_call.action) if e.HasField("scheduler_call") else None
            )
        )
        try:
            for n in ("n1", "n2", "n3"):
                await journal.record(
                    ev.Event(node_registered=ev.NodeRegistered(node_id=n, epoch=1))
                )
            await journal.record(
                ev.Event(
                    node_evicted=ev.NodeEvicted(
                        node_id="n2", reason="incident i7: diagnosis i7-d1: bad ['n2']"
                    )
                )
            )
            await _wait(lambda: cluster.state("n2").startswith("drain"))
            assert cluster.reason("n2") == "unbroken: i7 diagnosis i7-d1: bad ['n2']"
            await _wait(lambda: "drain" in actions)
            # an operator clears it: the bridge sees it back and records that
            r = subprocess.run(
                [sys.executable, "-m", "unbroken.cli", "slurm", "resume", "n2",
                 "--direct", "--slurm-conf", str(cluster.conf)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            await _wait(lambda: "resumed" in actions)
            # someone else drains a node of the job: a fault signal (an eviction by slurm)
            cluster.cmd("scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=bad fan")
            await _wait(lambda: journal.state.event_counts["operator_action"] >= 1)
            # Slurm marks a node of the job DOWN (its slurmd stopped answering): a fault
            # signal, NodeLost by slurm. (A DOWN set by hand on a live slurmd lasts only
            # until its next ping here, ReturnToService=2: too short to test reliably.)
            cluster.crash_node("n1")
            await _wait(lambda: journal.state.event_counts["node_lost"] >= 1)
            cluster.start_node("n1")
            return await elog.read()
        finally:
            await bridge.close()
            await journal.close()

    events = asyncio.run(body())
    calls = [e.scheduler_call for e in events if e.HasField("scheduler_call")]
    drain = next(c for c in calls if c.action == "drain")
    assert drain.ok and drain.node_id == "n2" and drain.scheduler == "slurm", drain
    assert drain.reason == "unbroken: i7 diagnosis i7-d1: bad ['n2']"
    assert "DRAIN" in drain.detail, drain
    assert any(c.action == "resumed" and c.node_id == "n2" and c.ok for c in calls), calls
    op = next(e.operator_action for e in events if e.HasField("operator_action"))
    assert (op.action, op.target) == ("evict", "n3") and "bad fan" in op.who, op
    lost = next(e.node_lost for e in events if e.HasField("node_lost"))
    assert lost.node_id == "n1" and lost.reason.startswith("slurm: DOWN"), lost
    assert "Not responding" in lost.reason, lost


async def _wait(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- a real driver
class Driver:
    """A real `unbroken driver --scheduler slurm` and agents, as processes."""

    def __init__(self, cluster: SlurmCluster, tmp: Path, endpoint: str) -> None:
        self.cluster, self.tmp, self.endpoint = cluster, tmp, endpoint
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_CONF": str(cluster.conf)}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.address = ""

    def spawn(self, name: str, args: list[str]) -> None:
        out = open(self.tmp / f"{name}.log", "ab")  # the child owns it
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "unbroken.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        )
        out.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.tmp.glob("*.log"))
        )

    def start(self, *extra: str) -> None:
        port_file = self.tmp / "driver.json"
        self.spawn(
            "driver",
            ["driver", "--etcd", self.endpoint, "--job-id", f"slurm-{uuid.uuid4().hex[:6]}",
             "--listen", "127.0.0.1:0", "--port-file", str(port_file),
             "--scheduler", "slurm", "--slurm-conf", str(self.cluster.conf),
             "--scheduler-poll-s", "0.5",
             "--miss-limit", "20",  # 2 s: a self-check's torch import on 2 busy cores
             *extra],
        )  # fmt: skip
        until("the driver's port file", port_file.exists, 60, self.logs())
        self.address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"

    def agent(self, node: str, *extra: str) -> None:
        self.spawn(
            node,
            ["agent", "--driver", self.address, "--node-id", node, "--no-start",
             "--worker-cmd", f"{sys.executable} -c pass", "--log-dir", str(self.tmp / node),
             "--persist-url", str(self.tmp / "storage"),
             "--socket", str(self.tmp / f"{node}.sock"), "--flash-dir", str(self.tmp / "shm"),
             *extra],
        )  # fmt: skip

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "unbroken.cli", *args, "--driver", self.address],
            capture_output=True, text=True, timeout=60, env=self.env,
        )  # fmt: skip

    def calls(self) -> list[dict[str, object]]:
        events = [json.loads(line) for line in self.cli("events", "--json").stdout.splitlines()]
        return [e["scheduler_call"] for e in events if "scheduler_call" in e]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture
def driver(cluster: SlurmCluster, tmp_path: Path, etcd_server: object) -> Iterator[Driver]:
    d = Driver(cluster, tmp_path, etcd_server.endpoint)  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        d.close()


def test_unbroken_evict_drains_the_node_and_clearing_resumes_it(driver: Driver) -> None:
    """`unbroken driver --scheduler slurm`, an agent on n3, `unbroken evict n3`, then
    `unbroken slurm resume n3`."""
    cluster = driver.cluster
    driver.start()
    driver.agent("n3")
    until(
        "n3 to register", lambda: '"n3"' in driver.cli("nodes", "--json").stdout, 60, driver.logs()
    )
    r = driver.cli("evict", "n3", "--reason", "bad ECC counts")
    assert r.returncode == 0, r.stderr
    until("n3 drained", lambda: cluster.state("n3").startswith("drain"), 30, driver.logs())
    assert cluster.reason("n3").startswith("unbroken: "), cluster.reason("n3")
    assert "bad ECC counts" in cluster.reason("n3")
    until("the drain recorded", lambda: any(c["action"] == "drain" for c in driver.calls()), 30)
    # someone else's drain is refused without --force, with what to do
    cluster.cmd("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=bad fan")
    r = driver.cli("slurm", "resume", "n2")
    assert r.returncode == 1 and "drained by someone else" in r.stderr, r
    assert "--force" in r.stderr and cluster.state("n2").startswith("drain")
    # the operator clears n3 through the driver (role-checked ClearNode): Slurm resumes it
    r = driver.cli("slurm", "resume", "n3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("cleared n3: slurm says n3 IDLE"), r.stdout
    until("n3 idle again", lambda: cluster.state("n3").startswith("idle"), 30)
    events = [json.loads(line) for line in driver.cli("events", "--json").stdout.splitlines()]
    clear = [e for e in events if e.get("operator_action", {}).get("action") == "clear"]
    assert [c["operator_action"]["target"] for c in clear] == ["n2", "n3"], clear
    resume = [e for e in events if e.get("scheduler_call", {}).get("action") == "resume"]
    ok = [e["scheduler_call"] for e in resume if e["scheduler_call"].get("ok")]
    assert [c["node_id"] for c in ok] == ["n3"], resume
    assert resume[-1]["cause"] == clear[-1]["event_id"], (resume, clear)
    # the refused one is in the log too, with Slurm's reason
    assert any(
        e["scheduler_call"]["node_id"] == "n2" and not e["scheduler_call"].get("ok") for e in resume
    ), resume


def test_a_node_found_bad_is_drained_and_a_new_allocation_avoids_it(driver: Driver) -> None:
    """A job on n1 (recovery loop on); a spare on n4 whose device computes wrong matmuls
    (`--inject-fault wrong_matmul`): its self-check fails, the machine marks it bad, the
    bridge drains it with the cause, and `srun -N3` lands on n1..n3."""
    cluster = driver.cluster
    sleeper = f"{sys.executable} -c 'import time; time.sleep(600)'"
    driver.start("--nodes", "1", "--worker-cmd", sleeper)
    driver.agent("n1")
    driver.agent("n4", "--spare", "--inject-fault", "wrong_matmul")
    until("n4 drained", lambda: cluster.state("n4").startswith("drain"), 120, driver.logs())
    reason = cluster.reason("n4")
    assert reason.startswith("unbroken: ") and "self-check failed on n4" in reason, reason
    r = cluster.cmd("srun", "-N3", "--immediate=5", "bash", "-c", "echo $SLURMD_NODENAME")
    assert sorted(r.stdout.split()) == ["n1", "n2", "n3"], r.stdout
    until("the drain recorded", lambda: any(c["node_id"] == "n4" for c in driver.calls()), 30)


def test_a_node_a_diagnosis_names_bad_is_drained_and_avoided(driver: Driver) -> None:
    """A world node corrupted at runtime (`unbroken inject wrong-matmul`), reported by
    `unbroken selfcheck`: the recovery loop diagnoses, the verdict names it, the eviction
    drains it in Slurm with the incident and the diagnosis in the reason, and a new
    allocation of three nodes avoids it. (The driver runs with `--self-check-evicts ""`:
    by default a wrong matmul evicts the node on its self-check alone, without the
    diagnosis this test is about.)"""
    cluster = driver.cluster
    sleeper = f"{sys.executable} -c 'import time; time.sleep(600)'"
    driver.start(
        "--nodes", "2", "--worker-cmd", sleeper, "--allow-fault-injection",
        "--self-check-evicts", "",
    )  # fmt: skip
    for n in ("n1", "n2"):
        driver.agent(n, "--allow-remote-cmd")
    driver.agent("n4", "--spare", "--allow-remote-cmd")

    def started() -> bool:
        out = driver.cli("events", "--json").stdout
        return '"job_started"' in out and '"n4"' in driver.cli("nodes", "--json").stdout

    until("the job on n1, n2 and the spare n4", started, 120, driver.logs())
    r = driver.cli("inject", "wrong-matmul", "--node", "n2")
    assert r.returncode == 0, r.stderr
    r = driver.cli("selfcheck", "--node", "n2", "--check-timeout", "300")
    assert r.returncode == 1, (r.stdout, r.stderr)  # the check fails on n2
    until("n2 drained", lambda: cluster.state("n2").startswith("drain"), 300, driver.logs())
    reason = cluster.reason("n2")
    events = [json.loads(line) for line in driver.cli("events", "--json").stdout.splitlines()]
    verdict = next(e["diagnosis_verdict"] for e in events if "diagnosis_verdict" in e)
    assert verdict["bad_nodes"] == ["n2"], verdict
    incident = next(
        e["recovery_transition"]["incident_id"]
        for e in events
        if e.get("recovery_transition", {}).get("incident_id")
    )
    assert reason.startswith(f"unbroken: {incident} diagnosis {verdict['diagnosis_id']}: "), reason
    assert "self-check failed on n2" in reason, reason
    r = cluster.cmd("srun", "-N3", "--immediate=5", "bash", "-c", "echo $SLURMD_NODENAME")
    assert sorted(r.stdout.split()) == ["n1", "n3", "n4"], r.stdout


def test_unbroken_slurm_submit_runs_the_job_as_the_recipe_says(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """`unbroken slurm submit --nodes 2 --spares 1`: sbatch --no-kill on 3 nodes, the driver
    in the batch step told the job id, one agent step per training node named by its Slurm
    node, and the spare's agent started by the driver as a step of the job."""
    sleeper = f"{sys.executable} -c 'import time; time.sleep(600)'"
    port_file = tmp_path / "driver.json"
    agent_args = (
        f"--socket {tmp_path}/{{node}}.sock --log-dir {tmp_path}/logs-{{node}} "
        f"--flash-dir {tmp_path}/shm-{{node}} --allow-remote-cmd"
    )
    driver_args = (
        f"--event-log memory --port-file {port_file} --scheduler-spares 1 "
        f'--scheduler-poll-s 0.5 --miss-limit 30 --worker-cmd "{sleeper}"'
    )
    r = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "slurm", "submit", "--nodes", "2",
         "--spares", "1", "--listen-host", "127.0.0.1", "--advertise-host", "127.0.0.1",
         "--output", str(tmp_path / "job-%j.out"), "--job-dir", str(tmp_path / "job"),
         "--agent-args", agent_args,
         "--driver-args", driver_args, "--slurm-conf", str(cluster.conf)],
        capture_output=True, text=True, timeout=60, env=cluster.env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("submitted job "), r.stdout
    job = r.stdout.split()[-1]

    def logs() -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(tmp_path.glob("job-*.out"))
        )

    try:
        until("the driver's port file", port_file.exists, 60, logs())
        address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"
        hosts = cluster.cmd("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
        nodes = cluster.cmd("scontrol", "show", "hostnames", hosts).stdout.split()
        assert len(nodes) == 3, nodes

        def events() -> list[dict[str, object]]:
            r = subprocess.run(
                [sys.executable, "-m", "unbroken.cli", "events", "--json",
                 "--driver", address],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            return [json.loads(line) for line in r.stdout.splitlines()]

        def registered() -> set[str]:
            return {
                str(e["node_registered"]["node_id"])  # type: ignore[index]
                for e in events()
                if "node_registered" in e
            }

        until("three agents registered", lambda: registered() == set(nodes), 120, logs())
        got = events()
        started = next(e["job_started"] for e in got if "job_started" in e)
        assert sorted(started["world"]["node_ids"]) == nodes[:2], started  # type: ignore[index]
        calls = [e["scheduler_call"] for e in got if "scheduler_call" in e]
        assert any(
            c["action"] == "replace" and c["detail"] == nodes[2] and c.get("ok") for c in calls
        ), calls
        steps = cluster.cmd("squeue", "-h", "-s", "-j", job, "-o", "%j %N").stdout
        names = sorted(line.split()[0] for line in steps.splitlines() if "agent" in line)
        assert names == [f"unbroken-agent-{n}" for n in nodes], steps
    finally:
        cluster.cmd("scancel", job, check=False)
