"""The integration tests' training job on the shared harness (`unbroken.cli.cluster`).

`Job` is a `LocalCluster` on the session's etcd that runs the tests' usual job: one driver
(`unbroken driver --nodes 2 --dp 2`, the tiny trainer flash-saving every step, writing rank
0's losses to `metrics`) starting it on `unbroken agent --no-start` processes, plus spares.
The `job` fixture (tests/conftest.py) gives one and stops everything after the test.
`reference` runs the same training without agents, the losses a recovered run must equal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
import psutil

from tests.integration.trainenv import plain_worker_env
from unbroken.cli.cluster import LocalCluster, read_metrics, until
from unbroken.driver.etcd import distinct_port, free_port
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

TRAIN = ["-m", "unbroken.trainer.run", "--preset", "tiny", "--dp", "2", "--log-every", "1000"]
REPLICA_KEY = "test-job-replica-key-0123456789"  # the buddy stream's HMAC key


class Job(LocalCluster):
    """A driver process, agents, and what they wrote (see the module docstring)."""

    #: Whether the agents run their registration self-check. Off unless a test is about it:
    #: its child imports torch (1.3 CPU-s) beside the workers' start on 2 shared cores,
    #: ~3 s later to the first step per test (5 of test_recovery_loop's and test_elastic's
    #: tests: 84 s with it, 69 s without). tests/integration/test_selfcheck_report.py,
    #: test_loop_diagnosis.py and test_diagnosis_agents.py run it.
    selfcheck = False

    def __init__(self, tmp: Path, endpoint: str, *, steps: int = 100000) -> None:
        super().__init__(
            tmp, job=f"loop-{uuid.uuid4().hex[:6]}", etcd=endpoint,
            env={"UNBROKEN_REPLICA_KEY": REPLICA_KEY}, grace_s=15,
        )  # fmt: skip
        self.tmp = tmp
        self.steps_to_train = steps
        self.address = ""  # the first driver's

    def worker_cmd(self, dp: int = 2) -> str:
        cmd = [sys.executable, *TRAIN, "--steps", str(self.steps_to_train)]
        return " ".join([*cmd, "--dp", str(dp), "--metrics-out", str(self.metrics)])

    def start_driver(  # type: ignore[override]
        self,
        *extra: str,
        name: str = "driver",
        nodes: int = 2,
        listen: str = "127.0.0.1:0",
        wait_s: float = 120.0,
        steps: int | None = None,
    ) -> str:
        """Start a driver of the job (`extra`: more flags, the last of a repeated one wins);
        wait for its port file; its address."""
        if steps is not None:
            self.steps_to_train = steps
        address = super().start_driver(
            name,
            [
                "--allow-fault-injection",
                "--miss-limit", "30",  # 3 s: torch imports on 2 cores starve heartbeats
                "--nodes", str(nodes), "--workers-per-node", "1", "--dp", str(nodes),
                "--worker-cmd", self.worker_cmd(nodes), "--master-addr", "127.0.0.1",
                *extra,
            ],
            listen=listen,
            wait_s=wait_s,
        )  # fmt: skip
        self.address = self.address or address
        return address

    def port(self, node: str) -> int:
        return self.replica_port(node)

    def start_agent(  # type: ignore[override]
        self, node: str, buddy: str, *, spare: bool = False, extra: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        return super().start_agent(
            node,
            [
                "--no-start",
                "--worker-cmd", sys.executable + " -c pass",  # the driver's --worker-cmd wins
                "--allow-remote-cmd",
                "--flash-dir", str(self.tmp / f"shm-{node}"), "--flash-job", self.job,
                # 10 s: these tests are not about hangs, and on 2 busy cores a peer's hiccup
                # inside FSDP's all-gather can pass the 1 s default (a false hang, a diagnosis)
                "--hang-floor-ms", "10000",
                # these tests train; the warm check process (torch imported: 2 CPU-s at the
                # start, 235 MB) is tested where diagnoses are (test_diagnosis_agents, test_cli)
                "--no-warm-checks",
                *(() if self.selfcheck else ("--no-selfcheck",)),
                *extra,
            ],
            buddy=buddy,
            spare=spare,
            drivers=self.address or None,  # a test may name drivers not started yet
        )  # fmt: skip

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        """Start a whole `unbroken` command line as `name`, in the environment of now (a
        test may set SLURM_CONF after building the job)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_REPLICA_KEY": REPLICA_KEY}
        role = args[0] if args[:1] in (["driver"], ["agent"]) else "other"
        return self.spawn(name, args, role=role, env=env)

    def close(self) -> None:
        self.stop()

    def kill_peer_keep_survivor(
        self,
        victim: str = "n1",
        survivor: str = "n0",
        *,
        past: int = 5,
        timeout_s: float = 180,
        on_kill: Callable[[psutil.Process], object] | None = None,
    ) -> int:
        """SIGKILL `victim`'s worker, wait until a new one trained `past` steps beyond the
        crash, and check `survivor`'s worker kept its process (in-job recovery); its pid.
        `on_kill` is called with the killed worker at once."""
        kept, killed = self.worker(survivor), self.worker(victim)
        assert kept is not None and killed is not None
        killed.kill()
        if on_kill is not None:
            on_kill(killed)
        crash_step = self.max_step()
        until(
            lambda: (
                (w := self.worker(victim)) is not None
                and w.pid != killed.pid
                and self.max_step() >= crash_step + past
            ),
            timeout_s,
            "training past the crash",
            self,
        )
        after = self.worker(survivor)
        assert after is not None and after.pid == kept.pid, (kept.pid, after)
        return kept.pid


