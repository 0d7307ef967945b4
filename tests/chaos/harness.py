"""The chaos cluster: etcd, a leader and a standby driver, agents and a spare, training.

`ChaosCluster` starts (all real processes, on loopback, free ports):

- an embedded etcd (SIGKILLed and restarted on the same ports and data dir by the chaos);
- two drivers (`driverprobe.py`, which records acknowledgements and the recovery loop's
  state; see that module), each behind a `DriverProxy` whose address it advertises;
- `nodes` agents (`--no-start`; the driver starts the job: the tiny gpt3d model, dp over
  the nodes, one worker each, flash-saving every step) and one spare; every agent reaches
  the drivers only through the proxies, so its network can be cut;
- a reference run of the same training without agents, at nice +10: the uninterrupted
  losses the chaos run must reproduce, and CPU load for the cluster to work under.

Every process inherits `UNBROKEN_CHAOS_RUN=<marker>`, so `leftovers()` finds anything of
this run still alive, orphans included. Faults live in tests/chaos/faults.py, the pass
criteria in tests/chaos/checks.py.
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
from typing import Any

import grpc
import psutil

from tests.chaos.proxy import DriverProxy, ProxyLoop
from tests.integration.trainenv import plain_worker_env
from unbroken.driver.etcd import EmbeddedEtcd, EmbeddedEtcdCluster, free_port
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

MARKER = "UNBROKEN_CHAOS_RUN"
PROBE = str(Path(__file__).with_name("driverprobe.py"))
TRAIN = ["-m", "unbroken.trainer.run", "--preset", "tiny", "--log-every", "1000"]
MISS_LIMIT = 30  # 3 s of missed heartbeats: torch imports on 2 loaded cores starve agents
RPC_TIMEOUT_S = 5.0


class ChaosError(AssertionError):
    """A pass criterion failed or the cluster did not get back to training in time."""


def until(what: str, cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.1) -> None:
    """Wait for `cond()` (at most `timeout_s`), else raise ChaosError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise ChaosError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


