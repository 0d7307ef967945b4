"""The fault drill of `unbroken up`: inject one fault at a time, measure what the log says.

Each fault is injected once training runs and the previous one is over; its record is
filled from the event log as it grows (`Drill.observe`) and the live view (`Drill.advance`):
the time to detect it (the proving event's own wall time minus the injection's), the time
until training resumed (TrainingResumed), the steps lost (TrainingPaused.at_step minus the
step rank 0 really restored, read from its worker log: the machine's restore step is the
newest *committed* one, while workers restore the newest step in flash memory), whether
the loss curve continued (the loss 3 steps after the resume within `LOSS_BAND` of the loss
before the fault) and the events written from the injection to the resume. `up.py` owns the
processes (a `LocalCluster`); this module picks the targets, injects through `Faults` and
measures from the log with cli/faults.py's table of which event proves which fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.cli.cluster import LocalCluster, LogWatch
from unbroken.cli.faults import Faults, Injection, proof, proves
from unbroken.driver.straggler import StragglerConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

RESUME_LIMIT_S = 120.0  # a drilled fault whose training has not resumed by then failed
DETECT_LIMIT_S = 60.0  # ... or whose event has not come by then
GAP_S = 4.0  # between the end of one fault and the next injection
DRILL = (
    "worker_crash",
    "node_loss",
    "hang",
    "loss_spike",
    "bad_node",
    "straggler",
    "driver_kill",
    "driver_kill_mid_recovery",
)
LOSS_BAND = (0.5, 1.5)  # loss after the resume / before the fault: the curve continued
LOSS_AFTER_STEPS = 3
SPIKE_AHEAD = 1  # the loss-spike fault hits the next step ("detected in" includes its wait)
# ... and waits for this step: the detector's baseline needs the early descent behind it
SPIKE_MIN_STEP = 30
STRAGGLER_FACTOR = 1.2  # the straggler fault: one world node computes 20 % slower
STRAGGLER_WARM_STEPS = 64  # steps in every worker's window (a full one) before it is injected
# and the detector's baselines taken (its settle sweeps, a window's lag, its baseline sweeps:
# `StragglerConfig.role_s`)
STRAGGLER_DETECT_LIMIT_S = 180.0  # its windows must fill and shift first (driver/straggler.py)
RESPAWN_DRIVER_S = 8.0  # a killed driver restarts this long after (its lease is 2 s)
# A fault whose ranks go to an idle node (a node loss, a bad node) waits up to this long for
# an idle node whose standbys are ready, as a real cluster's spare has them minutes before
# it is needed: on 2 cores the standbys of the drill's spares (started 12 s after their
# agents, not to slow the first step) took 15-19 s to import beside the training, and a
# node loss 28 s in was resumed by processes still importing (4.4-4.8 s, not 1.5)
WARM_SPARE_LIMIT_S = 45.0
# ...and so does every fault that starts processes: a crashed or hung rank's node takes a
# standby too (the 19:25 drill's first crash, 4 s after the node's standbys started, took
# 6.2 s, where a ready standby takes 1.3-1.6). bench-recovery waits for them likewise.
WARM_SPARE_KINDS = ("worker_crash", "node_loss", "hang", "bad_node", "straggler")
_PID = re.compile(r"\bpid=(\d+)")
# A fault given up while the host's 1-minute load average was above this many runnable tasks
# per core is not judged: on such a host a worker's start-up (importing torch) or a late
# heartbeat takes minutes, and the drill's limits measure the host, not the recovery.
OVERLOAD_PER_CORE = 4.0
RESTORED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\S*).*flash\.restored.*\brank=0\b.*\bstep=(\d+)", re.M
)


@dataclass(slots=True)
class FaultRecord:
    """One drilled fault and what the log said about it."""

    fault: str
    target: str
    injected_at: float  # monotonic
    expect: str  # payload name of the event that proves detection
    kind: str = ""  # the drill's fault (DRILL), whose proof is in cli/faults.py's table
    node: str = ""  # the node the proving event must name (when it names one)
    injection: Injection | None = None
    injected_wall_ns: int = 0
    step_at_inject: int = 0
    detected_s: float | None = None
    event_seq: int | None = None
    note: str = ""
    given_up: bool = False
    recovers: bool = False  # the recovery loop must resume training after it
    resumed_s: float | None = None
    steps_lost: int | None = None
    seq_at_inject: int = 0  # the newest event's seq when injected
    events_written: int | None = None  # from the injection to the resume (or detection)
    paused_at: int | None = None  # TrainingPaused.at_step of the incident
    log_restore: int | None = None  # TrainingPaused.restore_step (the driver's, from the rings)
    worker_restore: int | None = None  # the step rank 0 restored (its worker log)
    restores_at_inject: int = 0  # rank 0's flash.restored lines in the worker logs then
    loss_before: float | None = None
    resumed_step: int | None = None
    mode: str = ""  # TrainingResumed.mode: "in_job" or "restart"
    loss_after: float | None = None
    skipped: bool = False  # not injectable here (the note says why)
    armed: bool = True  # False: the fault waits for a trigger (mid-recovery driver kill)
    detect_limit_s: float = DETECT_LIMIT_S
    load_peak: float = 0.0  # the highest 1-minute load average seen while it was open
    unjudged: bool = False  # given up on an overloaded host (the note says how busy)

    @property
    def continued(self) -> bool | None:
        """Whether the loss after the resume is in the band of the loss before the fault."""
        if self.loss_before is None or self.loss_after is None or self.loss_before <= 0:
            return None
        return LOSS_BAND[0] <= self.loss_after / self.loss_before <= LOSS_BAND[1]

    @property
    def over(self) -> bool:
        """Detected and (if it must be) resumed, given up, or skipped."""
        if self.skipped or self.given_up:
            return True
        if self.detected_s is None:
            return False
        return not self.recovers or (self.resumed_s is not None and self.loss_after is not None)


#: below this many columns the drill's table drops its wide columns (loss, events, proof)
WIDE_TABLE = 120
#: a note column narrower than this is no column: the notes go under the table instead
MIN_NOTE_WIDTH = 30


def fault_table(faults: list[FaultRecord], width: int = WIDE_TABLE, *, rows: bool = False) -> Any:
    """The drill's table (rich); on a terminal narrower than `WIDE_TABLE` columns, only
    fault, target, detected, resumed, steps lost and the note (fits 80 columns). Where the
    other columns leave the notes less than `MIN_NOTE_WIDTH`, they follow the table, one
    line per fault (at 160 columns the wide table left them none: a log showed no note).

    Args:
        faults: the drilled faults.
        width: the terminal's width.
        rows: one line per fault (the live view: notes cut short, always in the table),
            else notes wrap.
    """
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    wide = width >= WIDE_TABLE
    t = Table(
        title="drill",
        title_justify="left",
        pad_edge=False,
        box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
    )
    cols = ["fault", "target", "detected in", "resumed in", "mode", "steps lost"]
    if not wide:
        cols = ["fault", "target", "detected", "resumed", "mode", "lost"]
    if wide:
        cols += ["loss continued", "events", "event (seq)"]
    body = [_cells(f, len(cols), wide) for f in faults]
    noted = any(note for _, note in body)
    used = sum(
        max(Text.from_markup(c).cell_len for c in [col, *(cells[i] for cells, _ in body)])
        for i, col in enumerate(cols)
    )
    inline = noted and (rows or width - used - 3 * (len(cols) + 1) >= MIN_NOTE_WIDTH)
    for col in cols:
        t.add_column(col, no_wrap=True)
    if inline:
        t.add_column("note", no_wrap=rows, overflow="ellipsis" if rows else "fold", ratio=1)
    for cells, note in body:
        t.add_row(*cells, *([note] if inline else []))
    if inline or not noted:
        return t
    below = [Text.from_markup(f"{escape(cells[0])}: {note}") for cells, note in body if note]
    return Group(t, *below)


def _cells(f: FaultRecord, ncols: int, wide: bool) -> tuple[list[str], str]:
    """One fault's table cells (rich markup) and its note."""
    if f.skipped:
        return [f.fault, f.target, *["-"] * (ncols - 2)], f"[yellow]skipped[/]: {f.note}"
    det = f"{f.detected_s:.2f} s" if f.detected_s is not None else "[red]not yet[/]"
    res = lost = cont = mode = "-"
    if f.recovers:
        mode = f.mode.replace("_", "-") or "-"
        res = f"{f.resumed_s:.2f} s" if f.resumed_s is not None else "[red]not yet[/]"
        lost = str(f.steps_lost) if f.steps_lost is not None else "?"
        restored, paused = f.log_restore, f.paused_at
        if restored is not None and paused is not None and f.worker_restore not in (None, restored):
            lost += f" [yellow](log said {paused - restored})[/]"
        c = f.continued
        if c is not None and f.loss_before is not None and f.loss_after is not None:
            cont = f"{'yes' if c else '[red]no[/]'} ({f.loss_before:.2f} → {f.loss_after:.2f})"
    row = [f.fault, f.target, det, res, mode, lost]
    if wide:
        evs = str(f.events_written) if f.events_written is not None else "-"
        row += [cont, evs, f"{f.expect} ({f.event_seq or '-'})"]
    elif f.recovers and f.continued is False:
        row[-1] += " [red]loss jumped[/]"
    return row, (f"[yellow]{f.note}[/]" if f.unjudged and f.note else f.note)