def reference(
    tmp: Path,
    steps: int,
    *,
    world: int = 2,
    train: Sequence[str] = TRAIN,
    total_steps: int = 100000,
) -> dict[int, float]:
    """The same training (`train`, `world` ranks, `--steps total_steps`: the learning-rate
    schedule decays over them), uninterrupted and without agents, until `steps` (the Job's
    own training a little further, below; then killed): step -> its loss (at least steps
    1..`steps`).

    The training is deterministic (the tests compare its losses bit for bit), so a run of
    the same `train`, `world` and `total_steps` in this test session that went as far is
    reused: three tests of one file asked for the same 120 steps, each a torchrun's worth
    of CI time."""
    key = (world, tuple(train), total_steps)
    have = _REFERENCES.get(key)
    if have is not None and steps in have:
        return dict(have)
    # a miss of the Job's own training (test_elastic, test_recovery_loop, test_warm_workers
    # ask for it, each as far as its job went) trains on past `steps` (3 s more): the next
    # test, whose job went a little further, then finds its steps here (a new run: ~8 s)
    ahead = REFERENCE_AHEAD if tuple(train) == tuple(TRAIN) else 0
    until_step = min(total_steps, steps + ahead)
    tmp.mkdir()
    metrics = tmp / "metrics.jsonl"
    port = free_port()
    procs = []
    try:
        for rank in range(world):
            env = plain_worker_env(rank, world, port)
            out = open(tmp / f"rank{rank}.log", "wb")  # the child owns it
            cmd = [*train, "--steps", str(total_steps), "--metrics-out", str(metrics)]
            procs.append(  # in its own folder: a script may write into its cwd
                subprocess.Popen([sys.executable, *cmd], env=env, stdout=out, stderr=out, cwd=tmp)
            )
            out.close()

        def done() -> bool:
            if metrics.exists() and str(f'"step": {until_step},') in metrics.read_text():
                return True  # (a run to its last step may have ended by now)
            assert all(p.poll() is None for p in procs), (tmp / "rank0.log").read_text()[-3000:]
            return False

        until(done, 300, "the reference run")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    got = {step: losses[0] for step, losses in read_metrics(metrics).items()}
    if len(got) > len(have or ()):
        _REFERENCES[key] = got
    return dict(got)


#: Steps a reference run trains past the ones asked for (`reference`).
REFERENCE_AHEAD = 40
#: The reference runs of this session: (world, train, total_steps) -> step -> loss.
_REFERENCES: dict[tuple[int, tuple[str, ...], int], dict[int, float]] = {}


