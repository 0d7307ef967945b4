"""Flash checkpoints end to end: real `unbroken agent` processes, real dp2 training.

An in-process DriverService (leader on an in-memory log) and two agents, one worker each
(`python -m unbroken.trainer.run --preset tiny --dp 2`, flash-saving every step into its
agent's shared memory; the agents persist to a shared directory and replicate to each
other, a ring of two). The reference is the same training run uninterrupted, without
agents. Each scenario ends with a StartWorkers command to both agents (a fresh master
port), after which every rank restores the newest step every rank can get and training
finishes; the losses of every step, before and after the restore, must equal the
reference's exactly.

One run, two faults (each cluster start costs ~10 s of torch imports on 2 cores):
1. A worker is SIGKILLed mid-training: it restores from its agent's memory; its peer's
   memory copy of that step is bit-flipped first, so the peer falls back to the next
   source (storage).
2. Later a node is lost (its agent SIGKILLed, its worker dies with it, its memory gone):
   a replacement agent gets the node's copies back from the buddy and restores from them.
Throughout, the agents report every shard they persisted and verified; the driver's log
must then hold exactly one CheckpointCommitted per committed step, in step order, each
naming both ranks' shards, the last one for the final step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import pytest

from tests.integration.trainenv import plain_worker_env
from unbroken.cli.cluster import is_agent_helper
from unbroken.diagnostics.check import free_port
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.liveview import LiveViewConfig
from unbroken.driver.service import DriverService, ServiceConfig, build_server
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.flashcopy import list_copies, replica_store
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.persist import list_persisted, read_shard, step_dir

pytestmark = pytest.mark.integration

STEPS = 60
JOB = "e2e"
TRAIN = ["-m", "unbroken.trainer.run", "--preset", "tiny", "--dp", "2", "--log-every", "1000"]
RESTORED = re.compile(r"flash\.restored.*?source=(\w+).*?step=(\d+)")


def _train_cmd(metrics: Path) -> str:
    return " ".join([sys.executable, *TRAIN, "--steps", str(STEPS), "--metrics-out", str(metrics)])


def _losses(metrics: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            m = json.loads(line)
            out.setdefault(int(m["step"]), []).append(float(m["loss"]))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run: two plain processes, no agent, no flash."""
    tmp = tmp_path_factory.mktemp("reference")
    metrics = tmp / "metrics.jsonl"
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = plain_worker_env(rank, 2, port)
            log = open(tmp / f"rank{rank}.log", "wb")  # the child owns it
            procs.append(
                psutil.Popen(
                    [sys.executable, *TRAIN, "--steps", str(STEPS), "--metrics-out", str(metrics)],
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            )
            log.close()
        for p in procs:
            assert p.wait(timeout=180) == 0, (tmp / "rank0.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.is_running():
                p.kill()
    losses = _losses(metrics)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return {s: v[0] for s, v in losses.items()}


class Cluster:
    """A driver in this process and `unbroken agent` processes on loopback."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.persist = tmp / "storage"
        self.metrics = tmp / "metrics.jsonl"
        self.agents: dict[str, asyncio.subprocess.Process] = {}
        self.shm: dict[str, Path] = {}
        self.replica_ports: dict[str, int] = {}
        self.master_port = free_port()
        self.service: DriverService | None = None
        self.log: InMemoryEventLog | None = None
        self.committed: list[int] = []  # steps of the CheckpointCommitted events appended
        self.server: object = None
        self.port = 0

    async def start_driver(self) -> None:
        store = InMemoryStore()
        # Liveness is not under test: two workers importing torch on 2 shared cores can
        # starve an agent's heartbeat past the default 300 ms limit.
        self.service = DriverService(
            ServiceConfig(live=LiveViewConfig(miss_limit=100)), driver_id="d", job_id=JOB
        )
        self.log = InMemoryEventLog(store, JOB, store.elect("d"))
        self.service.lead(self.log, "")
        self.service.listeners.append(
            lambda e: (
                self.committed.append(e.checkpoint_committed.step)
                if e.WhichOneof("payload") == "checkpoint_committed"
                else None
            )
        )
        self.service.start()
        self.server, self.port, _ = await build_server(self.service, "127.0.0.1:0")

    async def start_agent(
        self, node: str, *, node_rank: int, flash_node: str, buddy: str, start: bool = True
    ) -> None:
        self.shm[node] = Path(self.tmp / f"shm-{node}")
        args = [
            "--driver", f"127.0.0.1:{self.port}",
            "--node-id", node,
            "--worker-cmd", _train_cmd(self.metrics),
            "--nnodes", "2",
            "--node-rank", str(node_rank),
            "--master-port", str(self.master_port),
            "--log-dir", str(self.tmp / f"logs-{node}"),
            "--socket", str(self.tmp / f"{node}.sock"),
            "--flash-dir", str(self.shm[node]),
            "--flash-job", JOB,
            "--flash-node", flash_node,
            "--persist-url", str(self.persist),
            "--persist-every-s", "0.001",  # every copy after the first agreement (8 steps)
            "--replica-listen", f"127.0.0.1:{self.replica_port(node)}",
            "--buddy", f"127.0.0.1:{self.replica_port(buddy)}",
            # not under test here: its child's torch import would compete with the start
            "--no-selfcheck",
        ]  # fmt: skip
        if not start:
            args.append("--no-start")
        out = open(self.tmp / f"agent-{node}.log", "ab")  # the child process owns it
        self.agents[node] = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "unbroken.cli.main",
            "agent",
            *args,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "UNBROKEN_REPLICA_KEY": "test-job-replica-key-0123456789",
            },
        )
        out.close()

    def replica_port(self, node: str) -> int:
        if node not in self.replica_ports:
            self.replica_ports[node] = free_port()
        return self.replica_ports[node]

    def worker_exit(self, node: str) -> int | None:
        """The worker's exit code once the agent reports it exited, else None."""
        assert self.service is not None
        slot = self.service.view.nodes.get(node)
        if slot is None or not slot.hb.workers:
            return None
        w = slot.hb.workers[0]
        return w.exit_code if w.state == dpb.WORKER_STATE_EXITED else None

    async def finished(self, *nodes: str) -> None:
        await self.until("the end of training", lambda: self.max_step() >= STEPS)
        await self.until(
            "the workers to exit", lambda: all(self.worker_exit(n) is not None for n in nodes), 60
        )
        for n in nodes:
            assert self.worker_exit(n) == 0, self.worker_log(n)[-3000:]

    def owner(self, node: str) -> FlashOwner:
        return FlashOwner(FlashConfig(root=str(self.shm[node]), job=JOB))

    def memory_steps(self, node: str, rank: int, store: str = "local") -> set[int]:
        return {r.manifest.step for r in list_copies(self.owner(node).rank_dir(rank, store))}

    def worker(self, node: str) -> psutil.Process:
        kids = psutil.Process(self.agents[node].pid).children()
        kids = [k for k in kids if not is_agent_helper(k)]  # the checks, the opinion helper
        assert len(kids) == 1, kids
        return kids[0]

    def worker_log(self, node: str) -> str:
        p = self.tmp / f"logs-{node}" / "worker-0.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def agent_warnings(self) -> dict[str, list[str]]:
        """Each agent's last few warnings and errors (what a timeout's message needs)."""
        out = {}
        for p in sorted(self.tmp.glob("agent-*.log")):
            lines = p.read_text(errors="replace").splitlines()
            bad = [ln[:300] for ln in lines if "[warning" in ln or "[error" in ln]
            out[p.stem] = bad[-8:]
        return out

    def restores(self, node: str) -> int:
        return len(RESTORED.findall(self.worker_log(node)))

    def restored(self, node: str) -> tuple[str, int]:
        found = RESTORED.findall(self.worker_log(node))
        assert found, f"{node} did not restore:\n{self.worker_log(node)[-3000:]}"
        return found[-1][0], int(found[-1][1])

    async def until(self, what: str, cond: Callable[[], bool], timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                logs = {n: self.worker_log(n)[-1500:] for n in self.agents if n != "gone"}
                raise AssertionError(
                    f"timed out waiting for {what}; agents' warnings: {self.agent_warnings()}; "
                    f"worker logs: {logs}"
                )
            await asyncio.sleep(0.05)

    async def registered(self, *nodes: str) -> None:
        assert self.service is not None
        view = self.service.view
        await self.until(
            f"{nodes} to register and open a session",
            lambda: all(
                n in view.nodes and view.nodes[n].alive and view.nodes[n].outbox is not None
                for n in nodes
            ),
        )

    async def restart_world(self, nodes: dict[str, int]) -> None:
        """StartWorkers on every node (node -> rank base) with a fresh master port."""
        assert self.service is not None
        port = free_port()
        replies = await asyncio.gather(
            *(
                self.service.request(
                    n,
                    dpb.DriverMessage(
                        start_workers=dpb.StartWorkers(
                            world_size=2,
                            global_rank_base=base,
                            master_addr="127.0.0.1",
                            master_port=port,
                        )
                    ),
                    60,
                )
                for n, base in nodes.items()
            )
        )
        assert all(r.ack.ok for r in replies), replies

    def max_step(self) -> int:
        steps = _losses(self.metrics)
        return max(steps) if steps else 0

    async def close(self) -> None:
        for p in self.agents.values():
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in self.agents.values():
            try:
                await asyncio.wait_for(p.wait(), 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                await p.wait()
        if self.server is not None:
            await self.server.stop(0.5)  # type: ignore[attr-defined]
        if self.service is not None:
            await self.service.close()


def _run(tmp: Path, scenario: Callable[[Cluster], Awaitable[None]]) -> Cluster:
    async def go() -> Cluster:
        c = Cluster(tmp)
        await c.start_driver()
        try:
            await scenario(c)
        finally:
            await c.close()
        return c

    return asyncio.run(go())


def _flip_a_byte(owner: FlashOwner, rank: int, step: int) -> None:
    ref = next(r for r in list_copies(owner.rank_dir(rank)) if r.manifest.step == step)
    with open(ref.data_path, "r+b") as f:
        f.seek(ref.manifest.data_nbytes // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


def _assert_losses_equal(
    metrics: Path, reference: dict[int, float], restored: tuple[int, ...]
) -> None:
    got = _losses(metrics)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        for v in values:  # steps replayed after a restore must match too
            assert v == reference[step], (step, v, reference[step])
    for s in restored:  # the step after each restore was run (again) from the copy
        assert len(got[s + 1]) >= 1


def test_worker_kill_corrupt_shard_and_lost_node_all_resume_exactly(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    seen: dict[str, tuple[str, int]] = {}
    steps: dict[str, int] = {}
    commits: list[ev.CheckpointCommitted] = []
    checksums: dict[str, str] = {}

    async def scenario(c: Cluster) -> None:
        await c.start_agent("n0", node_rank=0, flash_node="n0", buddy="n1")
        await c.start_agent("n1", node_rank=1, flash_node="n1", buddy="n0")
        await c.registered("n0", "n1")

        # 1. Rank 1's worker is SIGKILLed; rank 0's memory copy of that step is corrupted.
        await c.until("step 12", lambda: c.max_step() >= 12)  # persisting every step by now
        victim = c.worker("n1")
        # workers run below the agent's priority, so its heartbeats keep the CPU
        assert victim.nice() == psutil.Process(c.agents["n1"].pid).nice() + 5
        victim.kill()
        victim.wait(10)
        s1 = steps["kill"] = max(c.memory_steps("n1", 1))
        await c.until("rank 0's copy of the step", lambda: s1 in c.memory_steps("n0", 0))
        await c.until(
            "rank 0's shard in storage", lambda: 0 in list_persisted(str(c.persist)).get(s1, {})
        )
        _flip_a_byte(c.owner("n0"), 0, s1)
        await c.restart_world({"n0": 0, "n1": 1})
        await c.until("both ranks to restore", lambda: c.restores("n0") == c.restores("n1") == 1)
        seen["kill:n0"], seen["kill:n1"] = c.restored("n0"), c.restored("n1")

        # 2. Node n1 is lost: its agent SIGKILLed (its worker must die with it), its memory
        # gone. Rank 1 is held still first so that its newest copy is the replicated one.
        await c.until("progress after the restore", lambda: c.max_step() >= s1 + 4)
        victim = c.worker("n1")
        victim.suspend()
        s2 = steps["lost"] = max(c.memory_steps("n1", 1))
        await c.until(
            "the buddy's replica", lambda: s2 in c.memory_steps("n0", 1, replica_store("n1"))
        )
        await c.until("rank 0's copy of the step", lambda: s2 in c.memory_steps("n0", 0))
        c.agents["n1"].kill()
        await c.agents["n1"].wait()
        await c.until("the orphaned worker to die", lambda: not victim.is_running(), 10)
        c.agents["gone"] = c.agents.pop("n1")
        for f in (c.shm["n1"] / JOB).rglob("*"):
            if f.is_file():
                f.unlink()
        # The replacement takes n1's place in the ring and gets its copies back from n0.
        await c.start_agent("n1b", node_rank=1, flash_node="n1", buddy="n0", start=False)
        await c.registered("n1b")
        assert s2 in c.memory_steps("n1b", 1, replica_store("n1"))
        await c.restart_world({"n0": 0, "n1b": 1})
        await c.finished("n0", "n1b")
        seen["lost:n0"], seen["lost:n1b"] = c.restored("n0"), c.restored("n1b")
        await c.until("the final step's commit", lambda: STEPS in c.committed, 60)
        assert c.log is not None
        commits.extend(
            e.checkpoint_committed
            for e in await c.log.read()
            if e.WhichOneof("payload") == "checkpoint_committed"
        )
        # The final step's shards are still in storage (retention keeps the newest):
        # the committed checksum is that of the very shards there, verified again.
        final = sorted(list_persisted(str(c.persist))[STEPS].items())
        shards = [read_shard(uri)[0] for _, uri in final]
        crc = 0
        for m in shards:
            crc = zlib.crc32(m.checksum.to_bytes(8, "little"), crc)
        checksums["final"] = f"{crc:08x}"

    c = _run(tmp_path, scenario)
    s1, s2 = steps["kill"], steps["lost"]
    assert seen["kill:n1"] == ("memory", s1)  # the killed worker: its agent's memory
    assert seen["kill:n0"] == ("storage", s1)  # its memory copy is corrupt: the next source
    assert seen["lost:n1b"] == ("buddy", s2)  # the lost node's state, from the buddy
    assert seen["lost:n0"] == ("memory", s2)
    _assert_losses_equal(c.metrics, reference, (s1, s2))
    # Exactly one commit per step, in step order, each of both ranks' verified shards;
    # the step a worker was killed at was still committed (its agent persisted it).
    got = [p.step for p in commits]
    assert got == sorted(set(got)) and got[-1] == STEPS, got
    assert s1 in got, got
    for p in commits:
        assert p.ranks == 2 and p.bytes > 0 and p.uri == step_dir(str(c.persist), p.step), p
    assert commits[-1].checksum == checksums["final"]
    # a clean shutdown frees the shared memory
    assert not (c.shm["n0"] / JOB).exists() and not (c.shm["n1b"] / JOB).exists()
