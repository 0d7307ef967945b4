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
this run still alive, orphans included. The processes, their logs and the log reader are
the shipped harness's (`unbroken.cli.cluster.LocalCluster` and `LogWatch`); this module adds
the proxies, the probing drivers and the reference run. Faults live in tests/chaos/faults.py,
the pass criteria in tests/chaos/checks.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from tests.chaos.proxy import DriverProxy, ProxyLoop
from tests.integration.trainenv import plain_worker_env
from unbroken.cli.cluster import LocalCluster, LogWatch, read_metrics, until, world_of
from unbroken.driver.etcd import EmbeddedEtcd, EmbeddedEtcdCluster, free_port
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

MARKER = "UNBROKEN_CHAOS_RUN"
PROBE = str(Path(__file__).with_name("driverprobe.py"))
TRAIN = ["-m", "unbroken.trainer.run", "--preset", "tiny", "--log-every", "1000"]
MISS_LIMIT = 30  # 3 s of missed heartbeats: torch imports on 2 loaded cores starve agents


class ChaosError(AssertionError):
    """A pass criterion failed or the cluster did not get back to training in time."""


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
        self.local = LocalCluster(
            tmp, job=self.job, etcd_members=etcd_members, env=self.env, grace_s=20
        )
        self.loop = ProxyLoop()
        self.proxies = {s: DriverProxy(self.loop, s) for s in ("a", "b")}
        self.drivers: dict[str, subprocess.Popen[bytes]] = {}  # slot -> process
        self.driver_ids: dict[str, str] = {}
        self.driver_addr: dict[str, str] = {}  # slot -> real address
        self._driver_gen = 0
        self.agents: dict[str, subprocess.Popen[bytes]] = {}  # node id -> process
        self.spare_ids: list[str] = []
        self.reader: LogWatch | None = None
        self.spares = spares
        self._spare_n = 0
        self.ref_metrics = tmp / "reference" / "metrics.jsonl"
        self.final_events: list[ev.Event] = []  # the log as the live checks read it

    # ------------------------------------------------------------ start
    def start(self) -> None:
        """Start everything and wait for the first training steps."""
        with self.marked():
            self.local.start()
        self.reader = LogWatch(self.local, view=False)
        for p in self.proxies.values():
            p.start()
        for slot in self.proxies:
            self.start_driver(slot)
        for i in range(self.nodes):
            self.start_agent(f"n{i}", buddy=f"n{(i + 1) % self.nodes}")
        for _ in range(self.spares):
            self.start_spare()
        self.start_reference()
        until(lambda: self.max_step() >= 2, 600, "the first training steps", poll_s=0.25)

    @property
    def etcd(self) -> EmbeddedEtcd | None:
        """The single member (etcd_members == 1)."""
        etcd = self.local.etcd
        return etcd if isinstance(etcd, EmbeddedEtcd) else None

    @property
    def etcd_cluster(self) -> EmbeddedEtcdCluster | None:
        """The members (etcd_members > 1)."""
        etcd = self.local.etcd
        return etcd if isinstance(etcd, EmbeddedEtcdCluster) else None

    @property
    def etcd_endpoint(self) -> str:
        """What drivers are given as --etcd (every member's URL, comma-separated)."""
        return self.local.endpoint

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

    def worker_cmd(self) -> str:
        cmd = [sys.executable, *TRAIN, "--dp", str(self.nodes), "--steps", "100000"]
        return " ".join([*cmd, "--metrics-out", str(self.metrics)])

    def start_driver(self, slot: str) -> None:
        """Start (or restart) the driver of `slot` behind its proxy."""
        self._driver_gen += 1
        driver_id = f"{slot}{self._driver_gen}"
        proxy = self.proxies[slot]
        try:
            self.driver_addr[slot] = self.local.start_driver(
                driver_id,
                [
                    "--allow-fault-injection", "--advertise", proxy.address,
                    "--miss-limit", str(MISS_LIMIT),
                    "--nodes", str(self.nodes), "--workers-per-node", "1",
                    "--dp", str(self.nodes), "--worker-cmd", self.worker_cmd(),
                    "--master-addr", "127.0.0.1", "--trainer", "gpt3d",
                ],
                launcher=[sys.executable, PROBE, str(self.records)],
            )  # fmt: skip
        finally:
            self.drivers[slot] = self.local.procs[driver_id]
            self.driver_ids[slot] = driver_id
        proxy.set_upstream(self.driver_addr[slot])

    def start_agent(self, node: str, buddy: str, *, spare: bool = False) -> None:
        self.agents[node] = self.local.start_agent(
            node,
            [
                "--no-start",
                "--worker-cmd", sys.executable + " -c pass",  # the driver's --worker-cmd wins
                "--allow-remote-cmd",
                "--flash-dir", str(self.tmp / f"shm-{node}"), "--flash-job", self.job,
            ],
            buddy=buddy,
            spare=spare,
            drivers=",".join(p.address for p in self.proxies.values()),
        )  # fmt: skip

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
            self.local.spawn(
                f"reference-{rank}",
                cmd,
                launcher=[sys.executable],
                env=env,
                cwd=str(ref),
                preexec_fn=lambda: os.nice(10),
            )

    # ------------------------------------------------------------ observe
    def steps(self, path: Path | None = None) -> dict[int, list[float]]:
        """step -> every loss rank 0 logged for it (a step run twice appears twice)."""
        return read_metrics(path or self.metrics)

    def max_step(self) -> int:
        return max(self.steps(), default=0)

    def _rpc(self, slot: str, name: str, request: Any) -> Any:
        return (
            self.local.rpc(self.driver_ids[slot], name, request) if slot in self.drivers else None
        )

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
        return world_of((self.reader.read() if self.reader else None) or [])

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
        return self.local.logs(tail)

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop every process (SIGCONT, SIGTERM, SIGKILL after a grace), then etcd."""
        if self.reader is not None:
            self.reader.close()
        for proxy in self.proxies.values():
            proxy.close()
        self.loop.close()
        self.local.stop()

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