def operator_cluster(run: Path, etcd: object, *, wait_s: float = 120.0) -> LocalCluster:
    """A `LocalCluster` on `etcd` with one driver and no job (the recovery loop is off),
    fault injection allowed and liveness relaxed (50 missed heartbeats: torch imports on 2
    loaded cores starve them; liveness is not under test): for tests of operator commands
    and self-checks, which start their own agents. Use it as a context manager."""
    c = LocalCluster(
        run,
        etcd=etcd,  # type: ignore[arg-type]
        driver_args=("--allow-fault-injection", "--miss-limit", "50"),
    )
    try:
        c.start_driver(wait_s=wait_s)
    except BaseException:
        c.stop()
        raise
    return c


TOKEN = "dashboard-token-0123456789"  # the dashboard's read-only (viewer) token
NODE_TOKEN = "node-token-0123456789-abcdef"  # node-i's token: NODE_TOKEN-i, bound to it
MAX_NODES = 8  # the node ids (node-0..node-7) a DashCluster's driver has tokens for
OPERATOR_TOKEN = "operator-token-0123456789-abc"
SLOW_RANK = 3
HOOK_WORKER = """
import math, os, time
from unbroken.trainer import hooks
h = hooks.install()
rank = int(os.environ["RANK"])
pause = 0.1 if rank == int(os.environ.get("DASH_SLOW_RANK", "-1")) else 0.05
step = 0
while True:
    step += 1
    time.sleep(pause)
    h.step(step, loss=2.4 * math.exp(-step / 150) + 0.7 + 0.03 * math.sin(step / 3 + rank))
"""


class DashCluster(LocalCluster):
    """Drivers with a dashboard (`TOKEN` reads it) and agents running hook workers (no
    torch: step, loss and step time like a trainer's; global rank `SLOW_RANK` steps twice
    as slowly): the dashboard tests' cluster."""

    def __init__(self, tmp: Path, etcd: object, *, miss_limit: int = 10) -> None:
        super().__init__(
            tmp,
            job=f"dash-{uuid.uuid4().hex[:6]}",
            etcd=etcd,  # type: ignore[arg-type]
            env={"DASH_SLOW_RANK": str(SLOW_RANK)},
        )
        self.tmp = tmp
        self.miss_limit = miss_limit
        self.address = ""  # the first driver's
        self.dashboard = ""  # http://host:port of the first driver's dashboard
        self.pids = tmp / "worker-pids"

    def token_flags(self) -> list[str]:
        """The driver's --token-file flags: one file per role (viewer, node)."""
        out = []
        # node tokens are bound, one per node (the driver refuses an unbound one for Register)
        nodes = "".join(f"{NODE_TOKEN}-{i} node-{i}\n" for i in range(MAX_NODES))
        for role, text in (("viewer", TOKEN + "\n"), ("node", nodes)):
            f = self.tmp / f"{role}.tokens"
            f.write_text(text)
            f.chmod(0o600)  # token files must be private
            out += ["--token-file", f"{role}={f}"]
        return out

    def node_token_file(self, i: int) -> Path:
        """node-`i`'s own token file (its token is bound to node-`i` in the driver's file)."""
        f = self.tmp / f"node-{i}.token"
        f.write_text(f"{NODE_TOKEN}-{i}\n")
        f.chmod(0o600)
        return f

    def start_driver(self, name: str = "driver") -> str:  # type: ignore[override]
        """Start a driver; return its dashboard's base URL."""
        super().start_driver(
            name,
            ["--allow-fault-injection", "--dashboard-port", "0", *self.token_flags(),
             "--miss-limit", str(self.miss_limit)],
            wait_s=None,
        )  # fmt: skip
        info = self.wait_driver(name, 120)  # importing torch on a loaded 2-core machine
        assert info["dashboard_port"] > 0, info
        if not self.address:
            self.address = self.addresses[name]
            self.dashboard = f"http://127.0.0.1:{info['dashboard_port']}"
        return f"http://127.0.0.1:{info['dashboard_port']}"

    def start_agents(self, n: int = 2, nproc: int = 2) -> None:
        script = self.tmp / "worker.py"
        script.write_text(
            f"import os\nopen({str(self.pids)!r}, 'a').write(str(os.getpid()) + ' ')\n"
            + HOOK_WORKER
        )
        for i in range(n):
            self.start_agent(
                f"node-{i}",
                ["--nproc-per-node", str(nproc), "--nnodes", str(n), "--node-rank", str(i),
                 "--worker-cmd", f"{sys.executable} {script}", "--no-flash",
                 "--token-file", str(self.node_token_file(i))],
                drivers=self.address,
            )  # fmt: skip

    def stop(self, grace_s: float | None = None) -> None:
        """Stop everything, then the hook workers (sessions of their own) by their pids."""
        super().stop(grace_s)
        if self.pids.exists():
            for pid in self.pids.read_text().split():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)


