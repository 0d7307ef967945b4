"""Benchmark of recovery: per-fault detect/resume/steps lost, cold vs warm restarts, and ETTR.

A real local cluster (the pieces of `unbroken up`): an embedded etcd, a leader driver and a
standby running the recovery loop, 2 training agents x 1 worker (the tiny gpt3d model, dp2,
flash-saving every step) and a spare agent. Faults are injected by signals:

* worker crash: SIGKILL a worker (detected as WorkerFailed);
* node loss: SIGKILL a training node's agent (its workers and standbys die with it through
  pdeathsig; NodeLost); a new spare agent is started at once for the next one;
* hang: SIGSTOP a worker (HangSuspected once the agent sees no progress for
  max(`--hang-floor-ms`, 5 x the rank's p90 step time); a restore is excluded by the
  worker's own phase report, so the agents' 1 s default is used);
* driver kill: SIGKILL the leader driver (LeaderElected); it is restarted on the same port as
  the new standby. Training never pauses for it: resume_s = 0, steps_lost = 0.

* loss spike: the leader's InjectFault RPC (`unbroken inject loss-spike`) on every training
  node, 2 steps ahead (LossSpike; the loop rolls back and restarts the world);
* silently bad node: InjectFault `wrong-matmul` on a training node, then an on-demand
  self-check of it (`unbroken selfcheck`); detected when its failed SelfCheckReported is
  appended; the loop evicts it on its failed matmul without a diagnosis (the driver's
  default `--self-check-evicts matmul,ecc`; results recorded before that default include
  the confirming diagnosis, about 2.6 s) and a spare takes its rank (a new spare is
  started at once; the evicted agent is stopped).

Phases, all in one run:
0. modes: in-job recovery (the driver's default) against a restart of every worker process
   (`--no-in-job`), each on its own warm cluster, the same faults (worker crash, hang, node
   loss, loss spike) x N interleaved; `modes.by_kind.<kind>` holds each mode's medians side
   by side (`resume_s_in_job`, `resume_s_restart`, after detection, detection, steps lost,
   load) and `resume_s_in_job` / `resume_s_restart` at the top repeat the resume medians.
   A third mode, `replica` (`--keep-training`, the replica policy): the fault's replica
   sits out, the other trains on (`resume_s_replica`), and the replica rejoins by a
   grow-back `--replica-rejoin-s` later (`rejoin_pause_s_replica`: that pause).
   Run alone (`--phases modes`) it keeps the file's other figures and files its own
   settings and load under `modes.run`. A node loss (and a bad node) waits for a spare
   standing by: registered, and with warm standbys its standby done importing.
1. cold: a cluster whose agents start every worker as a fresh process (`--no-warm-workers`),
   worker crash x N: the baseline of the warm standbys.
2. warm (agents with `--warm-workers`; `--warm-nice N` is passed on): a fault-free stretch
   (ETTR baseline), then each fault type x N one at a time (wait for the resume, then for
   the standbys to be refilled), then two runs with faults at exponential inter-arrival
   times (seeded) of mean 60 s and 20 s (each phase on a fresh cluster).
3. ab: what the flash saves cost, in one run: the workers save into memory in alternating
   25-step blocks (`--flash-ab 25`) and `throughput_with_flash_vs_without` is the steps per
   wall second (step time plus the loop's time after it) of the blocks with saves over
   those without, each block's first 3 steps left out; the median over clusters. Machine
   drift between minutes-apart clusters is not in it.
4. throughput: the same from separate clusters with and without flash saves (pairs of
   clusters, `throughput_clusters_with_vs_without`): the host's drift between them is in it.

detect_s and resume_s come from the events' own wall times (inject -> detection event ->
TrainingResumed, which the driver appends once every rank of the restarted world reported a
step); steps_lost from TrainingPaused's step reached minus RestoreFinished's restored_step
(the oldest step the ranks say they restored; the pause's restore_step is the driver's plan).
ETTR =
productive time / wall time over the run, where productive time is the sum of the loop
turns of the steps that count (the last run of each step number; rank 0's metrics): each
turn is the time from the loop's previous report to this step's (`turn_s`: the step, the
flash save's blocking part, the report, and the loop's bookkeeping between two steps); the
first turn after a start, a restore or a wait for a spike's verdict has no previous report
and counts the step's `step_time_s` plus the loop's time after it (`host_s`). The time the
faults cost (detection, recovery, steps run again) is what is missing.
`ettr_to_report` is the definition before 2026-12-04, every turn counted as `step_time_s +
host_s`: it left out the bookkeeping after the report (the metrics line, the command poll,
the loss check, the next step's fault checks), 0.3 ms a step on a loaded host, so a
fault-free run scored 0.996 by it. `ettr_step_time` is the one before that, `step_time_s`
alone (a fault-free run scored ~0.89); what the flash saves cost is the ab phase's
figure. The wall time starts at the run's first step. Medians over N = 5 runs.

Run: ``.venv/bin/python bench/recovery.py [--quick] [--runs N] [--ettr-s S] [--phases ...]``
or ``make bench-recovery``. The default (5 runs per fault, 10-minute ETTR runs) takes about
an hour on 2 idle cores; --quick about 10 minutes. The JSON is rewritten after every phase
(`"partial": true` until the end), so a run cut short keeps what it measured. Each phase
runs on a fresh cluster; a phase whose job the driver declares failed (on a saturated host,
agents silent for seconds look lost) is recorded under `errors` and the next one goes on.
Writes bench/results/recovery.json and prints the README table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "1")


from unbroken.cli.cluster import CLI, LocalCluster, LogWatch, stop_groups
from unbroken.cli.faults import Faults, proves
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.trainer.rtrace import TRACE

RESULTS = Path(__file__).resolve().parent / "results" / "recovery.json"
KINDS = ("worker_crash", "node_loss", "hang", "loss_spike", "silently_bad_node", "driver_kill")
NOT_INJECTED: dict[str, str] = {}
# the modes phase hurts a node's worker again only after this (the driver's fault window is
# 1,000 steps, about 50 s here), when another node has a worker to hurt
REPEAT_S = 60.0
# ...and runs its drivers with this fault window (`--fault-window-steps`): with two world
# nodes, one of which a node loss never replaces, 1,000 steps (50-100 s under load) held
# every earlier fault of that node, and 4 of 5 in-job hangs of the 17:44 run (2026-12-01)
# were diagnosed repeats (1.05-1.43 s against 0.48 for the one that was not). The phase
# measures one fault's recovery; the ETTR phase keeps the default policy.
MODES_FAULT_WINDOW_STEPS = 100
SPIKE_AHEAD = 2  # a loss spike is injected this many steps ahead of the newest step
# ...and not before this step: the detector needs a baseline, and the tiny model's early
# curve falls so fast that a poisoned step 20 was 1.8x the median (no spike: unresolved)
SPIKE_MIN_STEP = 40
SPIKE_MAX_ROLLBACKS = 1000  # the drivers' --spike-max-rollbacks
HANG_FLOOR_MS = 1_000
# Missed 100 ms heartbeats before NodeLost: 5, as `unbroken up` (`--miss-limit`; an older,
# loaded machine needed 30, where agents were often silent for 0.5 s).
MISS_LIMIT = 5
RESOLVE_LIMIT_S = 120.0
# A node loss or an evicted node owes the cluster a new spare. On a real cluster that is
# another machine; here its start (an agent, its standby and its check, each importing
# torch) took 0.5-0.75 of the host's two cores for about 2 s, exactly while the job it is
# not yet part of recovered: the silently bad node's resume was 2.0-3.6 s with it beside it
# (2026-12-02 17:13). It starts once the fault that owes it is resolved, or after this long.
SPARE_AFTER_S = 30.0
# The "ab" phase: flash saves on and off in alternating blocks of one run (`--flash-ab`),
# the first steps of each block left out (the previous block's last save still finishing)
AB_BLOCK = 25
AB_SETTLE = 3


def _running(node: Any) -> list[Any]:
    """A live node's workers that run (a pid to kill or stop)."""
    return [wk for wk in node.workers if wk.pid and wk.state == dpb.WORKER_STATE_RUNNING]


