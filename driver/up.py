"""`unbroken up` (what `make run` runs): a whole local cluster on one machine.

It starts an embedded etcd, a leader driver and a standby, N node agents plus spares on
loopback, and has the agents train the tiny gpt3d model in parallel (pp across nodes,
tp inside a node by default). A live view shows nodes, steps, losses and the event log as
it grows. The drill injects faults the system already handles end to end and measures
how fast each is detected and what the log recorded:

- the leader driver is SIGKILLed: the standby wins the election, replays the log, the
  agents follow it, and training never stops (workers do not depend on the driver);
- a training node's agent is SIGKILLed: NodeLost from missed heartbeats; the recovery
  loop (driver/loop.py) stops the workers, puts the spare in the lost node's place and
  restarts the world, which restores from flash memory, the buddy replica or storage;
- a worker is SIGKILLed: WorkerFailed; the loop restarts every worker, they restore from
  their agents' flash memory.

The drivers start the job themselves (`unbroken driver --nodes ...`; agents run
`--no-start`). The table gives per fault the time to detect it, the time until training
resumed (TrainingResumed in the log) and the steps lost (the step training had reached
minus the step it restored, both from TrainingPaused). Every process it starts is stopped
on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from unbroken.driver.etcd import EmbeddedEtcd, free_port
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

EVENT_TAIL = 10
RESUME_LIMIT_S = 120.0  # a drilled fault whose training has not resumed by then failed


@dataclass(kw_only=True, slots=True)
class UpConfig:
    """What `unbroken up` starts."""

    nodes: int = 2
    workers_per_node: int = 2
    spares: int = 1
    dp: int = 1
    pp: int = 2
    tp: int = 2
    preset: str = "tiny"
    steps: int = 2000
    duration_s: float = 90.0
    drill: bool = True
    standby: bool = True
    job_id: str = "demo"
    run_dir: str = ""
    live: bool = True
    # missed 100 ms heartbeats before NodeLost; the driver's default is 3 (see --miss-limit)
    miss_limit: int = 5

    def __post_init__(self) -> None:
        for name in ("nodes", "workers_per_node", "dp", "pp", "tp", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0, got {self.spares}")
        world = self.nodes * self.workers_per_node
        if self.dp * self.pp * self.tp != world:
            raise ValueError(
                f"dp × pp × tp = {self.dp}×{self.pp}×{self.tp} = {self.dp * self.pp * self.tp} "
                f"must equal nodes × workers_per_node = {world}; change --dp/--pp/--tp"
            )
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.run_dir:
            self.run_dir = str(Path("runs") / time.strftime("up-%Y%m%d-%H%M%S"))


@dataclass(slots=True)
class FaultRecord:
    """One drilled fault and what the log said about it."""

    fault: str
    target: str
    injected_at: float  # monotonic
    expect: str  # payload name of the event that proves detection
    injected_wall_ns: int = 0
    step_at_inject: int = 0
    detected_s: float | None = None
    event_seq: int | None = None
    note: str = ""
    given_up: bool = False
    recovers: bool = False  # the recovery loop must resume training after it
    resumed_s: float | None = None
    steps_lost: int | None = None


@dataclass(slots=True)
class Cluster:
    """The processes of one `unbroken up` run, so they can all be stopped."""

    cfg: UpConfig
    run: Path
    etcd: EmbeddedEtcd | None = None
    drivers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(self.run / f"{name}.log", "ab") as log:  # the child keeps its own fd
            return subprocess.Popen(
                [sys.executable, "-m", "unbroken.driver.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def stop(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after a grace period."""
        procs = [*self.agents.values(), *self.drivers.values()]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        for p in procs:
            _signal_group(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        if self.etcd is not None:
            self.etcd.stop(remove=False)


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken up`."""
    d = UpConfig(run_dir="x")
    parser.add_argument("--nodes", type=int, default=d.nodes, help="training nodes")
    parser.add_argument("--workers-per-node", type=int, default=d.workers_per_node)
    parser.add_argument("--spares", type=int, default=d.spares, help="spare nodes")
    parser.add_argument("--dp", type=int, default=d.dp)
    parser.add_argument("--pp", type=int, default=d.pp)
    parser.add_argument("--tp", type=int, default=d.tp)
    parser.add_argument("--preset", default=d.preset, help="model size (tiny, small, ...)")
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps")
    parser.add_argument(
        "--duration", type=float, default=d.duration_s, help="stop after this many seconds"
    )
    parser.add_argument("--no-drill", action="store_true", help="train without faults")
    parser.add_argument("--no-standby", action="store_true", help="run one driver only")
    parser.add_argument("--no-live", action="store_true", help="plain log lines, no live view")
    parser.add_argument(
        "--miss-limit",
        type=int,
        default=d.miss_limit,
        help="missed 100 ms heartbeats before a node is lost (default 5 rather than 3: on 2 cores "
        "workers importing torch can delay an agent's heartbeats)",
    )
    parser.add_argument("--run-dir", default="", help="logs and etcd data (default: runs/up-*)")


def run(ns: argparse.Namespace) -> int:
    """`unbroken up`: start, train, drill, report, stop everything."""
    try:
        cfg = UpConfig(
            nodes=ns.nodes,
            workers_per_node=ns.workers_per_node,
            spares=ns.spares,
            dp=ns.dp,
            pp=ns.pp,
            tp=ns.tp,
            preset=ns.preset,
            steps=ns.steps,
            duration_s=ns.duration,
            drill=not ns.no_drill,
            standby=not ns.no_standby,
            run_dir=ns.run_dir,
            miss_limit=ns.miss_limit,
            live=not ns.no_live and sys.stdout.isatty(),
        )
    except ValueError as e:
        print(f"unbroken up: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(cfg=cfg, run=run_dir)
    try:
        return asyncio.run(_main(cluster))
    except KeyboardInterrupt:
        print("interrupted: stopping everything")
        return 130
    finally:
        cluster.stop()
        print(f"stopped every process; logs in {run_dir}/")


async def _main(c: Cluster) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    cfg = c.cfg
    t0 = time.monotonic()
    c.etcd = EmbeddedEtcd(c.run / "etcd").start()
    console.print(f"[bold]etcd[/] up at {c.etcd.endpoint} ({time.monotonic() - t0:.1f} s)")
    names = ["driver-a", "driver-b"] if cfg.standby else ["driver-a"]
    worker_cmd = (
        f"{sys.executable} -m unbroken.trainer.run --preset {cfg.preset} --dp {cfg.dp} "
        f"--pp {cfg.pp} --tp {cfg.tp} --steps {cfg.steps} --log-every 10"
    )
    for name in names:
        port_file = c.run / f"{name}.port.json"
        c.drivers[name] = c.spawn(
            name,
            [
                "driver", "--etcd", c.etcd.endpoint, "--job-id", cfg.job_id,
                "--driver-id", name, "--listen", "127.0.0.1:0",
                "--port-file", str(port_file), "--metrics-port", "0",
                # the job: the drivers start it and recover it (agents run --no-start)
                "--nodes", str(cfg.nodes), "--workers-per-node", str(cfg.workers_per_node),
                "--dp", str(cfg.dp), "--pp", str(cfg.pp), "--tp", str(cfg.tp),
                "--worker-cmd", worker_cmd, "--master-addr", "127.0.0.1", "--trainer", "gpt3d",
                "--miss-limit", str(cfg.miss_limit),
            ],
        )  # fmt: skip
    for name in names:
        info = await _wait_json(c.run / f"{name}.port.json", c.drivers[name], 60)
        c.addresses[name] = f"127.0.0.1:{info['grpc_port']}"
        console.print(f"[bold]{name}[/] serving at {c.addresses[name]}")
    endpoints = ",".join(c.addresses.values())
    names_of = [f"node-{i}" for i in range(cfg.nodes)] + [f"spare-{i}" for i in range(cfg.spares)]
    replica = {n: free_port() for n in names_of}
    for i, node in enumerate(names_of):
        # the buddy ring over the training nodes; a spare's buddy is node-0
        buddy = names_of[(i + 1) % cfg.nodes] if i < cfg.nodes else names_of[0]
        args = [
            "agent", "--driver", endpoints, "--node-id", node, "--no-start",
            "--worker-cmd", worker_cmd, "--nproc-per-node", str(cfg.workers_per_node),
            "--log-dir", str(c.run / "workers" / node), "--socket", str(c.run / f"{node}.sock"),
            # this run's own flash job: never restore another run's copies
            "--flash-job", c.run.resolve().name, "--persist-url", str(c.run / "storage"),
            "--replica-listen", f"127.0.0.1:{replica[node]}",
        ]  # fmt: skip
        if buddy != node:
            args += ["--buddy", f"127.0.0.1:{replica[buddy]}"]
        if i >= cfg.nodes:
            args.append("--spare")
        c.agents[node] = c.spawn(f"agent-{node}", args)
    console.print(
        f"{cfg.nodes} nodes × {cfg.workers_per_node} workers (dp{cfg.dp}×pp{cfg.pp}×tp{cfg.tp}) "
        f"+ {cfg.spares} spare(s); training the {cfg.preset} model for {cfg.steps} steps"
    )
    watcher = Watcher(c)
    await watcher.open()
    try:
        return await _supervise(c, watcher, console, t0)
    finally:
        await watcher.close()


async def _wait_json(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{path.stem} exited with code {proc.returncode}; see its log")
        await asyncio.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {path}")


class Watcher:
    """Reads the live view from whichever driver leads, and the event log from etcd."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.events: list[ev.Event] = []
        self.nodes: list[dpb.NodeLive] = []
        self.leader = ""
        self._client: Any = None
        self._log: Any = None

    async def open(self) -> None:
        from unbroken.driver import etcdlog

        assert self.c.etcd is not None
        self._client = await etcdlog.connect(self.c.etcd.config)
        self._log = etcdlog.EtcdEventLog(self._client, self.c.cfg.job_id, None)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def poll(self) -> list[ev.Event]:
        """Refresh the live view; return the events appended since the last poll."""
        nxt = self.events[-1].seq + 1 if self.events else 1
        try:
            new = await asyncio.wait_for(self._log.read(nxt), 5)
        except (TimeoutError, Exception):  # a read that fails now is retried next poll
            new = []
        self.events.extend(new)
        for name, addr in self.c.addresses.items():
            proc = self.c.drivers.get(name)
            if proc is None or proc.poll() is not None:
                continue
            try:
                async with grpc.aio.insecure_channel(addr) as ch:
                    resp = await dgrpc.DriverStub(ch).LiveView(dpb.LiveViewRequest(), timeout=2)
            except grpc.RpcError:
                continue
            if resp.leader:
                self.leader = name
                self.nodes = list(resp.nodes)
                break
        return list(new)

    def step(self) -> int:
        steps = [w.step for n in self.nodes if n.alive for w in n.workers]
        return max(steps) if steps else 0

    def loss(self) -> float | None:
        losses = [w.loss for n in self.nodes for w in n.workers if w.has_loss and w.step > 0]
        return losses[-1] if losses else None


def _render(watcher: Watcher, cfg: UpConfig, faults: list[FaultRecord], elapsed: float) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    nodes = Table(title=f"nodes (leader: {watcher.leader or '?'}, {elapsed:.0f} s)")
    for col in ("node", "alive", "silent ms", "workers: step / loss"):
        nodes.add_column(col)
    for n in watcher.nodes:
        ws = ", ".join(
            f"r{w.global_rank}:{w.step}/{w.loss:.3f}" if w.has_loss else f"r{w.global_rank}:-"
            for w in n.workers
        )
        nodes.add_row(
            n.node_id, "yes" if n.alive else "[red]LOST[/]", f"{n.silent_ms:.0f}", ws or "-"
        )
    events = Table(title="event log (etcd)")
    for col in ("seq", "event", "detail"):
        events.add_column(col)
    for e in watcher.events[-EVENT_TAIL:]:
        events.add_row(str(e.seq), e.WhichOneof("payload") or "?", escape(_detail(e)[:90]))
    parts: list[Any] = [nodes, events]
    if faults:
        parts.append(_fault_table(faults))
    return Group(*parts)


def _detail(e: ev.Event) -> str:
    kind = e.WhichOneof("payload")
    return " ".join(str(getattr(e, kind)).split()) if kind else ""


def _fault_table(faults: list[FaultRecord]) -> Any:
    from rich.table import Table

    t = Table(title="drill")
    for col in (
        "fault",
        "target",
        "detected in",
        "resumed in",
        "steps lost",
        "event (seq)",
        "note",
    ):
        t.add_column(col)
    for f in faults:
        det = f"{f.detected_s:.2f} s" if f.detected_s is not None else "[red]not yet[/]"
        res = "-"
        if f.recovers:
            res = f"{f.resumed_s:.2f} s" if f.resumed_s is not None else "[red]not yet[/]"
        lost = str(f.steps_lost) if f.steps_lost is not None else "-"
        t.add_row(f.fault, f.target, det, res, lost, f"{f.expect} ({f.event_seq or '-'})", f.note)
    return t


async def _supervise(c: Cluster, w: Watcher, console: Any, t0: float) -> int:
    from rich.live import Live

    cfg = c.cfg
    faults: list[FaultRecord] = []
    drill = _Drill(c, w, faults) if cfg.drill else None
    first_step_at: float | None = None
    done_at: float | None = None
    live_ctx: Any = (
        Live(console=console, refresh_per_second=4) if cfg.live else contextlib.nullcontext()
    )
    with live_ctx as live:
        while True:
            new = await w.poll()
            now = time.monotonic()
            if drill is not None:
                drill.observe(new, now)
            if not cfg.live:
                for e in new:
                    kind = e.WhichOneof("payload")
                    console.print(
                        f"event {e.seq}: {kind} {_detail(e)}", markup=False, highlight=False
                    )
            if first_step_at is None and w.step() > 0:
                first_step_at = now
                console.print(f"first training step after {now - t0:.1f} s")
            if drill is not None and first_step_at is not None:
                await drill.advance(now)
            if live is not None:
                live.update(_render(w, cfg, faults, now - t0))
            # with a drill, the run lasts until the drill is over (or the duration ends)
            finished = drill.done if drill is not None else w.step() >= cfg.steps
            if finished and done_at is None:
                done_at = now
            if now - t0 > cfg.duration_s or (done_at is not None and now - done_at > 3):
                break
            await asyncio.sleep(0.25)
    console.print(_fault_table(faults) if faults else "no drill")
    counts: dict[str, int] = {}
    for e in w.events:
        k = e.WhichOneof("payload") or "?"
        counts[k] = counts.get(k, 0) + 1
    console.print(
        f"trained to step {w.step()}, last loss {w.loss()}; {len(w.events)} events in etcd: "
        + ", ".join(f"{k}×{v}" for k, v in sorted(counts.items()))
    )
    console.print(
        f"look at the log: .venv/bin/etcdctl --endpoints {c.etcd.endpoint if c.etcd else '?'} "
        f"get --prefix /unbroken/{cfg.job_id}/ --keys-only"
    )
    missed = [f for f in faults if f.detected_s is None or (f.recovers and f.resumed_s is None)]
    if drill is not None and (drill.plan or missed):
        console.print(
            f"[red]drill incomplete[/]: {len(missed)} fault(s) not detected or not recovered, "
            f"{len(drill.plan)} not injected before --duration {cfg.duration_s:.0f} s ran out"
        )
        return 1
    return 0


class _Drill:
    """Injects one fault at a time once training runs, and waits for its event."""

    def __init__(self, c: Cluster, w: Watcher, faults: list[FaultRecord]) -> None:
        self.c, self.w, self.faults = c, w, faults
        self.plan = ["driver_kill", "node_loss", "worker_crash"]
        self.next_at = 0.0
        self.done = False

    def observe(self, new: list[ev.Event], now: float) -> None:
        for f in self.faults:
            for e in new:
                if f.detected_s is None:
                    if e.WhichOneof("payload") == f.expect and _matches(e, f):
                        # the event's own wall time: exact, not bounded by our polling
                        f.detected_s = max(0.0, (e.wall_time_unix_ns - f.injected_wall_ns) / 1e9)
                        f.event_seq = e.seq
                        if not f.recovers:
                            self.next_at = now + 5.0
                    continue
                if not f.recovers or f.resumed_s is not None or e.seq <= (f.event_seq or 0):
                    continue
                if e.HasField("training_paused"):  # the last pause of the incident counts
                    p = e.training_paused
                    f.steps_lost = max(0, p.at_step - p.restore_step)
                elif e.HasField("training_resumed"):
                    f.resumed_s = max(0.0, (e.wall_time_unix_ns - f.injected_wall_ns) / 1e9)
                    self.next_at = now + 5.0

    async def advance(self, now: float) -> None:
        pending = [f for f in self.faults if f.detected_s is None and not f.given_up]
        if pending:
            if now - pending[0].injected_at > 30:
                pending[0].note = "no event within 30 s"
                pending[0].given_up = True
                self.next_at = now + 1
            return
        waiting = [f for f in self.faults if f.recovers and f.resumed_s is None and not f.given_up]
        if waiting:
            if now - waiting[0].injected_at > RESUME_LIMIT_S:
                waiting[0].note = f"training did not resume within {RESUME_LIMIT_S:.0f} s"
                waiting[0].given_up = True
                self.next_at = now + 1
            return
        if now < self.next_at or self.w.step() < 10:
            return
        if not self.plan:
            self.done = True
            return
        if self.faults and self.faults[-1].fault == "driver SIGKILL":
            last = self.faults[-1]
            last.note += f" (step {last.step_at_inject} → {self.w.step()})"
        kind = self.plan.pop(0)
        wall = time.time_ns()
        if kind == "driver_kill":
            leader = self.w.leader
            if len(self.c.drivers) < 2 or not leader:
                return
            os.kill(self.c.drivers[leader].pid, signal.SIGKILL)
            other = next(n for n in self.c.drivers if n != leader)
            self.faults.append(
                FaultRecord(
                    fault="driver SIGKILL",
                    target=leader,
                    injected_at=now,
                    expect="leader_elected",
                    note=f"standby {other} took over; training went on",
                    injected_wall_ns=wall,
                    step_at_inject=self.w.step(),
                )
            )
        elif kind == "node_loss":
            spares = [n for n in self.c.agents if n.startswith("spare-")]
            working = [n.node_id for n in self.w.nodes if n.alive and n.workers]
            gone = next((n for n in reversed(working) if n in self.c.agents), None)
            if gone is None:
                return
            _signal_group(self.c.agents[gone], signal.SIGKILL)
            self.faults.append(
                FaultRecord(
                    fault="node lost (agent SIGKILL)",
                    target=gone,
                    injected_at=now,
                    expect="node_lost",
                    note="a spare takes its place" if spares else "no spare: the job shrinks",
                    injected_wall_ns=wall,
                    step_at_inject=self.w.step(),
                    recovers=True,
                )
            )
        elif kind == "worker_crash":
            running = [(n.node_id, wk.pid) for n in self.w.nodes if n.alive for wk in n.workers]
            victim = next(((node, pid) for node, pid in running if pid), None)
            if victim is None:
                return
            os.kill(victim[1], signal.SIGKILL)
            self.faults.append(
                FaultRecord(
                    fault="worker SIGKILL",
                    target=f"{victim[0]} pid {victim[1]}",
                    injected_at=now,
                    expect="worker_failed",
                    note="every worker restarts and restores from flash memory",
                    injected_wall_ns=wall,
                    step_at_inject=self.w.step(),
                    recovers=True,
                )
            )


def _matches(e: ev.Event, f: FaultRecord) -> bool:
    kind = e.WhichOneof("payload")
    if kind == "leader_elected":
        return e.leader_elected.driver_id != f.target
    if kind == "node_lost":
        return e.node_lost.node_id == f.target
    if kind == "worker_failed":
        return f.target.startswith(e.worker_failed.node_id + " ")
    return False