def rank0_restores(run: Path) -> list[int]:
    """Steps rank 0 restored, oldest first, from every worker log of the run.

    Ordered by each line's own time, then its place in its log: a node's log file holds
    every worker that had its local rank, so rank 0's restores of a node that left and came
    back sit in a file written to later (a file's mtime does not order its lines).
    """
    out: list[tuple[str, int, int]] = []
    for log in sorted(run.glob("workers/*/worker-*.log")):
        with contextlib.suppress(OSError):
            for i, m in enumerate(RESTORED.finditer(log.read_text(errors="replace"))):
                out.append((m.group(1), i, int(m.group(2))))
    return [s for *_, s in sorted(out)]


def host_load() -> float:
    """The host's 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def judge_load(f: FaultRecord, cores: int | None = None, load: float | None = None) -> None:
    """Mark a fault given up (or still open when the drill ended) not judged when the host
    was overloaded while it was open (its note then starts with how busy)."""
    cores = cores or os.cpu_count() or 1
    f.load_peak = max(f.load_peak, host_load() if load is None else load)
    if f.load_peak > OVERLOAD_PER_CORE * cores and not f.unjudged:
        f.unjudged = True
        f.note = (
            f"not judged: load {f.load_peak:.0f} on {cores} cores "
            f"(over {OVERLOAD_PER_CORE:.0f} per core); {f.note}"
        )


def ready_standbys(agent_log: str) -> int:
    """How many standbys the agent whose log this is holds ready now: those it logged
    `standby ready` since it last started (`flash.ready`), less those handed off since
    (`worker started` with the same pid) or discarded."""
    ready: set[str] = set()
    for line in agent_log[max(agent_log.rfind("flash.ready"), 0) :].splitlines():
        m = _PID.search(line)
        if m is None:
            continue
        if "standby ready" in line:
            ready.add(m.group(1))
        elif "worker started" in line or "standby discarded" in line:
            ready.discard(m.group(1))
    return len(ready)


class Drill:
    """Injects one fault at a time once training runs, and measures each from the log."""

    def __init__(
        self,
        c: LocalCluster,
        w: LogWatch,
        faults: list[FaultRecord],
        plan: tuple[str, ...] = DRILL,
        hang_floor_s: float = 1.0,
    ) -> None:
        self.c, self.w, self.faults = c, w, faults
        self.inject = Faults(c, watch=w)
        self.plan = list(plan)
        self.hang_floor_s = hang_floor_s
        self.next_at = 0.0
        self.done = False
        self._windows_full_at: float | None = None  # when the straggler's windows filled
        self._warm_since: float | None = None  # the next fault's wait for a warm spare began
        self._warm_wait_s = 0.0

    # ------------------------------------------------------------ measuring
    def observe(self, new: list[ev.Event], now: float) -> None:
        """Fill the records from newly appended events."""
        for e in new:
            kind = e.WhichOneof("payload")
            for f in self.faults:
                if f.skipped or f.given_up or e.seq <= f.seq_at_inject:
                    continue
                if kind == "training_paused" and f.recovers and f.resumed_s is None:
                    f.paused_at = e.training_paused.at_step  # the incident's last pause counts
                    f.log_restore = e.training_paused.restore_step
                if not f.armed:
                    if kind == "training_paused":  # the mid-recovery moment: kill the leader
                        self._kill_leader_now(f, now)
                    continue
                if f.detected_s is None:
                    if proves(e, f.kind, f.node):
                        # the event's own wall time: exact, not bounded by our polling
                        f.detected_s = max(0.0, (e.wall_time_unix_ns - f.injected_wall_ns) / 1e9)
                        f.event_seq = e.seq
                        if not f.recovers:
                            f.events_written = e.seq - f.seq_at_inject
                    continue
                if not f.recovers or f.resumed_s is not None:
                    continue
                if kind == "training_resumed":
                    f.resumed_s = max(0.0, (e.wall_time_unix_ns - f.injected_wall_ns) / 1e9)
                    f.resumed_step = e.training_resumed.at_step
                    f.mode = e.training_resumed.mode
                    f.events_written = e.seq - f.seq_at_inject
                    if f.kind == "straggler" and f.detected_s is not None:  # it never stopped
                        f.note += (
                            f"; resumed {f.resumed_s - f.detected_s:.2f} s after it was named"
                            " (the job trained on, slower, until then)"
                        )

    def _measure_after_resume(self, f: FaultRecord) -> None:
        if f.resumed_step is None or f.loss_after is not None:
            return
        restores = rank0_restores(self.c.run)
        restored = restores[-1] if len(restores) > f.restores_at_inject else f.resumed_step
        f.worker_restore = restored
        if f.paused_at is not None:
            # exact: the driver restores the newest step every rank holds (ring steps in the
            # heartbeats); rank 0's own log says which step it really restored
            f.steps_lost = max(0, f.paused_at - restored)
        if self.w.step() >= restored + LOSS_AFTER_STEPS:
            f.loss_after = self.w.loss()

    # ------------------------------------------------------------ injecting
    async def advance(self, now: float) -> None:
        """Give up on overdue faults, finish measuring, inject the next fault when due."""
        for f in self.faults:
            if f.over:
                continue
            f.load_peak = max(f.load_peak, host_load())
            if f.injection is not None and f.injection.note and f.detected_s is None:
                f.skipped, f.note = True, f.injection.note[:70]  # (no self-check)
            elif f.recovers and f.resumed_s is not None:
                self._measure_after_resume(f)
                if f.loss_after is None and now - f.injected_at > RESUME_LIMIT_S:
                    f.note += "; no steps after the resume"
                    f.given_up = True
            elif f.detected_s is None and now - f.injected_at > f.detect_limit_s:
                f.note += f"; no {f.expect} within {f.detect_limit_s:.0f} s"
                f.given_up = True
            elif now - f.injected_at > RESUME_LIMIT_S + f.detect_limit_s - DETECT_LIMIT_S:
                f.note += f"; training did not resume within {RESUME_LIMIT_S:.0f} s"
                f.given_up = True
            if f.given_up:
                judge_load(f)
            if f.over:
                self.next_at = now + GAP_S
            return  # one fault at a time
        if not self.plan and self.faults:  # the last one is over: no gap to wait out
            self.done = True
            return
        if now < self.next_at or self.w.step() < 10 or not self._running():
            return
        if not self.plan:
            self.done = True
            return
        if self.plan[0] in WARM_SPARE_KINDS and not self._spare_warm(now):
            return
        kind = self.plan.pop(0)
        f = await getattr(self, f"_inject_{kind}")(now)
        if f is not None:
            if self._warm_wait_s >= 1.0:
                f.note += f"; waited {self._warm_wait_s:.0f} s for a warm spare"
            self.faults.append(f)
            self.next_at = now + GAP_S
        self._warm_since, self._warm_wait_s = None, 0.0

    def _spare_warm(self, now: float) -> bool:
        """Whether every alive node (a world node replaces a crashed rank from its own
        standbys; the driver may take any idle one, a node back from a loss first) has a
        ready standby for every worker a node of the world runs, or the wait passed
        `WARM_SPARE_LIMIT_S` (then the fault goes in anyway, to cold processes). A run
        that keeps no standbys is not waited for."""
        if self._warm_since is None:
            self._warm_since = now
        self._warm_wait_s = now - self._warm_since
        if self._warm_wait_s > WARM_SPARE_LIMIT_S:
            return True
        per_node = max((len(n.workers) for n in self._world()), default=1)
        logs = {n.node_id: self.c.log(n.node_id) for n in self.w.nodes if n.alive}
        if not any("standby started" in text for text in logs.values()):
            return True  # this run keeps no standbys (--no-warm-workers on few cores)
        return all(ready_standbys(text) >= per_node for text in logs.values())

    def _running(self) -> bool:
        """The job trains: no incident is open (the log's newest phase change resumed it)."""
        for e in reversed(self.w.events):
            kind = e.WhichOneof("payload")
            if kind == "training_resumed":
                return True
            if kind == "recovery_transition":
                return e.recovery_transition.to_phase == ev.PHASE_RUNNING
            if kind in ("training_paused", "restore_started", "job_finished"):
                return False
        return False

    def _record(
        self, fault: str, target: str, kind: str, now: float, node: str = "", **kw: Any
    ) -> FaultRecord:
        p = proof(kind) if kind != "-" else None
        return FaultRecord(
            fault=fault,
            target=target,
            injected_at=now,
            expect=p.event if p is not None else "-",
            kind=kind,
            node=node,
            injected_wall_ns=time.time_ns(),
            step_at_inject=self.w.step(),
            seq_at_inject=self.w.events[-1].seq if self.w.events else 0,
            restores_at_inject=len(rank0_restores(self.c.run)),
            loss_before=self.w.loss(),
            **kw,
        )

    def _world(self) -> list[dpb.NodeLive]:
        return [n for n in self.w.nodes if n.alive and n.workers]

    def _worker_pid(self) -> tuple[str, int] | None:
        running = [(n.node_id, wk.pid) for n in self._world() for wk in n.workers if wk.pid]
        return running[-1] if running else None

    async def _inject_worker_crash(self, now: float) -> FaultRecord | None:
        victim = self._worker_pid()
        if victim is None:
            return None
        self.inject.worker_kill(victim[0], pid=victim[1])
        return self._record(
            "worker SIGKILL", f"{victim[0]} pid {victim[1]}", "worker_crash", now, victim[0],
            note="it restarts, the others rejoin in place (in-job); all restore from flash memory",
            recovers=True,
        )  # fmt: skip

    async def _inject_node_loss(self, now: float) -> FaultRecord | None:
        spares = [n for n in self.c.agents if n.startswith("spare-")]
        working = [n.node_id for n in self._world()]
        gone = next((n for n in reversed(working) if n in self.c.agents), None)
        if gone is None:
            return None
        await asyncio.to_thread(self.inject.agent_kill, gone)
        f = self._record(
            "node lost (agent SIGKILL)", gone, "node_loss", now, gone, recovers=True,
            note="a spare takes its place" if spares else "no spare: the job shrinks",
        )  # fmt: skip
        # the node comes back later as an idle node the world can take (a replacement)
        asyncio.get_running_loop().call_later(15.0, self._respawn, gone)
        return f

    def _respawn(self, name: str) -> None:
        """A killed agent comes back; a killed driver as the standby, on its old address."""
        if self.c.stopping or self.c.alive(name):
            return
        self.c.respawn(name, wait_s=None)

    async def _inject_hang(self, now: float) -> FaultRecord | None:
        victim = self._worker_pid()
        if victim is None:
            return None
        self.inject.worker_stop(victim[0], pid=victim[1])
        return self._record(
            "hang (worker SIGSTOP)", f"{victim[0]} pid {victim[1]}", "hang", now, victim[0],
            note=f"found stopped (else: no progress for max({self.hang_floor_s:g} s, 5 steps)); "
            "it is replaced, the others rejoin in place",
            recovers=True,
        )  # fmt: skip

    async def _inject_straggler(self, now: float) -> FaultRecord | None:
        world = self._world()
        steps = [w.window_steps for n in world for w in n.workers]
        if not steps or min(steps) < STRAGGLER_WARM_STEPS:
            # not yet: the detector learns each node's usual cost from its first windows
            self._windows_full_at = None
            self.plan.insert(0, "straggler")
            return None
        if self._windows_full_at is None:
            self._windows_full_at = now
        if now - self._windows_full_at < StragglerConfig().role_s(
            w for n in world for w in n.workers
        ):
            # ...once a restart's transients have passed (`--straggler-settle-sweeps`)
            self.plan.insert(0, "straggler")
            return None
        target = world[0].node_id
        f = self._record(
            f"straggler (node {STRAGGLER_FACTOR - 1:.0%} slower)", target, "straggler",
            now, target, recovers=True, detect_limit_s=STRAGGLER_DETECT_LIMIT_S,
            note="named by the straggler sweep; evicted, a spare takes its ranks",
        )  # fmt: skip
        await asyncio.to_thread(self.inject.straggler, target, factor=STRAGGLER_FACTOR)
        if detail := self.inject.injections[-1].note:
            f.skipped, f.note = True, f"the driver cannot inject it ({detail[:60]})"
        return f

    async def _inject_loss_spike(self, now: float) -> FaultRecord | None:
        if self.w.step() < SPIKE_MIN_STEP:
            self.plan.insert(0, "loss_spike")  # not yet: asked again at the next poll
            return None
        nodes = [n.node_id for n in self._world()]
        f = self._record(
            "loss spike (poisoned batch)", ",".join(nodes), "loss_spike", now, recovers=True,
            note="rollback to the newest step before it every rank holds (ring, else a commit); "
            "batches skipped",
        )  # fmt: skip
        await asyncio.to_thread(self.inject.loss_spike, ahead=SPIKE_AHEAD)
        return f

    async def _inject_bad_node(self, now: float) -> FaultRecord | None:
        nodes = [n.node_id for n in self._world()]
        if not nodes:
            return None
        target = nodes[0]
        f = self._record(
            "silently bad node (wrong matmul)", target, "bad_node", now, target,
            recovers=True, note="found by its self-check",
        )  # fmt: skip
        # its self-check runs in the background: the live view keeps updating
        await asyncio.to_thread(self.inject.bad_matmul, target, check_timeout_s=90.0)
        f.injection = self.inject.injections[-1]
        if detail := f.injection.note:
            f.skipped, f.note = True, f"the driver cannot inject it ({detail[:60]})"
        return f

    async def _inject_driver_kill(self, now: float) -> FaultRecord | None:
        leader = self.w.leader
        if len(self.c.drivers) < 2 or not leader:
            return self._skip("driver SIGKILL", "needs a standby (--no-standby)", now)
        self.inject.driver_kill(leader, respawn=False)
        other = next(n for n in self.c.drivers if n != leader)
        f = self._record(
            "driver SIGKILL", leader, "driver_kill", now,
            note=f"standby {other} took over; training went on; {leader} restarts as standby",
        )  # fmt: skip
        # back as a standby once the election is over (not racing the standby for it)
        asyncio.get_running_loop().call_later(RESPAWN_DRIVER_S, self._respawn, leader)
        return f

    async def _inject_driver_kill_mid_recovery(self, now: float) -> FaultRecord | None:
        leader = self.w.leader
        standbys = [n for n in self.c.drivers if n != leader and self.c.alive(n)]
        if not leader or len(self.c.drivers) < 2:
            return self._skip("driver SIGKILL mid-recovery", "needs a standby (--no-standby)", now)
        if not standbys:  # the driver killed before is still restarting: ask again next poll
            self.plan.insert(0, "driver_kill_mid_recovery")
            return None
        victim = self._worker_pid()
        if victim is None:
            return None
        self.inject.worker_kill(victim[0], pid=victim[1])
        return self._record(
            "driver SIGKILL mid-recovery", leader, "driver_kill_mid_recovery", now,
            recovers=True, armed=False,
            note=f"worker {victim[0]} SIGKILLed; leader killed after TrainingPaused",
        )  # fmt: skip

    def _kill_leader_now(self, f: FaultRecord, now: float) -> None:
        if f.target in self.c.procs:
            self.inject.driver_kill(f.target, respawn=False)
        f.armed = True
        f.injected_at, f.injected_wall_ns = now, time.time_ns()

    def _skip(self, fault: str, why: str, now: float) -> FaultRecord:
        return self._record(fault, "-", "-", now, skipped=True, note=why)