def slurm_agent_script(job: Job, tmp: Path, buddy: Mapping[str, str]) -> Path:
    """`agent.sh NODE [FLAGS...]`: the job's agent on Slurm node NODE, as a job step runs it.

    Each node gets a replica port and its buddy's (`buddy`: node -> buddy node); the job's
    driver address is chosen here (`job.address`), for a driver the caller starts next.
    """
    taken: set[int] = set()  # no two of them the same (each was only free a moment ago)
    ports = {n: distinct_port(taken) for n in buddy}
    cases = "\n".join(f"  {n}) REPL={ports[n]}; BUDDY={ports[buddy[n]]};;" for n in sorted(buddy))
    job.address = f"127.0.0.1:{distinct_port(taken)}"
    script = tmp / "agent.sh"
    script.write_text(
        f"""#!/bin/bash
node=$1; shift
case $node in
{cases}
esac
exec {sys.executable} -m unbroken.cli agent --driver {job.address} --node-id $node \\
  --no-start --worker-cmd '{sys.executable} -c pass' --allow-remote-cmd \\
  --log-dir {tmp}/logs-$node \\
  --socket {tmp}/$node.sock --flash-dir {tmp}/shm-$node --flash-job {job.job} \\
  --persist-url {tmp}/storage --replica-listen 127.0.0.1:$REPL \\
  --buddy 127.0.0.1:$BUDDY "$@" >> {tmp}/$node.log 2>&1
"""
    )
    return script


#: The training of the Slurm runs: three nodes, one rank each.
SLURM_TRAIN = [
    "-m", "unbroken.trainer.run", "--preset", "tiny", "--dp", "3", "--global-batch", "12",
    "--log-every", "1000",
]  # fmt: skip


def start_slurm_driver(job: Job, conf: Path, port_file: Path, *extra: str) -> None:
    """The driver of a three-node Slurm job on `job.address` (`slurm_agent_script` chose it),
    `extra` flags added (the scheduler's); returns once its port file is written."""
    cmd = " ".join(
        [sys.executable, *SLURM_TRAIN, "--steps", "100000", "--metrics-out", str(job.metrics)]
    )
    os.environ["SLURM_CONF"] = str(conf)  # Job._spawn passes os.environ on
    try:
        job._spawn(
            "driver",
            ["driver", "--etcd", job.endpoint, "--job-id", job.job,
             "--listen", job.address, "--port-file", str(port_file),
             "--miss-limit", "30", "--nodes", "3", "--workers-per-node", "1", "--dp", "3",
             "--worker-cmd", cmd, "--master-addr", "127.0.0.1", *extra],
        )  # fmt: skip
    finally:
        os.environ.pop("SLURM_CONF", None)
    until(port_file.exists, 60, "the driver's port file", job)


#: A worker of the hooks SDK that steps every 0.1 s and all-reduces once a step (gloo), the
#: collective marked: the hang tests and bench/detectors.py SIGSTOP it.
ALLREDUCE_WORKER = """
import os, time
import torch
import torch.distributed as dist
from unbroken.trainer import hooks
h = hooks.install()
dist.init_process_group("gloo")
t = torch.ones(1)
step = 0
while True:
    step += 1
    time.sleep(0.1)  # the step's compute
    with h.collective():
        dist.all_reduce(t)
    h.step(step, loss=1.0)
"""


def inject(address: str, node: str, kind: str, *, step: int = 0, rank: int = 0) -> str:
    """Call the driver's InjectFault RPC; return the agent's detail (asserting it applied)."""
    with grpc.insecure_channel(address) as ch:
        req = dpb.InjectFaultRequest(node_id=node, kind=kind, step=step, local_rank=rank)
        resp = dgrpc.DriverStub(ch).InjectFault(req, timeout=30)
    assert resp.ok, resp.detail
    return str(resp.detail)