@dataclass(slots=True)
class Fault:
    """One injected fault and what the log said about it."""

    kind: str
    target: str
    wall_ns: int
    mono: float
    detect_s: float | None = None
    resume_s: float | None = None
    steps_lost: int | None = None
    paused_at: int | None = None  # the incident's last TrainingPaused.at_step
    detect_seq: int = 0
    warm_starts: int = 0  # workers the agents started in a warm standby for this fault
    cold_starts: int = 0
    load1: float = 0.0  # the machine's 1-minute load average at injection (2 cores)
    note: str = ""
    # every event from the injection to TrainingResumed: (seconds since injection, what)
    timeline: list[tuple[float, str]] = field(default_factory=list)
    # the workers' recovery marks (trainer/rtrace.py) in that span: (seconds, pid, phase)
    marks: list[tuple[float, int, str]] = field(default_factory=list)
    # where the time went (`breakdown`): phase -> seconds
    phases: dict[str, float] = field(default_factory=dict)
    # the replica policy (--keep-training): the grow-back that brought the replica in again,
    # its pause (its first transition to its TrainingResumed) and when it ended
    grow_began_ns: int = 0
    rejoin_pause_s: float | None = None
    rejoin_s: float | None = None

    @property
    def resolved(self) -> bool:
        if self.kind == "driver_kill":
            return self.detect_s is not None
        return self.resume_s is not None


class StepLine(NamedTuple):
    """One metrics line of rank 0, as seen at `t` (monotonic)."""

    t: float
    step: int
    step_s: float  # the step alone (`step_time_s`)
    to_report: float  # its loop turn to its report: step_s plus the loop's time after it
    turn: float  # its whole loop turn (`turn_s`), where the line has one, else to_report