class LogReader:
    """Reads the job's event log from etcd on the proxy loop (retrying while etcd is down)."""

    def __init__(self, loop: ProxyLoop, endpoint: str, job: str) -> None:
        # `endpoint`: one URL or a comma-separated list (every member of a cluster)
        self.loop, self.endpoint, self.job = loop, endpoint, job
        self._client: Any = None
        self._log: Any = None

    async def _open(self) -> Any:
        from unbroken.driver.etcd import EtcdConfig
        from unbroken.driver.etcdlog import EtcdEventLog, connect

        if self._log is None:
            cfg = EtcdConfig(endpoints=self.endpoint.split(","), connect_timeout_s=2.0)
            self._client = await connect(cfg)
            self._log = EtcdEventLog(self._client, self.job, None)
        return self._log

    def read(self, from_seq: int = 1, timeout_s: float = 10.0) -> list[ev.Event] | None:
        """Events from `from_seq` on, or None when etcd did not answer in time."""

        async def go() -> list[ev.Event]:
            log = await self._open()
            return list(await asyncio.wait_for(log.read(from_seq), timeout_s))

        try:
            return self.loop.call(go(), timeout_s + 5)
        except Exception:
            self.loop.call(self._reset(), 10)
            return None

    async def _reset(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
        self._client = self._log = None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.call(self._reset(), 10)


class ChaosCluster:
    """The processes of one chaos run and the handles to hurt them."""

    def __init__(
        self, tmp: Path, *, nodes: int = 2, spares: int = 1, etcd_members: int = 1
    ) -> None:
        self.tmp = tmp
        self.nodes = nodes
        self.marker = uuid.uuid4().hex
        self.job = f"chaos-{self.marker[:6]}"
        self.records = tmp / "records"
        self.records.mkdir()
        self.metrics = tmp / "metrics.jsonl"
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "UNBROKEN_REPLICA_KEY": "test-job-replica-key-0123456789",  # the buddy stream's HMAC
            MARKER: self.marker,
            "UNBROKEN_ARCHIVE": str(tmp / "archive"),
        }
        self.etcd: EmbeddedEtcd | None = None  # the single member (etcd_members == 1)
        self.etcd_members = etcd_members
        self.etcd_cluster: EmbeddedEtcdCluster | None = None  # etcd_members > 1
        self.loop = ProxyLoop()
        self.proxies = {s: DriverProxy(self.loop, s) for s in ("a", "b")}
        self.drivers: dict[str, subprocess.Popen[bytes]] = {}  # slot -> process
        self.driver_ids: dict[str, str] = {}
        self.driver_addr: dict[str, str] = {}  # slot -> real address
        self._driver_gen = 0
        self.agents: dict[str, subprocess.Popen[bytes]] = {}  # node id -> process
        self.spare_ids: list[str] = []
        self.replica: dict[str, int] = {}
        self.others: list[subprocess.Popen[bytes]] = []  # the reference run
        self.reader: LogReader | None = None
        self.spares = spares
        self._spare_n = 0
        self.ref_metrics = tmp / "reference" / "metrics.jsonl"
        self.final_events: list[ev.Event] = []  # the log as the live checks read it

    # ------------------------------------------------------------ start
    def start(self) -> None:
        """Start everything and wait for the first training steps."""
        with self.marked():
            if self.etcd_members > 1:
                self.etcd_cluster = EmbeddedEtcdCluster(self.etcd_members, self.tmp / "etcd")
                self.etcd_cluster.start()
            else:
                self.etcd = EmbeddedEtcd(self.tmp / "etcd").start()
        self.reader = LogReader(self.loop, self.etcd_endpoint, self.job)
        for p in self.proxies.values():
            p.start()
        for slot in self.proxies:
            self.start_driver(slot)
        for i in range(self.nodes):
            self.start_agent(f"n{i}", buddy=f"n{(i + 1) % self.nodes}")
        for _ in range(self.spares):
            self.start_spare()
        self.start_reference()
        until("the first training steps", lambda: self.max_step() >= 2, 600, 0.25)

    @property
    def etcd_endpoint(self) -> str:
        """What drivers are given as --etcd (every member's URL, comma-separated)."""
        if self.etcd_cluster is not None:
            return self.etcd_cluster.endpoint
        assert self.etcd is not None
        return self.etcd.endpoint

    @contextlib.contextmanager
    def marked(self) -> Iterator[None]:
        """Children spawned inside (etcd, by EmbeddedEtcd) inherit this run's marker."""
        old = os.environ.get(MARKER)
        os.environ[MARKER] = self.marker
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(MARKER, None)
            else:
                os.environ[MARKER] = old

    def _spawn(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "ab") as out:  # the child keeps its own fd
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=kw.pop("env", self.env),
                **kw,
            )

    def worker_cmd(self) -> str:
        cmd = [sys.executable, *TRAIN, "--dp", str(self.nodes), "--steps", "100000"]
        return " ".join([*cmd, "--metrics-out", str(self.metrics)])

    def start_driver(self, slot: str) -> None:
        """Start (or restart) the driver of `slot` behind its proxy."""
        self._driver_gen += 1
        driver_id = f"{slot}{self._driver_gen}"
        port_file = self.tmp / f"driver-{driver_id}.json"
        proxy = self.proxies[slot]
        self.drivers[slot] = self._spawn(
            f"driver-{driver_id}",
            [
                sys.executable, PROBE, str(self.records), "driver",
                "--etcd", self.etcd_endpoint, "--job-id", self.job, "--driver-id", driver_id,
                "--listen", "127.0.0.1:0", "--allow-fault-injection", "--advertise", proxy.address,
                "--port-file", str(port_file), "--miss-limit", str(MISS_LIMIT),
                "--nodes", str(self.nodes), "--workers-per-node", "1", "--dp", str(self.nodes),
                "--worker-cmd", self.worker_cmd(), "--master-addr", "127.0.0.1",
                "--trainer", "gpt3d",
            ],
        )  # fmt: skip
        self.driver_ids[slot] = driver_id
        proc = self.drivers[slot]
        until(f"driver {driver_id}'s port file", lambda: port_file.exists() or _dead(proc), 60)
        if _dead(proc):
            raise ChaosError(f"driver {driver_id} exited with {proc.returncode}")
        self.driver_addr[slot] = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"
        proxy.set_upstream(self.driver_addr[slot])

    def _replica_port(self, node: str) -> int:
        if node not in self.replica:
            self.replica[node] = free_port()
        return self.replica[node]

    def start_agent(self, node: str, buddy: str, *, spare: bool = False) -> None:
        drivers = ",".join(p.address for p in self.proxies.values())
        args = [
            sys.executable, "-m", "unbroken.cli", "agent",
            "--driver", drivers, "--node-id", node, "--no-start",
            "--worker-cmd", sys.executable + " -c pass",  # the driver's --worker-cmd wins
            "--allow-remote-cmd",
            "--log-dir", str(self.tmp / f"logs-{node}"),
            "--socket", str(self.tmp / f"{node}.sock"),
            "--flash-dir", str(self.tmp / f"shm-{node}"), "--flash-job", self.job,
            "--persist-url", str(self.tmp / "storage"),
            "--replica-listen", f"127.0.0.1:{self._replica_port(node)}",
            "--buddy", f"127.0.0.1:{self._replica_port(buddy)}",
        ]  # fmt: skip
        if spare:
            args.append("--spare")
        self.agents[node] = self._spawn(f"agent-{node}", args)

    def start_spare(self) -> str:
        """A fresh spare node (a new machine joining the pool)."""
        node = f"s{self._spare_n}"
        self._spare_n += 1
        self.start_agent(node, buddy="n0", spare=True)
        self.spare_ids.append(node)
        return node

    def start_reference(self) -> None:
        """The same training without agents, uninterrupted, at nice +10 (also: load)."""
        ref = self.ref_metrics.parent
        ref.mkdir()
        port = free_port()
        for rank in range(self.nodes):
            env = {**plain_worker_env(rank, self.nodes, port), MARKER: self.marker}
            cmd = [*TRAIN, "--dp", str(self.nodes), "--steps", "100000"]
            cmd += ["--metrics-out", str(self.ref_metrics)]
            self.others.append(
                self._spawn(
                    f"reference-{rank}",
                    [sys.executable, *cmd],
                    env=env,
                    cwd=str(ref),
                    preexec_fn=lambda: os.nice(10),
                )
            )

    # ------------------------------------------------------------ observe
    def steps(self, path: Path | None = None) -> dict[int, list[float]]:
        """step -> every loss rank 0 logged for it (a step run twice appears twice)."""
        out: dict[int, list[float]] = {}
        path = path or self.metrics
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    m = json.loads(line)
                    out.setdefault(int(m["step"]), []).append(float(m["loss"]))
        return out

    def max_step(self) -> int:
        return max(self.steps(), default=0)

    def _rpc(self, slot: str, name: str, request: Any) -> Any:
        addr = self.driver_addr.get(slot)
        if not addr or _dead(self.drivers.get(slot)):
            return None
        try:
            with grpc.insecure_channel(addr) as ch:
                return getattr(dgrpc.DriverStub(ch), name)(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError:
            return None

    def leader_slot(self) -> str | None:
        """The slot whose driver says it leads (None during an election)."""
        for slot in self.drivers:
            r = self._rpc(slot, "LiveView", dpb.LiveViewRequest(summary_only=True))
            if r is not None and r.leader:
                return slot
        return None

    def status(self) -> tuple[str, dpb.GetStatusResponse] | None:
        slot = self.leader_slot()
        if slot is None:
            return None
        r = self._rpc(slot, "GetStatus", dpb.GetStatusRequest())
        return (slot, r) if r is not None else None

    def list_nodes(self, slot: str) -> dpb.ListNodesResponse | None:
        return self._rpc(slot, "ListNodes", dpb.ListNodesRequest())

    def world_nodes(self) -> list[str]:
        """Node ids of the current world (from the leader's folded state)."""
        events = self.reader.read() if self.reader else None
        world: list[str] = []
        for e in events or []:
            kind = e.WhichOneof("payload")
            if kind == "job_started":
                world = list(e.job_started.world.node_ids)
            elif kind == "training_resumed" and e.training_resumed.HasField("world"):
                world = list(e.training_resumed.world.node_ids)
            elif kind == "world_resized":
                world = list(e.world_resized.new_world.node_ids)
        return world

    def spares_alive(self) -> list[str] | None:
        """Spare agents running and still spares in the leader's view (None: no answer)."""
        st = self.status()
        if st is None:
            return None
        nodes = self.list_nodes(st[0])
        if nodes is None:
            return None
        return [
            n.node_id
            for n in nodes.nodes
            if n.state == ev.NODE_STATE_SPARE and n.alive and not _dead(self.agents.get(n.node_id))
        ]

    def logs(self, tail: int = 2500) -> str:
        parts = []
        for f in sorted(self.tmp.glob("*.log")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        for f in sorted(self.tmp.glob("logs-*/worker-*.log")):
            parts.append(f"--- {f.parent.name}/{f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        """SIGTERM every process group (SIGCONT first), SIGKILL what is left after a grace."""
        procs = [*self.agents.values(), *self.drivers.values(), *self.others]
        for p in procs:
            _signal_group(p, signal.SIGCONT)
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        for p in procs:
            _signal_group(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        if self.reader is not None:
            self.reader.close()
        for proxy in self.proxies.values():
            proxy.close()
        self.loop.close()
        if self.etcd is not None:
            if self.etcd.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.etcd.proc.send_signal(signal.SIGCONT)
            self.etcd.stop(remove=False)
        if self.etcd_cluster is not None:
            with self.marked():  # (nothing is spawned; kept symmetric with start)
                for m in self.etcd_cluster.members:
                    if m.proc is not None:
                        with contextlib.suppress(ProcessLookupError):
                            m.proc.send_signal(signal.SIGCONT)
                self.etcd_cluster.stop(remove=False)

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this run (by the inherited marker) still alive, this one excepted."""
        me = os.getpid()
        out = []
        for p in psutil.process_iter(["pid"]):
            if p.pid == me:
                continue
            try:
                if p.environ().get(MARKER) == self.marker and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out


def _dead(p: subprocess.Popen[bytes] | None) -> bool:
    return p is None or p.poll() is not None


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)
