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
  their agents' flash memory;
- a worker is SIGSTOPped (a hang): HangSuspected once no rank progresses for
  max(`--hang-floor` seconds, 5 x its p90 step time), judged by each agent; the loop
  stops (kills) and restarts the world;
- a loss spike: `InjectFault loss-spike` makes every agent write its workers' fault file,
  one step's batch targets are poisoned; the driver's loss watch appends LossSpike, the
  machine rolls back to the newest step before it that every rank holds in its ring
  (else the newest committed one) and skips the batches;
- a straggler: `InjectFault slow-train --factor 1.2` on a world node; the driver's
  straggler sweep appends StragglerSuspected, the node is evicted and a spare takes its
  ranks;
- a silently bad node: `InjectFault wrong-matmul` then `RunSelfCheck` on that node; the
  failed self-check (SelfCheckReported) is a fault the loop handles (skipped gracefully
  when the driver has no InjectFault/RunSelfCheck);
- the leader driver is SIGKILLed in the middle of a recovery (a worker is SIGKILLed, and
  the leader right after the incident's TrainingPaused): the standby finishes the recovery.

The node lost in the drill comes back (its agent restarts, an idle node the world can take),
and the driver killed first comes back as the standby on its old address.

The drivers start the job themselves (`unbroken driver --nodes ...`; agents run
`--no-start`). The table gives per fault the time to detect it, the time until training
resumed (TrainingResumed in the log), the steps lost (the step training had reached, from
TrainingPaused, minus the step rank 0 actually restored, from its worker log), whether the
loss curve continued (the loss 3 steps after the resume within 0.5-1.5x the loss before the
fault) and the events written from the injection to the resume. Every process it starts is
stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.cli import events
from unbroken.cli.cluster import LocalCluster, LogWatch
from unbroken.cli.drill import (
    DRILL,
    OVERLOAD_PER_CORE,
    Drill,
    FaultRecord,
    fault_table,
    judge_load,
)
from unbroken.common import reaper
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

EVENT_TAIL = 10
SPARE_WARM_AFTER_S = 25  # a spare's standbys start this long after its agent (below)


@dataclass(kw_only=True, slots=True)
class UpConfig:
    """What `unbroken up` starts."""

    nodes: int = 2
    workers_per_node: int = 2
    spares: int = 2  # the drill takes two nodes out of the world (node loss, hang or bad node)
    dp: int = 1
    pp: int = 2
    tp: int = 2
    preset: str = "tiny"
    steps: int = 2000
    duration_s: float = 480.0  # an upper bound: the run ends once the drill is over
    drill: bool = True
    standby: bool = True
    job_id: str = "demo"
    run_dir: str = ""
    live: bool = True
    # missed 100 ms heartbeats before NodeLost; the driver's default is 3 (see --miss-limit)
    miss_limit: int = 5
    hang_floor_s: float = 1.0  # the agents' hang floor (agent/hang.py; their default too)
    faults: tuple[str, ...] = DRILL  # the drill's faults, in order
    dashboard_port: int = 0  # the leader's web dashboard (the standby's: +1); 0: free ports
    etcd_members: int = 1  # 3 or 5: a real etcd cluster, to drill a member's loss
    until_step: int = 0  # with a drill: train on after it until this step (0: stop then)
    # each agent keeps warm standby workers (imported ahead), so a replaced rank is not a
    # fresh interpreter importing torch and the trainer (1.7 s of a 3 s worker crash on 2
    # cores). False leaves it to the agents' own default (off below 4 cores per worker)
    warm_workers: bool = True

    def __post_init__(self) -> None:
        for name in ("nodes", "workers_per_node", "dp", "pp", "tp", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.until_step <= self.steps:
            raise ValueError(
                f"--until-step must be in [0, --steps {self.steps}], got {self.until_step}"
            )
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0, got {self.spares}")
        if not 1 <= self.etcd_members <= 7:
            raise ValueError(f"etcd_members must be in [1, 7], got {self.etcd_members}")
        world = self.nodes * self.workers_per_node
        if self.dp * self.pp * self.tp != world:
            raise ValueError(
                f"dp × pp × tp = {self.dp}×{self.pp}×{self.tp} = {self.dp * self.pp * self.tp} "
                f"must equal nodes × workers_per_node = {world}; change --dp/--pp/--tp"
            )
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.hang_floor_s >= 0.01:
            raise ValueError(f"hang_floor_s must be >= 0.01, got {self.hang_floor_s}")
        unknown = [f for f in self.faults if f not in DRILL]
        if unknown or not self.faults:
            raise ValueError(
                f"faults {unknown or '(none)'} unknown; choose from {', '.join(DRILL)} "
                "(or --no-drill)"
            )
        if not 0 <= self.dashboard_port <= 65534:
            raise ValueError(f"dashboard_port must be in [0, 65534], got {self.dashboard_port}")
        if not self.run_dir:
            self.run_dir = str(Path("runs") / time.strftime("up-%Y%m%d-%H%M%S"))


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
    parser.add_argument(
        "--hang-floor",
        type=float,
        default=d.hang_floor_s,
        help="the agents' hang floor: a rank is hung after no progress for max(this, 5 x its "
        "p90 step time) (default 1)",
    )
    parser.add_argument(
        "--faults",
        default=",".join(d.faults),
        help=f"the drill's faults, comma-separated, in order (default: {','.join(d.faults)})",
    )
    parser.add_argument(
        "--dashboard-port", type=int, default=0, help="web dashboard port (default 0: a free one)"
    )
    parser.add_argument("--run-dir", default="", help="logs and etcd data (default: runs/up-*)")
    parser.add_argument(
        "--warm-workers",
        action=argparse.BooleanOptionalAction,
        default=d.warm_workers,
        help="agents keep warm standby workers (imported ahead) for faster replacements "
        "(default: on; --no-warm-workers leaves it to the agents' own default, off below 4 "
        "cores per worker)",
    )
    parser.add_argument(
        "--etcd-members",
        type=int,
        default=d.etcd_members,
        help="embedded etcd cluster size (3 or 5 to drill the loss of a member; default 1)",
    )
    parser.add_argument(
        "--until-step",
        type=int,
        default=d.until_step,
        help="with a drill, train on after it until this step (a longer job's commit rate "
        "per 1,000 steps; raise --duration to match); default 0: stop when the drill is over",
    )


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
            hang_floor_s=ns.hang_floor,
            faults=tuple(f.strip() for f in ns.faults.split(",") if f.strip()),
            dashboard_port=ns.dashboard_port,
            etcd_members=ns.etcd_members,
            until_step=ns.until_step,
            warm_workers=ns.warm_workers,
            live=not ns.no_live and sys.stdout.isatty(),
        )
    except ValueError as e:
        print(f"unbroken up: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    cluster = LocalCluster(run_dir, job=cfg.job_id, etcd_members=cfg.etcd_members)
    # SIGTERM (timeout, systemd, CI) and SIGHUP (a closed terminal, a dropped SSH session)
    # stop the cluster like Ctrl-C does; their default action killed `up` alone and left
    # etcd, the drivers, the agents and their trainers running as orphans
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        return asyncio.run(_main(cluster, cfg))
    except KeyboardInterrupt:
        print("interrupted: stopping everything")
        return 130
    finally:
        cluster.stop()
        print(f"stopped every process; logs in {run_dir}/")


def _interrupt(signum: int, _frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)  # one stop; a second signal must not cut it short
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _start_agents(
    c: LocalCluster, cfg: UpConfig, names_of: list[str], worker_cmd: str, key_file: Path
) -> None:
    """Every node's agent: the training nodes, then the spares."""
    for i, node in enumerate(names_of):
        # the buddy ring over the training nodes; a spare's buddy is node-0
        warm_after = SPARE_WARM_AFTER_S if i >= cfg.nodes else 12
        c.start_agent(
            node,
            [
                "--no-start", "--worker-cmd", worker_cmd,
                "--nproc-per-node", str(cfg.workers_per_node),
                # this run's own flash job: never restore another run's copies
                "--flash-job", c.run.resolve().name,
                "--replica-key-file", str(key_file),
                "--hang-floor-ms", str(cfg.hang_floor_s * 1000.0),
                "--token-file", str(c.node_token_file(node)),
                # else the agent's default. A training node's standbys start once its workers
                # step; those of an agent waiting for its workers (a node back from a loss)
                # 12 s after it starts: at once they put the first step at 19-21 s, not
                # 12-13 (2 cores; each agent is its own session, so its autogroup's share,
                # and a standby's niceness, buys no idle-only CPU). A spare's, there from
                # the start, 25 s after: at 12 s they came during the first step (14.5 s
                # after the start, the first step at 19.5 s); the drill waits for them
                # before the faults that need them (cli/drill.py `WARM_SPARE_LIMIT_S`)
                *(["--warm-workers", "--warm-after-s", str(warm_after)]
                  if cfg.warm_workers else []),
                # a spare's registration self-check likewise: at once, in an autogroup of
                # its own, it took half the cores from the workers' imports
                *(["--selfcheck-after-s", str(SPARE_WARM_AFTER_S)] if i >= cfg.nodes else []),
            ],
            buddy=names_of[(i + 1) % cfg.nodes] if i < cfg.nodes else names_of[0],
            spare=i >= cfg.nodes,
        )  # fmt: skip


async def _main(c: LocalCluster, cfg: UpConfig) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    t0 = time.monotonic()
    reaper.start()  # everything below dies with `up`, even when `up` is SIGKILLed
    c.start()
    console.print(f"[bold]etcd[/] up at {c.endpoint} ({time.monotonic() - t0:.1f} s)")
    names = ["driver-a", "driver-b"] if cfg.standby else ["driver-a"]
    names_of = [f"node-{i}" for i in range(cfg.nodes)] + [f"spare-{i}" for i in range(cfg.spares)]
    # role tokens, as a secured deployment runs; each node's token is bound to its node id
    token_flags = c.make_tokens(names_of)
    worker_cmd = (
        f"{sys.executable} -m unbroken.trainer.run --preset {cfg.preset} --dp {cfg.dp} "
        f"--pp {cfg.pp} --tp {cfg.tp} --steps {cfg.steps} --log-every 10"
    )
    for name in names:
        c.start_driver(
            name,
            [
                "--metrics-port", "0",
                "--allow-fault-injection",  # the drill injects its faults through the driver
                "--persist-root", str(c.run / "storage"), *token_flags,
                "--archive-url", str(c.run / "archive"),  # one archive both drivers share
                # the job: the drivers start it and recover it (agents run --no-start)
                "--nodes", str(cfg.nodes), "--workers-per-node", str(cfg.workers_per_node),
                "--dp", str(cfg.dp), "--pp", str(cfg.pp), "--tp", str(cfg.tp),
                "--worker-cmd", worker_cmd, "--master-addr", "127.0.0.1", "--trainer", "gpt3d",
                "--miss-limit", str(cfg.miss_limit),
                "--dashboard-port",
                str(cfg.dashboard_port + names.index(name) if cfg.dashboard_port else 0),
            ],
            wait_s=None,  # both start at once
        )  # fmt: skip
    for name in names:
        info = c.wait_driver(name, 60)
        console.print(f"[bold]{name}[/] serving at {c.addresses[name]}")
        if info.get("dashboard_port"):
            url = f"http://127.0.0.1:{info['dashboard_port']}/?token={c.tokens['viewer']}"
            console.print(f"  dashboard: {url}")
    # the job's replica key: the buddy stream is HMAC-authenticated (no TLS in a local demo)
    key_file = c.run / "replica.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    _start_agents(c, cfg, names_of, worker_cmd, key_file)
    console.print(
        f"{cfg.nodes} nodes × {cfg.workers_per_node} workers (dp{cfg.dp}×pp{cfg.pp}×tp{cfg.tp}) "
        f"+ {cfg.spares} spare(s); training the {cfg.preset} model for {cfg.steps} steps"
    )
    with LogWatch(c, archive_url=str(c.run / "archive")) as watch:
        return await _supervise(c, cfg, watch, console, t0)


def trained_step(live_step: int, events: Iterable[ev.Event]) -> int:
    """The newest step trained: the live view's, or the job's end when the workers exited
    before the live view polled their last report (a clean-clone CI run printed "trained
    to step 29" for a job that finished at step 30)."""
    ended = (e.job_finished.step for e in events if e.HasField("job_finished"))
    return max(live_step, *ended, 0)


def commits_line(events: list[ev.Event], steps: int) -> str:
    """How many checkpoints were committed per 1,000 steps, and why: the job's first save
    (persisted so storage is proven one step in: committed before any incident) and the
    saves on the persistence interval (the rest stayed in the rings and buddies)."""
    commits = first = 0
    incident = False
    for e in events:
        kind = e.WhichOneof("payload")
        if kind == "training_paused":
            incident = True
        elif kind == "checkpoint_committed":
            commits += 1
            first += commits == 1 and not incident
    interval = commits - first
    why = "the job's first save and " if first else ""
    return (
        f"checkpoints committed: {commits} in {steps} steps ({1000.0 * commits / steps:.1f} "
        f"per 1,000): {why}{interval} on the persistence interval "
        f"({1000.0 * interval / steps:.1f} per 1,000); the other saves stayed in the flash "
        "rings and buddy replicas"
    )


def _render(
    watcher: LogWatch,
    faults: list[FaultRecord],
    elapsed: float,
    width: int = 80,
    height: int = 24,
) -> Any:
    """The live view: nodes, the newest events (short lines), the drill's table; sized to
    the terminal so nothing is cut off at 80x24."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

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
    # what fits the terminal: the nodes, the fault table, then as many events as rows remain
    fault_rows = len(faults) + 4 if faults else 0  # one line per fault (rows=True)
    spare = height - (len(watcher.nodes) + 4) - fault_rows - 2
    tail = max(2, min(EVENT_TAIL, spare))
    lines = [escape(events.line(e, width)) for e in watcher.events[-tail:]]
    parts: list[Any] = [nodes, Text("event log (etcd)", style="bold"), *lines]
    if faults:
        parts.append(fault_table(faults, width, rows=True))
    return Group(*parts)


async def _supervise(c: LocalCluster, cfg: UpConfig, w: LogWatch, console: Any, t0: float) -> int:
    faults: list[FaultRecord] = []
    drill = Drill(c, w, faults, cfg.faults, cfg.hang_floor_s) if cfg.drill else None
    first_step_at = await _watch(cfg, w, console, t0, drill, faults)
    for f in faults:  # still open as the run ends: judged by the host's load too
        if not f.skipped and (f.detected_s is None or (f.recovers and f.resumed_s is None)):
            judge_load(f)
    console.print(fault_table(faults, console.width) if faults else "no drill")
    if first_step_at is not None:  # from `up`'s own start, etcd's included
        console.print(f"first step {first_step_at - t0:.1f} s after start")
    await _summary(c, cfg, w, console)
    missed = [
        f
        for f in faults
        if not f.skipped and (f.detected_s is None or (f.recovers and f.resumed_s is None))
    ]
    if drill is not None and (drill.plan or missed):
        console.print(drill_verdict(missed, len(drill.plan), cfg.duration_s, first_step_at, t0))
        return 1
    return 0


async def _watch(
    cfg: UpConfig,
    w: LogWatch,
    console: Any,
    t0: float,
    drill: Drill | None,
    faults: list[FaultRecord],
) -> float | None:
    """Follow the event log (live view or plain lines) and drive the drill until the run
    is over; when the first training step was seen (monotonic), if it was."""
    from rich.live import Live

    first_step_at: float | None = None
    done_at: float | None = None
    ended = False  # JobFinished is in the log: nothing more will train
    live_ctx: Any = (
        Live(console=console, refresh_per_second=4) if cfg.live else contextlib.nullcontext()
    )
    with live_ctx as live:
        while True:
            new = await asyncio.to_thread(w.poll)
            now = time.monotonic()
            ended = ended or any(e.HasField("job_finished") for e in new)
            if drill is not None:
                drill.observe(new, now)
            if not cfg.live:
                for e in new:
                    console.print(events.line(e, console.width), markup=False, highlight=False)
            if first_step_at is None and w.step() > 0:
                first_step_at = now
                console.print(f"first training step after {now - t0:.1f} s")
            if drill is not None and first_step_at is not None:
                await drill.advance(now)
            if live is not None:
                live.update(_render(w, faults, now - t0, console.width, console.height))
            # with a drill, the run lasts until the drill is over and --until-step reached
            # (or the duration ends); a job that finished is over either way (its workers may
            # exit before the live view shows their last step: a clean-clone CI run's 30-step
            # job then ran to its whole --duration, 120 s instead of 20)
            finished = ended or (
                drill.done and w.step() >= cfg.until_step
                if drill is not None
                else w.step() >= cfg.steps
            )
            if finished and done_at is None:
                done_at = now
            if now - t0 > cfg.duration_s or (done_at is not None and now - done_at > 3):
                if live is not None:  # the drill's table is printed once, below
                    live.update(_render(w, [], now - t0, console.width, console.height))
                return first_step_at
            await asyncio.sleep(0.25)


async def _summary(c: LocalCluster, cfg: UpConfig, w: LogWatch, console: Any) -> None:
    """The run's closing lines: goodput, steps and events, commits, persistence, where the
    event log stays and how to reach a running cluster."""
    status = await asyncio.to_thread(w.rpc, "GetStatus", dpb.GetStatusRequest())
    if status is not None:
        from unbroken.cli.status import goodput_line

        console.print(f"goodput: {goodput_line(status)}", markup=False, highlight=False)
    counts: dict[str, int] = {}
    for e in w.events:
        k = e.WhichOneof("payload") or "?"
        counts[k] = counts.get(k, 0) + 1
    step = trained_step(w.step(), w.events)
    console.print(
        f"trained to step {step}, last loss {w.loss()}; {len(w.events)} events in etcd: "
        + ", ".join(f"{k}×{v}" for k, v in sorted(counts.items()))
    )
    if step:
        console.print(commits_line(w.events, step), markup=False, highlight=False)
    if status is not None:
        from unbroken.cli.status import persistence_line

        console.print(f"persistence: {persistence_line(status)}", markup=False, highlight=False)
    # this run's etcd stops with it: name its data, and how to serve it again
    console.print(
        f"the event log stays in {c.run / 'etcd'}: `unbroken etcd --data-dir "
        f"{c.run / 'etcd'}` serves it again and prints the etcdctl command for "
        f"/unbroken/{cfg.job_id}/",
        markup=False,
        highlight=False,
    )
    console.print(
        "this cluster ran with role tokens (SECURITY.md); an operator command against a "
        f"running one: UNBROKEN_TOKEN_FILE={c.run / 'tokens' / 'operator.token'} unbroken "
        "status --driver HOST:PORT",
        soft_wrap=True,
    )


def drill_verdict(
    missed: list[FaultRecord],
    not_injected: int,
    duration_s: float,
    first_step_at: float | None,
    t0: float,
) -> str:
    """The closing line of an incomplete drill: what failed, and what this host's load kept
    from being judged (a fault given up at over `OVERLOAD_PER_CORE` runnable tasks a core)."""
    unjudged = [f for f in missed if f.unjudged]
    failed = len(missed) - len(unjudged)
    cores = os.cpu_count() or 1
    parts = [f"{failed} fault(s) not detected or not recovered"]
    if unjudged:
        peak = max(f.load_peak for f in unjudged)
        parts.append(
            f"{len(unjudged)} not judged: this host's load average reached {peak:.0f} on "
            f"{cores} cores (over {OVERLOAD_PER_CORE:.0f} per core), too busy to time "
            "detection and recovery; run the drill on a quieter host"
        )
    if not_injected:
        start = f" (first step after {first_step_at - t0:.0f} s)" if first_step_at else ""
        parts.append(
            f"{not_injected} not injected before --duration {duration_s:.0f} s ran out{start}"
        )
    return "[red]drill incomplete[/]: " + ", ".join(parts)