@dataclass(slots=True)
class Steps:
    """Rank 0's metrics lines as they appear, with the time the bench saw them."""

    path: Path
    offset: int = 0
    lines: list[StepLine] = field(default_factory=list)
    # (t, the loop's time after the step, the flash save's part of it): the per-step
    # host time ETTR loses between steps
    host: list[tuple[float, float, float]] = field(default_factory=list)
    # (t, step, the step's wall time: its step time plus the loop's time after it, whether
    # its block saved): rows of a `--flash-ab` run
    ab: list[tuple[float, int, float, bool]] = field(default_factory=list)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        now = time.monotonic()
        for raw in data[:end].splitlines():
            with contextlib.suppress(ValueError, KeyError):
                m = json.loads(raw)
                dt = float(m["step_time_s"])
                to_report = dt + float(m.get("host_s", 0.0))
                turn = float(m.get("turn_s", to_report))
                self.lines.append(StepLine(now, int(m["step"]), dt, to_report, turn))
                if "host_s" in m:
                    self.host.append((now, float(m["host_s"]), float(m.get("flash_save_s", 0.0))))
                if "flash_block" in m and "host_s" in m:
                    wall = float(m["step_time_s"]) + float(m["host_s"])
                    self.ab.append((now, int(m["step"]), wall, bool(m["flash_block"])))

    def max_step(self) -> int:
        return max((line.step for line in self.lines), default=0)

    def productive_s(self, t0: float, t1: float, *, what: str = "turn") -> tuple[float, int]:
        """The time of the steps that count (the last run of each step) seen in [t0, t1]:
        their loop turns (`what="turn"`), their turns up to their reports ("to_report":
        step time plus the loop's time after it) or their step time alone ("step")."""
        field_ = {"step": "step_s", "to_report": "to_report", "turn": "turn"}[what]
        last: dict[int, float] = {}
        for line in self.lines:
            if t0 <= line.t <= t1:
                last[line.step] = getattr(line, field_)
        return sum(last.values()), len(last)

    def ab_rates(self, t0: float, t1: float, block: int) -> dict[str, Any]:
        """Steps per second in the blocks with flash saves and in those without (a
        `--flash-ab` run), from the steps seen in [t0, t1] less the first `AB_SETTLE`
        steps of each block (the previous block's last save still finishing)."""
        walls: dict[bool, list[float]] = {True: [], False: []}
        pairs: dict[int, dict[bool, list[float]]] = {}
        for t, step, wall, on in self.ab:
            if t0 <= t <= t1 and step % block >= AB_SETTLE:
                walls[on].append(wall)
                pairs.setdefault(step // (2 * block), {True: [], False: []})[on].append(wall)

        def per_s(w: list[float]) -> float:  # steps per second of these steps' wall times
            return len(w) / sum(w)

        rate = {on: per_s(w) if w else None for on, w in walls.items()}
        ratios = [per_s(p[True]) / per_s(p[False]) for p in pairs.values() if p[True] and p[False]]
        return {
            "steps_per_s_with_flash": rate[True],
            "steps_per_s_without_flash": rate[False],
            "ratio": rate[True] / rate[False] if rate[True] and rate[False] else None,
            "block_pair_ratio_median": statistics.median(ratios) if ratios else None,
            "block_pairs": len(ratios),
            "steps": len(walls[True]) + len(walls[False]),
        }

    def host_ms(self, t0: float, t1: float) -> dict[str, float | None]:
        """Per-step times in [t0, t1] (ms): the step's median, the loop's host time after
        it (mean, median) and the flash save's part of that (mean)."""
        seen = [(h, f) for t, h, f in self.host if t0 <= t <= t1]
        steps = [line.step_s for line in self.lines if t0 <= line.t <= t1]
        return {
            "step_ms_median": 1000.0 * statistics.median(steps) if steps else None,
            "host_ms_mean": 1000.0 * statistics.fmean(h for h, _ in seen) if seen else None,
            "host_ms_median": 1000.0 * statistics.median(h for h, _ in seen) if seen else None,
            "flash_save_ms_mean": 1000.0 * statistics.fmean(f for _, f in seen) if seen else None,
        }


class JobFailed(Exception):
    """The driver declared the job failed: the phase cannot go on."""


@dataclass(slots=True)
class Trace:
    """The workers' recovery marks (trainer/rtrace.py), read back by wall time."""

    path: Path

    def since(self, t0_ns: int, t1_ns: int) -> list[tuple[float, int, str]]:
        """Marks in [t0_ns, t1_ns]: (seconds after t0, pid, phase), in time order."""
        out: list[tuple[float, int, str]] = []
        with contextlib.suppress(OSError):
            for raw in self.path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    m = json.loads(raw)
                    if t0_ns <= m["t_ns"] <= t1_ns:
                        out.append((round((m["t_ns"] - t0_ns) / 1e9, 4), m["pid"], m["phase"]))
        return sorted(out)


#: The recovery's phases (`breakdown`), in order: each is the time from the end of the one
#: before (the injection for the first) to its own end, so they add up to resume_s.
BREAKDOWN = (
    "detect",  # the injection -> the detection event
    "hold",  # -> every survivor held (its last `held` mark; the restart mode: RESTORING)
    "new_world",  # -> the last rank joined the new world's process group (`pg_init`)
    "rebuild",  # -> the last rank's trainer built (`setup`)
    "restore",  # -> the last rank's state in place (`restored`)
    "first_step",  # -> the last rank's first step (`first_step`)
    "report",  # -> TrainingResumed (the agents' reports, the driver's append)
)


def breakdown(f: Fault) -> dict[str, float]:
    """Where `f`'s resume time went: `BREAKDOWN`'s phases, each one's own seconds.

    A phase's end is the last mark of it after the detection (the slowest rank decides);
    a phase with no mark (a process that kept its state marks no `setup`) ends where the
    one before it did.
    """
    if f.resume_s is None or f.detect_s is None:
        return {}

    def last(phase: str, after: float) -> float | None:
        ts = [t for t, _, p in f.marks if p == phase and t >= after]
        return max(ts) if ts else None

    restoring = [t for t, what in f.timeline if what.endswith("PHASE_RESTORING")]
    ends = {"detect": f.detect_s}
    held = last("held", f.detect_s)
    if held is None and restoring:
        held = (
            min(t for t in restoring if t >= f.detect_s)
            if any(t >= f.detect_s for t in restoring)
            else None
        )
    ends["hold"] = held if held is not None else f.detect_s
    prev = ends["hold"]
    for phase, mark_ in (
        ("new_world", "pg_init"),
        ("rebuild", "setup"),
        ("restore", "restored"),
        ("first_step", "first_step"),
    ):
        t = last(mark_, prev)
        ends[phase] = t if t is not None else prev
        prev = ends[phase]
    ends["report"] = max(f.resume_s, prev)
    out, before = {}, 0.0
    for phase in BREAKDOWN:
        out[phase] = round(max(0.0, ends[phase] - before), 4)
        before = max(before, ends[phase])
    return out


class Bench:
    """One cluster: start it, inject faults, read what happened."""

    def __init__(
        self,
        run: Path,
        *,
        warm: bool,
        log: Any,
        warm_nice: int | None = None,
        flash: bool = True,
        miss_limit: int = MISS_LIMIT,
        flash_ab: int = 0,
        agent_flags: tuple[str, ...] = (),
        driver_flags: tuple[str, ...] = (),
        device: str = "cpu",
    ) -> None:
        self.run = run
        self.device = device
        self.driver_flags = driver_flags
        self.replica = "--keep-training" in driver_flags  # a fault's replica rejoins later
        self._hit: dict[str, float] = {}  # node -> when a worker fault last hit it
        self.flash = flash
        self.flash_ab = flash_ab
        self.extra_agent_flags = agent_flags
        self.miss_limit = miss_limit
        self.warm = warm
        self.warm_nice = warm_nice
        self.say = log
        self.trace = Trace(run / "recovery-trace.jsonl")
        self.c = LocalCluster(
            run,
            job="bench",
            env={
                "UNBROKEN_REPLICA_KEY": "bench-job-replica-key-0123456789",  # the buddy stream
                TRACE: str(self.trace.path),  # the workers' recovery marks
            },
            grace_s=15,
        )
        self.w = LogWatch(self.c)
        self.hurt = Faults(self.c, watch=self.w)
        self.steps = Steps(run / "metrics.jsonl")
        self.spares = 0
        self._spares_owed: list[Fault] = []  # faults whose new spare starts once resolved
        self.faults: list[Fault] = []
        self._marks: dict[Path, int] = {}
        self.failed = ""
        self.evicted: set[str] = set()
        # NodeLost of a node no node_loss fault took down: (node, reason, wall time ns)
        self.false_lost: list[tuple[str, str, int]] = []
        self.flash_job = f"bench-{run.name}-{os.getpid()}"
        self._agent_flags = self._optional_agent_flags()

    def _optional_agent_flags(self) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-m", "unbroken.cli", "agent", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        flags = ["--warm-workers"] if self.warm else ["--no-warm-workers"]
        if self.warm and self.warm_nice is not None:
            flags += ["--warm-nice", str(self.warm_nice)]
        if "--no-selfcheck" in out:  # the self-check's CPU burst would skew resume times
            flags.append("--no-selfcheck")
        return flags + list(self.extra_agent_flags)

    # ------------------------------------------------------------ processes
    def _worker_cmd(self) -> str:
        return (
            f"{sys.executable} -m unbroken.trainer.run --preset tiny --dp 2 --steps 1000000 "
            f"--log-every 50 --metrics-out {self.steps.path}"
            + ("" if self.flash else " --flash-every 0")
            + (f" --flash-ab {self.flash_ab}" if self.flash_ab else "")
            + (" --device cuda" if self.device == "cuda" else "")
        )

    def _driver(self, name: str) -> None:
        self.c.start_driver(
            name,
            [
                "--archive-url", str(self.c.run / "archive"), "--allow-fault-injection",
                "--nodes", "2", "--workers-per-node", "1", "--dp", "2",
                "--worker-cmd", self._worker_cmd(), "--master-addr", "127.0.0.1",
                "--trainer", "gpt3d", "--miss-limit", str(self.miss_limit),
                # every injected spike is rolled back: the bench measures the recovery, and
                # the default halt (3 rollbacks within 1000 steps) failed clusters at the
                # 5th spike of the modes phase
                "--spike-max-rollbacks", str(SPIKE_MAX_ROLLBACKS),
                *self.driver_flags,
            ],
            wait_s=None,
        )  # fmt: skip

    def _agent(self, node: str, *, spare: bool) -> None:
        self.c.start_agent(
            node,
            [
                "--no-start",
                # the driver's --worker-cmd wins; the same here lets a spare warm its standbys
                "--worker-cmd", self._worker_cmd(),
                "--flash-job", self.flash_job,
                "--hang-floor-ms", str(HANG_FLOOR_MS),
                *self._agent_flags,
            ],
            buddy="node-0" if node != "node-0" else "node-1",
            spare=spare,
            launcher=self._launcher(node),
        )  # fmt: skip

    def _launcher(self, node: str) -> tuple[str, ...]:
        """How `node`'s agent is started. On one GPU (`--device cuda`) every node's workers share
        it: NCCL refuses two ranks of one host on one device, so each node says it is its own
        host (NCCL_HOSTID) and its ranks talk over loopback sockets, as two hosts would."""
        if self.device != "cuda":
            return CLI
        return ("env", f"NCCL_HOSTID={node}", "NCCL_SOCKET_IFNAME=lo", *CLI)

    def new_spare(self) -> None:
        self._agent(f"spare-{self.spares}", spare=True)
        self.spares += 1

    def _agent_logs(self) -> list[Path]:
        return sorted([*self.run.glob("node-*.log"), *self.run.glob("spare-*.log")])

    async def start(self) -> None:
        self.c.start()
        for name in ("driver-a", "driver-b"):
            self._driver(name)
        for name in ("driver-a", "driver-b"):
            await asyncio.to_thread(self.c.wait_driver, name)
        for node in ("node-0", "node-1"):
            self._agent(node, spare=False)
        self.new_spare()
        await self.wait_for("the first steps", lambda: self.steps.max_step() >= 5, 240)

    async def close(self) -> None:
        self.w.close()
        self.c.stop()
        # agents killed on purpose keep their flash copies (for a restart): drop them
        for d in Path("/dev/shm/unbroken").glob(f"*/{self.flash_job}"):
            shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------ observing
    async def tick(self) -> None:
        """Poll the log, the live view and the metrics; settle faults."""
        new = await asyncio.to_thread(self.w.poll)
        self.steps.poll()
        for e in new:
            for f in self.faults:
                self._observe(f, e)
            if e.HasField("node_evicted"):
                self.evicted.add(e.node_evicted.node_id)
            if e.HasField("node_lost") and not self._killed(e.node_lost.node_id):
                lost = e.node_lost
                self.false_lost.append((lost.node_id, lost.reason, e.wall_time_unix_ns))
            if e.HasField("node_evicted") and e.node_evicted.node_id in self.c.agents:
                # an evicted node waits idle for an operator: stop it (its spare replaced it)
                stop_groups([self.c.forget(e.node_evicted.node_id)], grace_s=15)
            if e.HasField("job_finished") and not e.job_finished.ok:
                self.failed = e.job_finished.reason or "job finished not ok"
            elif (
                e.HasField("recovery_transition")
                and e.recovery_transition.to_phase == ev.PHASE_FAILED
            ):
                self.failed = e.recovery_transition.reason or "PHASE_FAILED"
        now = time.monotonic()
        for f in [f for f in self._spares_owed if f.resolved or now - f.mono > SPARE_AFTER_S]:
            self._spares_owed.remove(f)
            self.new_spare()
        if self.failed:
            raise JobFailed(self.failed)

    def _killed(self, node: str) -> bool:
        """Whether the bench took `node` down (a node_loss fault; an evicted node it stops)."""
        if node in self.evicted:
            return True
        return any(f.kind == "node_loss" and f.target.split(" ")[0] == node for f in self.faults)

    def _observe(self, f: Fault, e: ev.Event) -> None:
        kind = e.WhichOneof("payload")
        since = max(0.0, (e.wall_time_unix_ns - f.wall_ns) / 1e9)
        if f.resume_s is None and e.wall_time_unix_ns >= f.wall_ns:
            what = str(kind)
            if kind == "recovery_transition":
                what += ":" + ev.Phase.Name(e.recovery_transition.to_phase)
            f.timeline.append((round(since, 4), what))
        if f.detect_s is None:
            node = f.target.split(" ")[0]
            if proves(e, f.kind, node) and e.wall_time_unix_ns >= f.wall_ns:
                f.detect_s, f.detect_seq = since, e.seq
                if f.kind == "driver_kill":
                    f.resume_s, f.steps_lost = 0.0, 0
            return
        if f.resume_s is not None and self.replica and f.rejoin_s is None:
            self._observe_rejoin(f, e, since)
        if f.resume_s is not None or e.seq <= f.detect_seq:
            return
        if kind == "training_paused":  # the last pause of the incident counts
            f.paused_at = e.training_paused.at_step
            f.steps_lost = max(0, f.paused_at - e.training_paused.restore_step)
        elif kind == "restore_finished" and f.paused_at is not None:
            # the step the ranks really restored (the pause's is the driver's plan, a floor)
            done = e.restore_finished.restored_step or e.restore_finished.step
            f.steps_lost = max(0, f.paused_at - done)
        elif kind == "training_resumed":
            f.resume_s = since
            f.marks = self.trace.since(f.wall_ns, e.wall_time_unix_ns)
            f.phases = breakdown(f)
            if self.replica and e.training_resumed.world.dp >= 2:
                # no replica sat out (a standby took the rank at once): nothing rejoins
                f.rejoin_s = since  # (no pause to count: rejoin_pause_s stays None)

    def _observe_rejoin(self, f: Fault, e: ev.Event, since: float) -> None:
        """The replica policy's grow-back after `f`: its pause and when dp was whole again."""
        if e.HasField("recovery_transition") and e.recovery_transition.reason.startswith("grow"):
            f.grow_began_ns = f.grow_began_ns or e.wall_time_unix_ns
        elif (
            e.HasField("training_resumed") and f.grow_began_ns and e.training_resumed.world.dp >= 2
        ):
            f.rejoin_pause_s = (e.wall_time_unix_ns - f.grow_began_ns) / 1e9
            f.rejoin_s = since

    async def wait_for(self, what: str, cond: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await self.tick()
            if cond():
                return True
            await asyncio.sleep(0.2)
        self.say(f"  (timed out after {timeout_s:.0f} s waiting for {what})")
        return False

    def _working(self) -> list[Any]:
        """Live nodes with a running worker. An agent keeps reporting a worker it stopped
        (state STOPPED, its pid kept): a node that left the world is not working, and
        killing that pid crashes nothing (session 8's MTBF 20 s run "injected" a worker
        crash into spare-0's worker stopped four minutes earlier, never detected)."""
        return [n for n in self.w.nodes if n.alive and _running(n)]

    def _spare_ready(self) -> bool:
        return any(
            n.alive and not n.workers and n.node_id.startswith("spare-") for n in self.w.nodes
        )

    def _spare_warm(self) -> bool:
        """A spare is ready and, with warm standbys, its standby has finished importing
        (its log says "standby ready"): a spare that registered a few seconds ago is still
        importing torch on this host (5-9 s at load 3), and a node loss then measured that
        import, not the recovery (the 00:46 runs: 2.7 and 2.8 s against 1.6)."""
        return any(
            n.alive
            and not n.workers
            and n.node_id.startswith("spare-")
            and (not self.warm or "standby ready" in self.c.log(n.node_id))
            for n in self.w.nodes
        )

    def _spare_coming(self) -> bool:
        """A spare is ready, one started is not yet registered, or one is owed."""
        known = {n.node_id for n in self.w.nodes}
        starting = [
            a
            for a, p in self.c.agents.items()
            if a.startswith("spare-") and a not in known and p.poll() is None
        ]
        return self._spare_ready() or bool(starting) or bool(self._spares_owed)

    def _standbys_ready(self) -> bool:
        """Every working node logged as many ready standbys as it has workers (warm only)."""
        if not self.warm:
            return True
        for n in self._working():
            text = self.c.log(n.node_id)
            tail = text[text.rfind("worker started") :]
            if tail.count("standby ready") < len(n.workers):
                return False
        return True

    # ------------------------------------------------------------ injecting
    def can(self, kind: str) -> bool:
        if kind in ("node_loss", "silently_bad_node"):
            return self._spare_ready() and len(self._working()) >= 2
        if kind == "driver_kill":
            live = [n for n, p in self.c.drivers.items() if p.poll() is None]
            return bool(self.w.leader) and len(live) == 2
        return bool(self._working())

    async def inject(self, kind: str, *, spread: bool = False) -> Fault | None:
        """Inject one fault of `kind`. `spread` (the modes phase): a worker's crash or hang
        picks a node no worker fault hit in the last `REPEAT_S` when there is one, so each
        measures one fault's recovery, not the repeat-offender policy's diagnosis (a node
        that hangs or crashes again within `--fault-window-steps` is diagnosed first, ~1 s:
        in the 13:44 run 7 of 15 hangs were such repeats, 1.5-3.1 s each). The ETTR phase keeps
        the random victim: repeats are part of its mix."""
        await self.tick()
        wall, mono = time.time_ns(), time.monotonic()
        if kind in ("worker_crash", "hang"):
            victims = [(n.node_id, wk.pid) for n in self._working() for wk in _running(n)]
            if not victims:
                return None
            if spread:
                fresh = [v for v in victims if mono - self._hit.get(v[0], -1e9) > REPEAT_S]
                victims = fresh or victims
            node, pid = random.Random(mono).choice(victims)
            self._hit[node] = mono
            hurt = self.hurt.worker_kill if kind == "worker_crash" else self.hurt.worker_stop
            hurt(node, pid=pid)
            f = Fault(kind, f"{node} pid {pid}", wall, mono)
        elif kind == "node_loss":
            working = [n.node_id for n in self._working() if n.node_id in self.c.agents]
            if not working:
                return None
            gone = working[-1]
            await asyncio.to_thread(self.hurt.agent_kill, gone)
            f = Fault(kind, gone, wall, mono)
            self._spares_owed.append(f)  # its replacement machine, once the job recovered
        elif kind == "loss_spike":
            end = time.monotonic() + 60
            while self.w.step() < SPIKE_MIN_STEP and time.monotonic() < end:
                await asyncio.sleep(0.2)
                await self.tick()
            await asyncio.to_thread(self.hurt.loss_spike, ahead=SPIKE_AHEAD)
            inj = self.hurt.injections[-1]  # after any wait for the leader to hear every node
            f = Fault(kind, inj.target, inj.wall_ns, inj.mono)
            f.note = inj.note
        elif kind == "silently_bad_node":
            working = [n.node_id for n in self._working() if n.node_id in self.c.agents]
            if not working:
                return None
            bad = working[0]
            f = Fault(kind, bad, wall, mono)
            # its self-check (run on demand, in the background) finds it; the loop evicts it
            await asyncio.to_thread(self.hurt.bad_matmul, bad, check_timeout_s=120.0)
            f.note = self.hurt.injections[-1].note
            self._spares_owed.append(f)
        elif kind == "driver_kill":
            leader = self.w.leader
            if not leader:
                return None
            await asyncio.to_thread(self.hurt.driver_kill, leader, respawn=False)
            f = Fault(kind, leader, wall, mono)
            self.c.respawn(leader, wait_s=None)  # back on its address, as the standby
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        f.load1 = os.getloadavg()[0]
        self.faults.append(f)
        self._marks = {p: p.stat().st_size for p in self._agent_logs()}
        return f

    def _starts_since_mark(self) -> tuple[int, int]:
        """Warm and cold worker starts the agents logged since the last injection."""
        warm = cold = 0
        for p in self._agent_logs():
            with open(p, "rb") as fh:
                fh.seek(self._marks.get(p, 0))
                text = fh.read().decode(errors="replace")
            warm += text.count("warm=True")
            cold += text.count("warm=False")
        return warm, cold

    async def one(self, kind: str) -> Fault | None:
        """Inject one fault and wait until training resumed and standbys are back."""
        if kind in ("node_loss", "silently_bad_node") and not self._spare_coming():
            # a hang or a bad node evicted earlier took the last spare into the world: a
            # node loss needs a new one (it used to wait 90 s for none, and was skipped)
            self.new_spare()
        ok = await self.wait_for(f"a chance to inject {kind}", lambda: self.can(kind), 90)
        if ok and kind in ("node_loss", "silently_bad_node"):
            # the modes phase measures a node replaced by a spare standing by (the ETTR
            # phase's faults come when they come, warm spare or not)
            ok = await self.wait_for("a warm spare", self._spare_warm, 60)
        if not ok:
            return None
        f = await self.inject(kind, spread=True)
        if f is None:
            return None
        await self.wait_for(f"{kind} to be resolved", lambda: f.resolved, RESOLVE_LIMIT_S)
        f.note = "" if f.resolved else "not resolved in time"
        if self.replica and f.resolved and f.kind != "loss_spike":  # the replica back in
            await self.wait_for("the replica's rejoin", lambda: f.rejoin_s is not None, 120)
        mark = self.steps.max_step()
        await self.wait_for("steady training", lambda: self.steps.max_step() >= mark + 5, 60)
        await self.wait_for("standbys", self._standbys_ready, 45)
        f.warm_starts, f.cold_starts = self._starts_since_mark()
        self.say(
            f"  {kind:13s} {f.target:18s} detect {_fmt(f.detect_s)} resume {_fmt(f.resume_s)} "
            f"lost {f.steps_lost} starts warm/cold {f.warm_starts}/{f.cold_starts} "
            f"load {f.load1:.1f}"
        )
        return f

    async def steady(self, seconds: float) -> dict[str, float]:
        """Train without faults for `seconds`: the ETTR baseline."""
        await self.tick()
        t0 = time.monotonic()
        await self.wait_for("the baseline", lambda: time.monotonic() - t0 >= seconds, seconds + 5)
        return {**self._ettr(t0, time.monotonic(), []), "load1_end": os.getloadavg()[0]}

    async def mtbf(self, mtbf_s: float, seconds: float, seed: int) -> dict[str, Any]:
        """Faults at exponential inter-arrival times of mean `mtbf_s` for `seconds`."""
        rng = random.Random(seed)
        await self.tick()
        t0 = time.monotonic()
        faults: list[Fault] = []
        next_at = t0 + rng.expovariate(1.0 / mtbf_s)
        failed = ""
        try:
            while (now := time.monotonic()) < t0 + seconds:
                await self.tick()
                if not self._spare_coming():
                    # a node evicted without a node-loss fault (a diagnosis's verdict) took
                    # the spare: keep one coming, or every node loss and silently bad node
                    # drawn after it became a worker crash (2026-12-01 13:54: the MTBF 20 s
                    # run lost its spare to a false hang at step 3, and 8 of its 31 faults
                    # were such substitutes)
                    self.new_spare()
                if now >= next_at:
                    kind = rng.choice(KINDS)
                    if not self.can(kind):  # a spare still starting: wait a little for it
                        await self.wait_for(
                            f"a chance to inject {kind}", lambda k=kind: self.can(k), 30
                        )
                    if not self.can(kind):
                        kind = "worker_crash"
                    f = await self.inject(kind) if self.can(kind) else None
                    if f is not None:
                        faults.append(f)
                        self.say(f"  t+{now - t0:5.1f} s: {kind} on {f.target}")
                    next_at = now + rng.expovariate(1.0 / mtbf_s)
                await asyncio.sleep(0.2)
        except JobFailed as e:  # the rest of the window trains nothing: it counts as lost
            failed = str(e)
            self.say(f"  job failed at t+{time.monotonic() - t0:.0f} s: {e}")
        r = self._ettr(t0, max(time.monotonic(), t0 + seconds), faults)
        r["job_failed"] = failed
        return r

    def _ettr(self, t0: float, t1: float, faults: list[Fault]) -> dict[str, Any]:
        productive, nsteps = self.steps.productive_s(t0, t1)
        to_report, _ = self.steps.productive_s(t0, t1, what="to_report")
        compute, _ = self.steps.productive_s(t0, t1, what="step")
        kinds: dict[str, int] = {}
        for f in faults:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        wall0 = time.time_ns() - int((time.monotonic() - t0) * 1e9)  # t0 on the wall clock
        return {
            "ettr": productive / (t1 - t0),
            # the definition before 2026-12-04: each turn only to its report
            "ettr_to_report": to_report / (t1 - t0),
            # the one before: step time alone (the loop's own time counts as lost)
            "ettr_step_time": compute / (t1 - t0),
            "wall_s": t1 - t0,
            "productive_s": productive,
            "steps": nsteps,
            **self.steps.host_ms(t0, t1),
            "faults": len(faults),
            "by_kind": kinds,
            "unresolved": sum(not f.resolved for f in faults),
            # NodeLost events of nodes no fault took down (a false loss), in this window
            "false_node_lost": [
                {"node": n, "reason": why, "at_s": round((at - wall0) / 1e9, 1)}
                for n, why, at in self.false_lost
                if at >= wall0
            ],
            # each fault's own figures: where the lost time went
            "incidents": [
                {
                    "kind": f.kind,
                    "at_s": round(f.mono - t0, 1),
                    "detect_s": f.detect_s,
                    "resume_s": f.resume_s,
                    "steps_lost": f.steps_lost,
                    "load1": f.load1,
                }
                for f in faults
            ],
        }


def _fmt(x: float | None) -> str:
    return f"{x:6.2f} s" if x is not None else "   -   "


def _median(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else None


#: The faults of the "modes" phase (in-job recovery against a restart of every process).
MODE_KINDS = ("worker_crash", "hang", "node_loss", "loss_spike")


def modes_summary(by_mode: dict[str, list[Fault]], runs: int) -> dict[str, Any]:
    """Per fault kind, the medians of each recovery mode side by side (`resume_s_in_job`,
    `resume_s_restart`: injection to TrainingResumed; `resume_after_detect_s_*`: detection
    event to TrainingResumed), with each mode's raw runs and load averages."""
    out: dict[str, Any] = {"runs_per_fault": runs, "by_kind": {}}
    if runs < 5:
        out["note"] = f"{runs} faults per kind and mode: fewer than 5 (a shorter run)"
    for kind in MODE_KINDS:
        row: dict[str, Any] = {}
        for mode, faults in by_mode.items():
            fs = [f for f in faults if f.kind == kind]
            after = [
                f.resume_s - f.detect_s
                for f in fs
                if f.resume_s is not None and f.detect_s is not None
            ]
            lost = [float(f.steps_lost) for f in fs if f.steps_lost is not None]
            row[f"resume_s_{mode}"] = _median([f.resume_s for f in fs])
            row[f"detect_s_{mode}"] = _median([f.detect_s for f in fs])
            row[f"resume_after_detect_s_{mode}"] = _median(list(after))
            row[f"steps_lost_{mode}"] = _median(list(lost))
            if mode == "replica":  # the grow-back that followed: its own pause
                row["rejoin_pause_s_replica"] = _median([f.rejoin_pause_s for f in fs])
                row["rejoin_s_replica"] = _median([f.rejoin_s for f in fs])
            row[f"runs_{mode}"] = len(fs)
            row[f"resolved_{mode}"] = sum(f.resolved for f in fs)
            row[f"load1_median_{mode}"] = statistics.median(f.load1 for f in fs) if fs else None
            row[f"breakdown_s_{mode}"] = {
                p: _median([f.phases.get(p) for f in fs]) for p in BREAKDOWN
            }
            row[f"raw_{mode}"] = [asdict(f) for f in fs]
        out["by_kind"][kind] = row
    return out


def mode_ratios(modes: dict[str, Any]) -> dict[str, float]:
    """`<kind>_in_job_vs_restart_ratio`: the in-job resume median over the restart's, for each
    fault kind the run measured in both modes (under 1: in-job recovery is faster)."""
    out: dict[str, float] = {}
    for kind, row in modes.get("by_kind", {}).items():
        a, b = row.get("resume_s_in_job"), row.get("resume_s_restart")
        if a and b:
            out[f"{kind}_in_job_vs_restart_ratio"] = round(a / b, 3)
    return out


#: What describes a whole run (its settings and load): a run of the modes phase alone keeps
#: the earlier run's under these keys (its figures are theirs) and puts its own in `modes`.
RUN_KEYS = (
    "quick", "runs_per_fault", "seed", "warm_nice", "agent_flags", "miss_limit", "device",
    "hang_floor_ms", "load1_start", "load1_end", "bench_s", "errors", "phases_run",
)  # fmt: skip


def merged(prev: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """`out` over the figures of an earlier run (`prev`): a run of some phases keeps the
    others' figures (an empty or None value of `out` does not replace one of `prev`, but
    `errors` are always the run's own); a run of the modes phase alone keeps the earlier
    run's settings (`RUN_KEYS`) and files its own under `modes.run`."""
    out = dict(out)
    if prev and set(out.get("phases_run", ())) <= {"modes"} and "modes" in out:
        run = {k: out.pop(k) for k in RUN_KEYS if k in out}
        out["modes"] = {**out["modes"], "run": run}
    # a run's errors are its own: its empty list replaces an older run's (the file showed
    # an old run's job failure under later runs that had none)
    keep = {k: v for k, v in prev.items() if out.get(k) in (None, {}, []) and k != "errors"}
    return {**prev, **out, **keep}


def _previous(path: str) -> dict[str, Any]:
    try:
        prev = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return prev if isinstance(prev, dict) else {}


def summarize(faults: list[Fault]) -> dict[str, Any]:
    """Per fault type: medians of detect_s, resume_s, steps_lost and the raw runs."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        fs = [f for f in faults if f.kind == kind]
        if not fs:
            continue
        lost = _median([float(f.steps_lost) if f.steps_lost is not None else None for f in fs])
        out[kind] = {
            "detect_s": _median([f.detect_s for f in fs]),
            "resume_s": _median([f.resume_s for f in fs]),
            "steps_lost": lost,
            "runs": len(fs),
            "resolved": sum(f.resolved for f in fs),
            "load1_median": statistics.median(f.load1 for f in fs),
            "raw": [asdict(f) for f in fs],
        }
        if kind == "driver_kill":
            out[kind]["note"] = "training never pauses: workers do not depend on the driver"
    return out


def _device_facts(device: str) -> dict[str, Any]:
    """The GPU and the torch build a cuda run used (nothing on CPU)."""
    if device != "cuda":
        return {}
    import torch

    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "nccl": nccl}


async def run(ns: argparse.Namespace) -> dict[str, Any]:
    runs, say = ns.runs, print
    root = Path(ns.run_dir)
    prev = _previous(ns.out)
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "command": " ".join([".venv/bin/python bench/recovery.py", *sys.argv[1:]]),
        "phases_run": sorted(ns.phases),
        "quick": ns.quick,
        "runs_per_fault": runs,
        "seed": ns.seed,
        "warm_nice": ns.warm_nice,
        "agent_flags": ns.agent_flags,
        "miss_limit": ns.miss_limit,
        "device": ns.device,
        **_device_facts(ns.device),
        "hang_floor_ms": HANG_FLOOR_MS,
        "cluster": "2 nodes x 1 worker (tiny gpt3d, dp2) + spare, leader + standby driver",
        "load1_start": os.getloadavg()[0],
        "cores": os.cpu_count(),
        "errors": [],
        "faults": {},
        "cold": {},
    }

    def save() -> None:  # after every phase, so a run cut short still leaves its figures
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({**merged(prev, out), "partial": True}, indent=1)
        Path(ns.out).write_text(text + "\n")

    async def in_cluster(
        name: str,
        warm: bool,
        body: Any,
        flash: bool = True,
        flash_ab: int = 0,
        driver_flags: tuple[str, ...] = (),
    ) -> None:
        """Run `body(bench)` on a fresh cluster; a failed job ends only this phase."""
        b = Bench(
            root / name,
            driver_flags=driver_flags,
            warm=warm,
            log=say,
            warm_nice=ns.warm_nice,
            flash=flash,
            miss_limit=ns.miss_limit,
            flash_ab=flash_ab,
            agent_flags=tuple(ns.agent_flags),
            device=ns.device,
        )
        try:
            await b.start()
            await b.wait_for("standbys", b._standbys_ready, 90)
            await body(b)
        except JobFailed as e:
            out["errors"].append(f"{name}: job failed: {e}")
            say(f"  {name}: job failed: {e}")
        finally:
            await b.close()
            save()

    def series(kinds: list[str], into: list[Fault]) -> Any:
        async def body(b: Bench) -> None:
            while kinds:
                f = await b.one(kinds[0])
                kinds.pop(0)
                if f is not None:
                    into.append(f)

        return body

    if "cold" in ns.phases:
        say(f"== cold restarts (--no-warm-workers): worker crash x{runs}")
        cold: list[Fault] = []
        todo = ["worker_crash"] * runs
        for attempt in range(2):
            if todo:
                await in_cluster(f"cold-{attempt}", False, series(todo, cold))
        out["cold"] = summarize(cold)

    if "modes" in ns.phases:
        # in-job recovery against a restart of every process, the same faults, one run
        kinds = [k for k in MODE_KINDS if k in ns.kinds]
        say(f"== recovery modes: {' vs '.join(ns.modes)}, {','.join(kinds)} x{runs} each")
        by_mode: dict[str, list[Fault]] = {}
        replica = ("--keep-training", "--replica-rejoin-s", str(ns.replica_rejoin_s))
        window = ("--fault-window-steps", str(MODES_FAULT_WINDOW_STEPS))
        for mode, flags in (("in_job", ()), ("restart", ("--no-in-job",)), ("replica", replica)):
            if mode not in ns.modes:
                continue
            flags = (*flags, *window)
            done: list[Fault] = []
            todo = [k for _ in range(runs) for k in kinds]  # interleaved: same load
            for attempt in range(3):
                if todo:
                    await in_cluster(
                        f"{mode}-{attempt}", True, series(todo, done), driver_flags=flags
                    )
            by_mode[mode] = done
            out["modes"] = modes_summary(by_mode, runs)
            out.update(mode_ratios(out["modes"]))
            for mode_ in by_mode:  # the figures, per fault kind
                out[f"resume_s_{mode_}"] = {
                    k: r[f"resume_s_{mode_}"] for k, r in out["modes"]["by_kind"].items()
                }
            save()  # each mode's figures as soon as they are in
        out["modes_run"] = {  # this run of the modes phase (a later one of others keeps it)
            "date": out["date"],
            "command": out["command"],
            "load1_start": out["load1_start"],
            "load1_end": os.getloadavg()[0],
            "modes": list(ns.modes),
            "kinds": kinds,
            "runs_per_fault": runs,
        }
        for kind, row in out["modes"]["by_kind"].items():
            say(
                f"  {kind:13s} resume in-job {_fmt(row.get('resume_s_in_job'))} restart "
                f"{_fmt(row.get('resume_s_restart'))} replica {_fmt(row.get('resume_s_replica'))} "
                f"(after detection: in-job {_fmt(row.get('resume_after_detect_s_in_job'))}; "
                f"the replica's rejoin pause {_fmt(row.get('rejoin_pause_s_replica'))})"
            )
        save()

    if "faults" in ns.phases:
        say(f"== warm standbys: fault-free {ns.baseline_s:.0f} s, then each fault x{runs}")
        seq: list[Fault] = []
        todo = [k for k in ns.kinds for _ in range(runs)]

        async def baseline(b: Bench) -> None:
            out["fault_free"] = await b.steady(ns.baseline_s)
            say(f"  ETTR fault-free {out['fault_free']['ettr']:.3f}")
            await series(todo, seq)(b)

        await in_cluster("faults-0", True, baseline)
        for attempt in (1, 2):
            if todo:
                await in_cluster(f"faults-{attempt}", True, series(todo, seq))
        out["faults"] = summarize(seq)

    if "ettr" in ns.phases:
        fresh: dict[str, Any] = {}
        for mtbf_s in ns.mtbf:
            say(f"== faults at MTBF {mtbf_s} s for {ns.ettr_s:.0f} s")

            async def ettr(b: Bench, mtbf_s: int = mtbf_s) -> None:
                if "faults" not in ns.phases and "fault_free" not in fresh:
                    # the baseline of this run's code and host (the faults phase has its own)
                    fresh["fault_free"] = out["fault_free"] = await b.steady(ns.baseline_s)
                    say(f"  ETTR fault-free {out['fault_free']['ettr']:.3f}")
                r = await b.mtbf(mtbf_s, ns.ettr_s, ns.seed + mtbf_s)
                out[f"mtbf_{mtbf_s}s"] = r
                out[f"ettr_mtbf_{mtbf_s}s"] = r["ettr"]
                out[f"ettr_step_time_mtbf_{mtbf_s}s"] = r["ettr_step_time"]
                out[f"ettr_to_report_mtbf_{mtbf_s}s"] = r["ettr_to_report"]
                say(f"  ETTR at MTBF {mtbf_s} s: {r['ettr']:.3f} ({r['faults']} faults)")

            await in_cluster(f"mtbf-{mtbf_s}", True, ettr)

    if "ab" in ns.phases:
        say(
            f"== throughput in one run: flash saves in alternating {AB_BLOCK}-step blocks, "
            f"{ns.baseline_s:.0f} s per cluster x{ns.throughput_rounds}"
        )
        ab: list[dict[str, Any]] = []
        for attempt in range(ns.throughput_rounds):

            async def blocks(b: Bench) -> None:
                t0 = time.monotonic()  # `steady` polls first, then trains for baseline_s
                await b.steady(ns.baseline_s)
                r = {
                    **b.steps.ab_rates(t0, time.monotonic(), AB_BLOCK),
                    "load1": os.getloadavg()[0],
                }
                ab.append(r)
                say(
                    f"  on {r['steps_per_s_with_flash'] or 0:.2f} / off "
                    f"{r['steps_per_s_without_flash'] or 0:.2f} steps/s: ratio "
                    f"{r['ratio'] or 0:.3f} (block pairs' median "
                    f"{r['block_pair_ratio_median'] or 0:.3f})"
                )

            await in_cluster(f"ab-{attempt}", True, blocks, flash_ab=AB_BLOCK)
        ratios = [r["ratio"] for r in ab if r["ratio"]]
        out["throughput_ab_runs"] = ab
        if ratios:
            # the figure: steps per wall second of the same run with and without
            # flash saves (the median over clusters of each run's ratio)
            out["throughput_with_flash_vs_without"] = statistics.median(ratios)
            out["throughput_method"] = (
                f"one run per cluster, flash saves on and off in alternating {AB_BLOCK}-step "
                f"blocks (first {AB_SETTLE} steps of each block left out); median of "
                f"{len(ratios)} clusters"
            )

    if "throughput" in ns.phases:
        say(f"== throughput: fault-free {ns.baseline_s:.0f} s with flash saves, then without")
        rates: dict[bool, list[float]] = {True: [], False: []}
        for attempt in range(ns.throughput_rounds):
            for flash in (True, False):

                async def steady(b: Bench, flash: bool = flash) -> None:
                    r = await b.steady(ns.baseline_s)
                    rates[flash].append(r["steps"] / r["wall_s"])
                    runs = "fault_free_flash_runs" if flash else "fault_free_no_flash_runs"
                    out.setdefault(runs, []).append(r)
                    say(f"  flash {'on ' if flash else 'off'}: {rates[flash][-1]:.2f} steps/s")

                label = "on" if flash else "off"
                await in_cluster(f"throughput-{label}-{attempt}", True, steady, flash=flash)
        if rates[True] and rates[False]:
            on, off = statistics.median(rates[True]), statistics.median(rates[False])
            out["steps_per_s_with_flash"] = on
            out["steps_per_s_without_flash"] = off
            # separate clusters minutes apart: the host's drift between them is in it
            out["throughput_clusters_with_vs_without"] = on / off
            # each round's on/off pair ran minutes apart at most: on a noisy host the median
            # of the pairs' ratios is the steadier figure (both are reported)
            pairs = [a / b for a, b in zip(rates[True], rates[False], strict=False)]
            out["throughput_pair_ratios"] = pairs
            out["throughput_pair_ratio_median"] = statistics.median(pairs)

    base = out.get("fault_free", {}).get("ettr")
    for mtbf_s in (60, 20):
        got = out.setdefault(f"ettr_mtbf_{mtbf_s}s", None)
        out[f"ettr_mtbf_{mtbf_s}s_vs_fault_free"] = got / base if got and base else None
    c = out["cold"].get("worker_crash", {}).get("resume_s")
    w = out["faults"].get("worker_crash", {}).get("resume_s")
    if c or w:  # a run of other phases keeps the earlier figure
        out["worker_crash_resume_s"] = {
            "cold": c,
            "warm": w,
            "cold_over_warm": c / w if c and w else None,
        }
    out["not_injected"] = NOT_INJECTED
    return out


def table(out: dict[str, Any]) -> str:
    """The README table (markdown)."""
    rows = [
        "| fault | detect (median) | resume (median) | steps lost (median) | runs |",
        "|---|---|---|---|---|",
    ]
    names = {
        "worker_crash": "worker SIGKILL",
        "node_loss": "node lost (agent SIGKILL)",
        "hang": f"hang (worker SIGSTOP, floor {HANG_FLOOR_MS / 1000:.0f} s)",
        "loss_spike": "loss spike (injected at a step)",
        "silently_bad_node": "silently bad node (wrong matmul, self-check)",
        "driver_kill": "leader driver SIGKILL",
    }

    def cell(x: float | None, unit: str = " s") -> str:
        return "-" if x is None else f"{x:.2f}{unit}"

    for kind, r in out["faults"].items():
        rows.append(
            f"| {names[kind]} | {cell(r['detect_s'])} | {cell(r['resume_s'])} | "
            f"{cell(r['steps_lost'], '')} | {r['resolved']}/{r['runs']} |"
        )
    for kind, r in out["cold"].items():
        rows.append(
            f"| {names[kind]}, cold restart (--no-warm-workers) | {cell(r['detect_s'])} | "
            f"{cell(r['resume_s'])} | {cell(r['steps_lost'], '')} | "
            f"{r['resolved']}/{r['runs']} |"
        )
    for err in out.get("errors", []):
        rows.append(f"| error | {err} | | | |")
    for kind, why in out["not_injected"].items():
        rows.append(f"| {kind.replace('_', ' ')} | not measured: {why} | | | |")
    ff = out.get("fault_free", {}).get("ettr")
    rows += [
        "",
        "| run | ETTR | vs fault-free | faults injected | unresolved | false NodeLost |",
        "|---|---|---|---|---|---|",
        f"| fault-free | {cell(ff, '')} | 1.00 | 0 | | |",
    ]
    for m in (60, 20):
        r = out.get(f"mtbf_{m}s")
        if r is None:
            rows.append(f"| MTBF {m} s | not run | | | | |")
            continue
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["by_kind"].items()))
        false_lost = len(r.get("false_node_lost", ())) if "false_node_lost" in r else "-"
        rows.append(
            f"| MTBF {m} s, {r['wall_s'] / 60:.0f} min | {r['ettr']:.3f} | "
            f"{cell(r['ettr'] / ff if ff else None, '')} | {r['faults']} ({kinds}) | "
            f"{r['unresolved']} | {false_lost} |"
        )
    tp = out.get("throughput_with_flash_vs_without")
    if tp:
        rows.append("")
        rows.append(
            f"Fault-free throughput with a flash save every step against none, in the same "
            f"run ({out['throughput_method']}): ratio {tp:.3f}."
        )
    tc = out.get("throughput_clusters_with_vs_without")
    if tc:
        rows.append("")
        rows.append(
            f"The same from separate clusters: {out['steps_per_s_with_flash']:.2f} steps/s "
            f"with flash saves against {out['steps_per_s_without_flash']:.2f} without "
            f"(ratio {tc:.3f}; pairs' median {out['throughput_pair_ratio_median']:.3f})."
        )
    cw = out.get("worker_crash_resume_s") or {}  # absent from a file of the modes alone
    if cw.get("cold_over_warm"):
        rows.append("")
        rows.append(
            f"Worker crash → training resumed: cold {cw['cold']:.2f} s, warm {cw['warm']:.2f} s "
            f"(cold / warm = {cw['cold_over_warm']:.2f})."
        )
    return "\n".join(rows)


async def _cancel_on_sigterm(coro: Any) -> Any:
    """Run `coro`; SIGTERM cancels it, so every cluster is stopped by its `finally`."""
    task = asyncio.ensure_future(coro)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 runs per fault, 90 s ETTR runs")
    parser.add_argument("--runs", type=int, default=None, help="runs per fault type (default 5)")
    parser.add_argument("--ettr-s", type=float, default=None, help="length of an ETTR run")
    parser.add_argument("--baseline-s", type=float, default=None, help="fault-free stretch")
    parser.add_argument("--seed", type=int, default=7, help="seed of the fault arrivals")
    parser.add_argument("--run-dir", default="", help="logs (default: runs/bench-recovery-*)")
    parser.add_argument("--out", default=str(RESULTS), help="results JSON")
    parser.add_argument("--kinds", default=",".join(KINDS), help="fault types of the faults phase")
    parser.add_argument(
        "--warm-nice", type=int, default=None, help="agents' --warm-nice (default: theirs)"
    )
    parser.add_argument(
        "--phases",
        default="modes,cold,faults,ettr,ab,throughput",
        help="comma-separated subset of modes,cold,faults,ettr,ab,throughput (modes: in-job "
        "recovery against a restart of every process, the same faults; ab: flash saves on "
        "and off in alternating blocks of one run; throughput: separate clusters)",
    )
    parser.add_argument(
        "--modes",
        default="in_job,restart,replica",
        help="the recovery modes the modes phase compares (in_job, restart, replica: "
        "in-job with the replica policy, --keep-training)",
    )
    parser.add_argument(
        "--miss-limit", type=int, default=MISS_LIMIT, help="the drivers' --miss-limit"
    )
    parser.add_argument(
        "--agent-flags",
        default="",
        help='more flags for every agent, one string: --agent-flags="--flash-poll-ms 2000"',
    )
    parser.add_argument(
        "--mtbf",
        default="60,20",
        help="the ettr phase's mean times between faults, in seconds (comma-separated)",
    )
    parser.add_argument(
        "--replica-rejoin-s",
        type=float,
        default=3.0,
        help="the replica mode's --replica-rejoin-s (how long a replica sits out)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the workers train: cuda puts every node's worker on GPU 0 (nccl; each "
        "node its own NCCL host); write to another --out, the CPU figures stay",
    )
    parser.add_argument(
        "--throughput-rounds",
        type=int,
        default=2,
        help="clusters per mode (throughput phase), clusters (ab phase)",
    )
    ns = parser.parse_args(argv)
    ns.runs = ns.runs or (2 if ns.quick else 5)
    ns.ettr_s = ns.ettr_s or (90.0 if ns.quick else 600.0)
    ns.baseline_s = ns.baseline_s or (30.0 if ns.quick else 180.0)
    if ns.runs < 1 or ns.ettr_s < 10 or ns.baseline_s < 5:
        print("error: --runs must be >= 1, --ettr-s >= 10, --baseline-s >= 5", file=sys.stderr)
        return 2
    try:
        ns.mtbf = [int(x) for x in ns.mtbf.split(",") if x]
    except ValueError:
        ns.mtbf = []
    if not ns.mtbf or min(ns.mtbf) < 1:
        print("error: --mtbf takes whole seconds >= 1, comma-separated", file=sys.stderr)
        return 2
    ns.kinds = [k for k in ns.kinds.split(",") if k]
    if not set(ns.kinds) <= set(KINDS):
        print(f"error: --kinds takes {','.join(KINDS)}", file=sys.stderr)
        return 2
    ns.agent_flags = shlex.split(ns.agent_flags)
    ns.modes = [m for m in ns.modes.split(",") if m]
    if not set(ns.modes) <= {"in_job", "restart", "replica"} or not ns.modes:
        print("error: --modes takes in_job, restart and/or replica", file=sys.stderr)
        return 2
    ns.phases = set(ns.phases.split(","))
    if not ns.phases <= {"modes", "cold", "faults", "ettr", "throughput", "ab"}:
        print("error: --phases takes modes, cold, faults, ettr, throughput and ab", file=sys.stderr)
        return 2
    ns.run_dir = ns.run_dir or time.strftime("runs/bench-recovery-%Y%m%d-%H%M%S")
    if Path(ns.run_dir).is_dir() and any(Path(ns.run_dir).iterdir()):
        # its clusters' etcd data would be used again: the drivers replayed the earlier
        # run's job (its steps, nodes and checkpoints), and a node loss "lost" 394 steps
        print(
            f"error: --run-dir {ns.run_dir} holds an earlier run (its etcd would be replayed);"
            " name a new or empty directory",
            file=sys.stderr,
        )
        return 2
    t0 = time.monotonic()
    try:
        out = asyncio.run(_cancel_on_sigterm(run(ns)))
    except asyncio.CancelledError:
        print(f"interrupted: every cluster stopped; partial figures in {ns.out}", file=sys.stderr)
        return 130
    bench_s = out["bench_s"] = time.monotonic() - t0
    out["load1_end"] = os.getloadavg()[0]
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    prev = {k: v for k, v in _previous(ns.out).items() if k != "partial"}
    out = merged(prev, out)
    out.pop("partial", None)
    Path(ns.out).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    print(f"wrote {ns.out} ({bench_s / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
