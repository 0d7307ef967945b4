"""Faults against a `LocalCluster`, and the one table of which event proves each fault.

`PROOF` maps a fault kind to the event that shows the system detected it (`proves(e, kind,
node)` tests one event); `unbroken up`'s drill, bench/recovery.py and the tests measure
detection with it. `Faults` injects them, chainable and seeded (torchft's `EventInjector`):

    Faults(cluster, seed=7, watch=w).worker_kill("n0").then.driver_kill(when="training_paused")

Each call injects at once and records an `Injection` (what, where, the wall time, the log's
head); `.then` first waits until the previous injection is proven by its event; `when=`
waits for that event after the previous injection before striking (a leader killed in the
middle of a recovery). A target left out is drawn from the seeded RNG among the candidates
(world nodes with a running agent, sorted by id), so a seed names the run.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from unbroken.cli.cluster import LocalCluster, LogWatch
from unbroken.driver.etcd import EmbeddedEtcd
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

PROVE_TIMEOUT_S = 120.0
# how long an injection through the driver waits for a leader that takes it (a failover
# takes ~2 s, then the agents reconnect)
INJECT_WAIT_S = 20.0


@dataclass(frozen=True, slots=True)
class Proof:
    """The event that proves a fault was detected."""

    event: str  # its payload name
    same_node: bool = False  # its node_id must be the fault's node
    failed_check: bool = False  # a self-check report that failed


#: fault kind -> the event proving it; None: no event does (it is ridden out, or only its
#: consequences show: etcd down, a short stop or network cut).
PROOF: dict[str, Proof | None] = {
    "worker_kill": Proof("worker_failed", same_node=True),
    "worker_stop": Proof("hang_suspected", same_node=True),  # a hung worker
    "agent_kill": Proof("node_lost", same_node=True),  # a lost node
    "driver_kill": Proof("leader_elected"),  # a new term, whoever won it
    "loss_spike": Proof("loss_spike"),
    "bad_matmul": Proof("self_check_reported", same_node=True, failed_check=True),
    "straggler": Proof("straggler_suspected", same_node=True),
    "agent_stop": None,
    "etcd_kill": None,
    "net_cut": None,
}
#: the names `unbroken up --faults`, bench/recovery.py and the chaos plans use for them
ALIASES = {
    "worker_crash": "worker_kill",
    "hang": "worker_stop",
    "node_loss": "agent_kill",
    "bad_node": "bad_matmul",
    "silently_bad_node": "bad_matmul",
    "driver_kill_mid_recovery": "driver_kill",
    "driver_kill_recovery": "driver_kill",
}


def proof(kind: str) -> Proof | None:
    """The event that proves a fault of `kind` (an alias or a PROOF key)."""
    return PROOF[ALIASES.get(kind, kind)]


def proves(e: ev.Event, kind: str, node: str = "") -> bool:
    """Whether `e` proves the detection of a fault of `kind` on `node`."""
    p = proof(kind)
    payload = e.WhichOneof("payload")
    if p is None or payload != p.event:
        return False
    body = getattr(e, payload)
    if p.same_node and body.node_id != node:
        return False
    return not (p.failed_check and body.ok)


@dataclass(slots=True)
class Injection:
    """One injected fault."""

    kind: str
    target: str  # what was hit, for a person ("n0 pid 123", a driver's name)
    node: str = ""  # the node it proves on ("" when any event of its kind proves it)
    wall_ns: int = 0
    mono: float = 0.0
    seq: int = 0  # the log's newest event when it was injected
    note: str = ""

    def proven_by(self, e: ev.Event) -> bool:
        return e.seq > self.seq and proves(e, self.kind, self.node)


class Faults:
    """Injects faults into a cluster, one call each; chainable; targets drawn by `seed`.

    Args:
        cluster: the cluster to hurt.
        seed: seeds the choice of targets left out.
        watch: the log watch (`.then`, `when=` and target choice read it); default a new one.
        timeout_s: how long `.then` and `when=` wait.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        seed: int = 0,
        *,
        watch: LogWatch | None = None,
        timeout_s: float = PROVE_TIMEOUT_S,
    ) -> None:
        self.c = cluster
        self.rng = random.Random(seed)
        self._own_watch = watch is None
        self.w = watch if watch is not None else LogWatch(cluster)
        self.timeout_s = timeout_s
        self.injections: list[Injection] = []
        self._background: list[threading.Thread] = []

    # ------------------------------------------------------------ chaining
    @property
    def then(self) -> Faults:
        """Wait until the previous injection is proven (if an event proves it)."""
        if self.injections and proof(self.injections[-1].kind) is not None:
            self.wait_proven(self.injections[-1])
        return self

    def wait_proven(self, inj: Injection, timeout_s: float | None = None) -> ev.Event:
        """The event proving `inj` (waiting for it)."""
        return self.w.wait_event(inj.proven_by, timeout_s or self.timeout_s, since_seq=inj.seq)

    def _when(self, when: str | None) -> None:
        if when is not None:
            since = self.injections[-1].seq if self.injections else self.w.seq
            self.w.wait_event(when, self.timeout_s, since_seq=since)

    def _record(self, kind: str, target: str, node: str = "", note: str = "") -> Injection:
        inj = Injection(kind, target, node, time.time_ns(), time.monotonic(), self.w.seq, note=note)
        self.injections.append(inj)
        return inj

    # ------------------------------------------------------------ targets
    def world_node(self) -> str:
        """A world node with a running agent, drawn by the seed."""
        if not self.w.events:
            self.w.poll()
        world = sorted(n for n in self.w.world() if self.c.alive(n))
        if not world:
            raise AssertionError("no world node with a running agent to hurt")
        return world[int(self.rng.random() * len(world))]

    def worker_pid(self, node: str, timeout_s: float = 60.0) -> int:
        """A running worker's pid of `node` (from the leader's live view)."""

        def pid() -> int:
            for n in self.w.nodes:
                if n.node_id == node:
                    for wk in n.workers:
                        if wk.pid and wk.state == dpb.WORKER_STATE_RUNNING:
                            return int(wk.pid)
            return 0

        return self.w.until(pid, timeout_s, f"a running worker on {node}")

    # ------------------------------------------------------------ process faults
    def worker_kill(
        self, node: str | None = None, *, pid: int | None = None, when: str | None = None
    ) -> Faults:
        """SIGKILL a worker of `node`: WorkerFailed."""
        return self._signal_worker("worker_kill", signal.SIGKILL, node, pid, when)

    def worker_stop(
        self, node: str | None = None, *, pid: int | None = None, when: str | None = None
    ) -> Faults:
        """SIGSTOP a worker of `node` (a hang): HangSuspected."""
        return self._signal_worker("worker_stop", signal.SIGSTOP, node, pid, when)

    def _signal_worker(
        self, kind: str, sig: int, node: str | None, pid: int | None, when: str | None
    ) -> Faults:
        self._when(when)
        node = node or self.world_node()
        pid = pid or self.worker_pid(node)
        _kill(pid, sig)
        self._record(kind, f"{node} pid {pid}", node)
        return self

    def agent_kill(self, node: str | None = None, *, when: str | None = None) -> Faults:
        """SIGKILL the agent of `node` (its workers die with it): NodeLost."""
        self._when(when)
        node = node or self.world_node()
        self.c.kill(node)
        self._record("agent_kill", node, node)
        return self

    def agent_stop(self, node: str | None = None, *, duration_s: float = 1.0) -> Faults:
        """SIGSTOP the agent of `node` for `duration_s`, then SIGCONT (blocks meanwhile)."""
        node = node or self.world_node()
        self._record("agent_stop", node, node, note=f"{duration_s:g} s")
        pid = self.c.procs[node].pid
        _kill(pid, signal.SIGSTOP)
        try:
            time.sleep(duration_s)
        finally:
            _kill(pid, signal.SIGCONT)
        return self

    def driver_kill(
        self, name: str | None = None, *, when: str | None = None, respawn: bool = True
    ) -> Faults:
        """SIGKILL a driver (default the leader): LeaderElected. `respawn`: once another
        leads, it comes back as the standby on its old address."""
        self._when(when)
        name = name or self.w.find_leader()
        self.c.kill(name)
        self._record("driver_kill", name)
        if respawn:
            others = [n for n in self.c.names("driver") if n != name]
            if others:
                self.w.until(
                    lambda: (v := self.w.leader_view()) is not None and v[0] != name,
                    self.timeout_s,
                    f"a leader other than {name}",
                )
            self.c.respawn(name)
        return self

    def etcd_kill(self, *, duration_s: float = 1.0) -> Faults:
        """SIGKILL etcd and restart it on the same ports and data after `duration_s`."""
        etcd = self.c.etcd
        if not isinstance(etcd, EmbeddedEtcd):
            raise ValueError("etcd_kill needs the cluster's own single-member etcd")
        self._record("etcd_kill", etcd.endpoint, note=f"{duration_s:g} s")
        etcd.kill()
        time.sleep(duration_s)
        etcd.restart()
        return self

    # ------------------------------------------------------------ through the driver
    def _inject(self, node: str, req: dpb.InjectFaultRequest, wait_s: float = INJECT_WAIT_S) -> str:
        """Ask the leader to inject `req`; "" when done, else what went wrong. A call the
        leader does not take (it was just killed, or it leads since a moment and `node`'s
        agent has not reconnected to it) is tried again, on the leader found anew, for up
        to `wait_s`."""
        deadline = time.monotonic() + wait_s
        while (resp := self.w.rpc("InjectFault", req, timeout_s=30.0)) is None:
            if time.monotonic() >= deadline:
                return f"InjectFault failed on {node}"
            time.sleep(0.5)
            self.w.find_leader()
        return "" if resp.ok else f"InjectFault on {node}: {resp.detail}"

    def loss_spike(self, *, step: int | None = None, ahead: int = 2) -> Faults:
        """Poison one step's batch on every working node (`step`, or `ahead` of the
        newest): LossSpike.

        Every node of the world must poison the same, future step (each poisons its own
        part of the batch: half a spike on one node is under the detector's bar). So this
        first waits, up to INJECT_WAIT_S, until the leader, asked anew, hears every world
        node's workers: after a failover the new leader's view has only the agents that
        reconnected (2-3 s here), and a spike injected then reached one node of two. The
        step is then read from that view, not from one polled before the wait."""
        deadline = time.monotonic() + INJECT_WAIT_S
        while True:
            self.w.find_leader()
            world = set(self.w.world())
            nodes = [n.node_id for n in self.w.working() if not world or n.node_id in world]
            if (nodes and world <= set(nodes)) or time.monotonic() >= deadline:
                break
            time.sleep(0.3)
        at = step if step is not None else self.w.step() + ahead
        notes = [
            self._inject(n, dpb.InjectFaultRequest(node_id=n, kind="loss-spike", step=at), 0)
            for n in nodes
        ]
        self._record("loss_spike", ",".join(nodes), note="; ".join(x for x in notes if x))
        return self

    def bad_matmul(
        self, node: str | None = None, *, selfcheck: bool = True, check_timeout_s: float = 120.0
    ) -> Faults:
        """Make `node`'s matmul silently wrong, then (in the background) run its self-check:
        a failed SelfCheckReported."""
        node = node or self.world_node()
        if not self.w.leader:
            self.w.find_leader()
        note = self._inject(node, dpb.InjectFaultRequest(node_id=node, kind="wrong-matmul"))
        inj = self._record("bad_matmul", node, node, note=note)
        if selfcheck and not note:
            leader = self.w.leader

            def check() -> None:
                req = dpb.RunSelfCheckRequest(node_ids=[node])
                if self.c.rpc(leader, "RunSelfCheck", req, check_timeout_s) is None:
                    inj.note = "no self-check"

            t = threading.Thread(target=check, daemon=True, name=f"selfcheck-{node}")
            t.start()
            self._background.append(t)
        return self

    def straggler(self, node: str | None = None, *, factor: float = 1.2) -> Faults:
        """Make `node` compute `factor` times slower: StragglerSuspected."""
        node = node or self.world_node()
        if not self.w.leader:
            self.w.find_leader()
        req = dpb.InjectFaultRequest(node_id=node, kind="slow-train", factor=factor)
        self._record("straggler", node, node, note=self._inject(node, req))
        return self

    def close(self) -> None:
        """Close the log watch this injector opened (a watch it was given stays open)."""
        if self._own_watch:
            self.w.close()

    # ------------------------------------------------------------ results
    def proven(self, inj: Injection) -> ev.Event | None:
        """The event proving `inj` among those read so far."""
        return next((e for e in self.w.events if inj.proven_by(e)), None)

    def detect_s(self, inj: Injection) -> float | None:
        """Seconds from the injection to its proving event's own wall time."""
        e = self.proven(inj)
        return None if e is None else max(0.0, (e.wall_time_unix_ns - inj.wall_ns) / 1e9)

    def summary(self) -> list[dict[str, Any]]:
        return [
            {"kind": i.kind, "target": i.target, "detect_s": self.detect_s(i), "note": i.note}
            for i in self.injections
        ]


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
