"""Worker supervision: spawn one process per local rank, log and scan its output, stop it.

Each worker gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, ...) plus the agent's part of
the environment contract (common/workerenv.py `WorkerEnv`: UNBROKEN_AGENT_SOCKET, the
local hooks channel; UNBROKEN_FAULT, the agent's injected fault, if any; ...). Its
stdout and stderr go to one log file per rank; every line is scanned for keywords and
a hit becomes an alert in the next heartbeat. Output is read in chunks, not lines, so an
absurdly long line cannot exhaust memory: it is cut at `max_line_chars`.

Workers must not outlive their agent, and must not starve it: each is started through an
exec wrapper, `setpriv --pdeathsig KILL` (util-linux; the kernel kills the worker when the
agent dies, even by SIGKILL) and `nice -n 5` (so the agent's 100 ms heartbeats keep the
CPU while 8 workers import torch on 2 cores). Both exec, so the worker keeps the pid the
agent spawned and the agent stays its parent. No `preexec_fn`: forking with a callback
while gRPC threads run crashed the agent (SIGSEGV). `UNBROKEN_AGENT_PID` lets the worker
(trainer/hooks.py) check that its parent is still the agent, closing the race in which
the agent dies between the fork and the prctl.

Each worker leads its own process group (the agent signals the group) inside the agent's
session, not a session of its own: Linux's autogroup scheduling (on by default, for
processes outside a cpu cgroup) shares the CPU fairly among sessions first and applies
niceness and SCHED_IDLE only within one. In sessions of their own, the workers' nice 5,
the agent's flash thread at nice 19 and the workers' copy threads at SCHED_IDLE all
competed with training as equals. The flash saves' cost with the ranks in sessions of
their own or in one (`make bench-sessions`) is within that bench's noise (README).

Before a worker is killed on command its Python stacks can be dumped: with py-spy when it
is installed, else by SIGUSR1 to a worker that registered faulthandler through
trainer/hooks.py (a SIGSTOPped worker is continued first so it can run the handler).

Hangs are judged here, per rank, from the rank's own step rhythm and phase (agent/hang.py):
`Supervisor.hang_check` turns the statuses of one heartbeat into the STALLED flag and, once
per hang episode, the capped stacks of every rank of the node. A worker found SIGSTOPped
(a drill's hang) runs only its faulthandler and is stopped again (SIGUSR1, SIGCONT, SIGSTOP
back to back), so the dump does not end the hang it describes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog

from unbroken.agent import hang as hanglib
from unbroken.agent import procexit
from unbroken.agent import warm as warmlib
from unbroken.agent.launch import WorkerLaunch, WorkerSpec, exec_wrapper
from unbroken.common import aio
from unbroken.common.workerenv import STACKS_END, WARM_ARGV
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.proto import hooks_pb2 as hpb
from unbroken.recovery.restore import Source
from unbroken.recovery.spike import RESTORE_RESET_STEPS, SpikeConfig

log = structlog.get_logger(__name__)

#: How long a dead worker's readers get to take its last lines before its exit is reported.
READ_AFTER_EXIT_S = 0.1
#: A stack dump's lines are looked for this often, and one with no end line
#: (faulthandler's SIGUSR1 dump) is whole once its output has been quiet `QUIET_S`.
COLLECT_POLL_S = 0.005
QUIET_S = 0.05
#: The variables that say a rank's place: a standby's dry run took the place they name.
_PLACE = ("RANK", "WORLD_SIZE")
PEAK_BEATS = 3  # heartbeats a loss peak is repeated in (see Worker.status)
FINGERPRINTS_KEPT = 3  # a rank's newest fingerprinted steps...
FINGERPRINT_BEATS = 20  # ...each repeated in this many heartbeats (the driver looks each beat)
MAX_FINGERPRINT_KEYS = 16  # replica keys of one rank's fingerprint passed on
WINDOW_STEPS = 64  # steps the reported compute / wait medians stand for (docs/detection.md)
LOSS_WINDOW = 100  # recent losses the reported loss median / MAD stand for (SpikeConfig.window)
# A reported loss this many times the recent median (or not finite) heartbeats at once: the
# driver's smallest spike (`factor` spreads, each floored at `min_rel_spread` of the median:
# 1.3x), so every loss it could call a spike goes out without waiting for the next beat
OUTLIER_RATIO = 1.0 + SpikeConfig().factor * SpikeConfig().min_rel_spread
# where a worker may say its restored state came from
RESTORE_SOURCES = frozenset(s.label for s in Source)


class Worker:
    """One local rank's process and what the agent knows about it."""

    def __init__(self, local_rank: int, global_rank: int, log_path: Path) -> None:
        self.local_rank = local_rank
        self.global_rank = global_rank
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.state = dpb.WORKER_STATE_UNSPECIFIED
        self.exit_code = 0
        self.restarts = 0
        self.step = 0
        self.loss = 0.0
        self.has_loss = False
        self.has_peak = False  # the highest loss since the last heartbeat (see status)
        self.peak_loss = 0.0
        self.peak_step = 0
        # the peaks of the last PEAK_BEATS heartbeats (None: no loss in that one)
        self.peaks: collections.deque[tuple[float, int] | None] = collections.deque(
            maxlen=PEAK_BEATS
        )
        self.step_time_ms = 0.0
        self.last_progress = time.monotonic()
        self.step_times: collections.deque[float] = collections.deque(maxlen=32)
        self.reply_socket = ""
        self.stack_signal = False
        self.restop_signal = False  # SIGUSR2 dumps the stacks and stops again (trainer/hooks.py)
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        self.nlines = 0  # lines ever appended to `tail`
        self.tasks: list[asyncio.Task[None]] = []
        self.warm = False  # started in a warm standby rather than a fresh process
        self.phase = ""  # the worker's own phase report ("" until one: judged as "train")
        self.restored_step: int | None = None  # the step this process started from, once said
        self.restored_from = ""  # ...and where its state came from (RESTORE_SOURCES)
        # per-step compute and collective-wait times (the straggler detector's input)
        self.compute_times: collections.deque[float] = collections.deque(maxlen=WINDOW_STEPS)
        self.wait_times: collections.deque[float] = collections.deque(maxlen=WINDOW_STEPS)
        # per report: the wall time since the one before and what of it the loop spent on
        # checkpoint saves and data loading (goodput's in-step badput)
        self.in_step: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=WINDOW_STEPS
        )
        self._last_report_t: float | None = None
        # this process's recent finite losses, one per step (a new leader's spike baseline)
        self.losses: collections.deque[float] = collections.deque(maxlen=LOSS_WINDOW)
        # the step of the newest of them: an in-job rejoin sets `step` to 0, and a restore
        # far back must still be seen as one (else the old curve stays the baseline)
        self.loss_step = 0
        self._loss_stats = (0.0, 0.0)  # their median and MAD...
        self._loss_stats_stale = False  # ...recomputed at the next heartbeat after a new loss
        self.outlier = False  # the last step report's loss stood out (`OUTLIER_RATIO`)
        self.beat_now = False  # ...and the one before did not: heartbeat at once
        self.hung = False
        # when `Supervisor.watch_stops` first saw this process stopped (None: running, or
        # not watched), and whether it asked for a heartbeat for that stop
        self.stopped_since: float | None = None
        self.stop_kicked = False
        self.running_polls = 0  # the watch's polls in a row that saw it running
        self.rejoins = 0  # in-job recoveries this process rejoined a new world in (agent/injob.py)
        self.delay_at_progress = -1.0  # run-queue delay (ms) at the step last seen progressing
        self.step_seen = -1
        # the newest state fingerprints (docs/sdc.md), newest first, sent in every heartbeat
        # until newer ones replace them: the driver reads each node's newest heartbeat only
        self.fingerprints: collections.deque[list[Any]] = collections.deque(
            maxlen=FINGERPRINTS_KEPT
        )  # [RankFingerprint, heartbeats it was sent in]

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def on_step(
        self,
        step: int,
        loss: float | None,
        step_time_ms: float,
        now: float,
        peak: tuple[float, int] | None = None,
        timings_ms: dict[str, float] | None = None,
        steps: int = 1,
    ) -> None:
        """A step report; `peak` is the highest loss (and its step) of the `steps` steps it
        stands for when it stands for several (the SDK's coalesced reports; its timings are
        their means); `timings_ms` may name "compute" and "collective_wait" (the straggler
        detector's input), "checkpoint_save" and "data_loading" (goodput's)."""
        if step != self.step:
            self.last_progress = now
            self.phase = "train"  # a step ends a restore / checkpoint / collective phase
        if timings_ms and "compute" in timings_ms:
            self.compute_times.append(timings_ms["compute"])
            self.wait_times.append(timings_ms.get("collective_wait", 0.0))
        if self._last_report_t is not None and step > self.step:
            t = timings_ms or {}
            n = max(1, steps)
            self.in_step.append((
                (now - self._last_report_t) * 1000.0,
                t.get("checkpoint_save", 0.0) * n,
                t.get("data_loading", 0.0) * n,
            ))  # fmt: skip
        self._last_report_t = now
        if step + RESTORE_RESET_STEPS < max(self.step, self.loss_step):
            # a restore far back (an older commit): the window's losses are of later
            # training, and as the baseline of a driver that learns the curve again
            # (`LossWatch`) they flagged every restored loss as a spike, restore after restore
            self.losses.clear()
            self.loss_step = 0
            self._loss_stats, self._loss_stats_stale = (0.0, 0.0), False
        median = self._loss_stats[0]  # as of the last heartbeat: before this loss
        was = self.outlier
        self.outlier = any(
            x is not None and (not math.isfinite(x) or (median > 0 and x > OUTLIER_RATIO * median))
            for x in (loss, peak[0] if peak else None)
        )
        # the first of a run only: a curve that stays high is not a heartbeat per report
        self.beat_now = self.outlier and not was
        if loss is not None and math.isfinite(loss) and step != self.step:
            self.losses.append(loss)
            self.loss_step = step
            self._loss_stats_stale = True
        self.step, self.step_time_ms = step, step_time_ms
        self.has_loss = loss is not None
        self.loss = loss if loss is not None else 0.0
        for cand, at in [peak or (None, 0), (loss, step)]:
            if cand is not None and (
                not self.has_peak
                or not math.isfinite(cand)
                or (math.isfinite(self.peak_loss) and cand > self.peak_loss)
            ):
                self.has_peak, self.peak_loss, self.peak_step = True, cand, at
        if step_time_ms > 0:
            self.step_times.append(step_time_ms)

    def on_fingerprint(self, fp: hpb.Fingerprint) -> None:
        """The rank's state fingerprints after a step (trainer/sdc.py)."""
        n = min(len(fp.keys), len(fp.hashes), MAX_FINGERPRINT_KEYS)
        rf = ev.RankFingerprint(
            step=fp.step,
            keys=[k[:128] for k in fp.keys[:n]],
            hashes=fp.hashes[:n],
            global_rank=self.global_rank,
        )
        self.fingerprints.appendleft([rf, 0])

    def on_phase(self, name: str, now: float, step: int | None = None, source: str = "") -> None:
        """The worker entered phase `name`; the phase's own limit counts from now. A `step`
        with it is the step its state is at; the first one is the step it restored, and
        `source` where that came from (a name outside RESTORE_SOURCES is not passed on)."""
        self.phase = name[:32]
        self.last_progress = now
        if step is not None:  # a (re)started run: the old timeline's fingerprints are void
            self.fingerprints.clear()
        if step is not None and self.restored_step is None:
            self.restored_step = step
            self.restored_from = source if source in RESTORE_SOURCES else ""

    def status(
        self, now: float, hang: hanglib.HangConfig | None = None, stops_watched: bool = False
    ) -> dpb.WorkerStatus:
        """This worker's heartbeat entry. Its peak is the highest loss (a non-finite one
        first) of the last `PEAK_BEATS` heartbeats' steps: the driver keeps only a node's
        newest heartbeat and its loss watch looks once per heartbeat interval, so a peak
        sent once could be overwritten unseen when two heartbeats land between two looks.
        """
        peak = self._peak()
        since_ms = (now - self.last_progress) * 1000.0
        phase, threshold = self._judge_hang(since_ms, hang or hanglib.HangConfig(), stops_watched)
        mid, mad = median_mad(self.compute_times)
        wait, wait_mad = median_mad(self.wait_times)
        save_share, data_share = in_step_shares(self.in_step)
        if self._loss_stats_stale:  # sorted once per new loss, not per beat
            self._loss_stats, self._loss_stats_stale = median_mad(self.losses), False
        return dpb.WorkerStatus(
            local_rank=self.local_rank,
            global_rank=self.global_rank,
            pid=self.pid,
            state=self.state,
            exit_code=self.exit_code,
            step=self.step,
            loss=self.loss,
            step_time_ms=self.step_time_ms,
            since_progress_ms=since_ms,
            median_step_ms=statistics.median(self.step_times) if self.step_times else 0.0,
            restarts=self.restarts,
            has_loss=self.has_loss,
            has_peak=peak[0],
            peak_loss=peak[1],
            peak_step=peak[2],
            hung=self.hung,
            hang_threshold_ms=threshold,
            phase=phase or "train",
            compute_ms=mid,
            compute_mad_ms=mad,
            wait_ms=wait,
            wait_mad_ms=wait_mad,
            window_steps=len(self.compute_times),
            restored_step=self.restored_step,
            restored_from=self.restored_from,
            loss_median=self._loss_stats[0],
            loss_mad=self._loss_stats[1],
            loss_window=len(self.losses),
            rejoins=self.rejoins,
            held=self.phase == "held",
            checkpoint_save_share=save_share,
            data_loading_share=data_share,
            fingerprints=self._fingerprints_to_send(),
        )

    def _peak(self) -> tuple[bool, float, int]:
        """The highest loss of the last `PEAK_BEATS` heartbeats' steps, a non-finite one first
        (has one, the loss, its step)."""
        self.peaks.append((self.peak_loss, self.peak_step) if self.has_peak else None)
        self.has_peak = False
        best: tuple[float, int] | None = None
        for p in self.peaks:
            if p is not None and (
                best is None
                or (math.isfinite(best[0]) and (not math.isfinite(p[0]) or p[0] > best[0]))
            ):
                best = p
        return (True, *best) if best is not None else (False, 0.0, 0)

    def _judge_hang(
        self, since_ms: float, cfg: hanglib.HangConfig, stops_watched: bool = False
    ) -> tuple[str, float]:
        """Judge whether this rank hangs (sets `hung`); the phase it is judged in and the
        silence (ms) that makes it hung there."""
        running = self.state == dpb.WORKER_STATE_RUNNING
        judged = running and (bool(self.step_times) or bool(self.phase))  # hookless: never
        # a silent rank whose process is stopped is the culprit, whatever phase it was in: it
        # is judged by its step rhythm (not a collective's longer wait) and says "stopped".
        # So is one that has said nothing yet: a just-promoted warm standby still importing,
        # or a rank before its first report, stopped there was never judged (a hang injected
        # into a promoted standby stalled the job until the restore's deadline).
        # Timed by the supervisor's watch where it runs (`stops_watched`), else from the last
        # progress (a stop shorter than the silence cannot be told apart there).
        stop_limit = hanglib.STOPPED_AFTER_MS if stops_watched else hanglib.STOPPED_SILENT_MS
        stopped = running and bool(self.pid) and since_ms >= stop_limit
        if stops_watched:  # the watch's timing (a stack dump's moment of running included)
            since = self.stopped_since
            lasted_ms = (time.monotonic() - since) * 1000.0 if since is not None else 0.0
            stopped = stopped and lasted_ms >= stop_limit
        else:
            stopped = stopped and hanglib.process_stopped(self.pid)
        judged = judged or stopped
        phase = "stopped" if stopped else self.phase
        threshold = stop_limit if stopped else hanglib.threshold_ms(self.step_times, phase, cfg)
        starved = 0.0
        if judged and self.pid:
            delay = hanglib.run_delay_ms(self.pid)
            if self.step != self.step_seen or self.delay_at_progress < 0:
                self.step_seen, self.delay_at_progress = self.step, delay
            # A delay below the one at the last progress is not this process's (it exited:
            # its /proc entry is gone and the reading says 0; or a new process took the
            # rank at the same step): no starvation is known. Unclamped, the difference went
            # negative and turned a dead or new worker's short silence into a hang (seen at
            # load 20: a SIGKILLed worker flagged hung after 3.5 s against an 8.2 s limit).
            self.delay_at_progress = min(self.delay_at_progress, delay)
            starved = delay - self.delay_at_progress
        self.hung = judged and hanglib.is_hung(since_ms, threshold, starved)
        return phase, threshold

    def _fingerprints_to_send(self) -> list[ev.RankFingerprint]:
        out = []
        for entry in self.fingerprints:
            if entry[1] < FINGERPRINT_BEATS:
                entry[1] += 1
                out.append(entry[0])
        return out


def in_step_shares(window: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    """The shares of the window's wall time spent on checkpoint saves and on data loading
    (each at most 1; zeros without wall time)."""
    wall = save = data = 0.0
    for w, s, d in window:
        wall, save, data = wall + w, save + s, data + d
    if wall <= 0:
        return 0.0, 0.0
    return min(1.0, save / wall), min(1.0, data / wall)


def median_mad(xs: Iterable[float]) -> tuple[float, float]:
    """The (upper) median of `xs` and their median absolute deviation from it; zeros when
    empty."""
    ordered = sorted(xs)
    if not ordered:
        return 0.0, 0.0
    mid = ordered[len(ordered) // 2]
    return mid, statistics.median(abs(x - mid) for x in ordered)


class Supervisor:
    """The node's workers: start, watch, scan, stop."""

    def __init__(self, spec: WorkerSpec, socket_path: str) -> None:
        self.spec = spec
        self.launch = WorkerLaunch.of(spec)  # replaced, never changed, per start command
        self.socket_path = socket_path
        self.workers: dict[int, Worker] = {}
        self.alerts: collections.deque[dpb.LogAlertLine] = collections.deque(maxlen=256)
        self.exited = False  # a worker exited since the last heartbeat took the flag
        self.start_id = ""  # the StartWorkers its workers run under ("" stopped or held)
        # called when a worker fails (exits non-zero, not stopped on command): the agent
        # reports it at once instead of at its next heartbeat slot (up to an interval later)
        self.on_failure: Callable[[], object] | None = None
        self.standbys: list[warmlib.Standby] = []
        self._refill: asyncio.Task[None] | None = None
        self.warm_starts = 0
        self.cold_starts = 0
        # a hang episode: None (none), a task dumping the stacks, or "" once they were sent
        self._hang_dump: asyncio.Task[str] | None = None
        self._hang_sent = False
        self.stops_watched = False  # `watch_stops` runs: stops are timed, not guessed
        # called when a hang episode's stacks are in: the flagged heartbeat goes now, not at
        # the next slot (up to an interval later)
        self.on_hang_dumped: Callable[[], object] | None = None
        Path(spec.log_dir).mkdir(parents=True, exist_ok=True)

    def by_pid(self, pid: int) -> Worker | None:
        for w in self.workers.values():
            if w.pid == pid:
                return w
        return None

    async def start_all(self) -> None:
        for r in range(self.spec.nproc):
            await self.start(r, refill=False)
        self._schedule_refill(self.spec.warm_refill_after_s)

    def warm_up(self) -> None:
        """Start the standbys (an agent waiting for StartWorkers has the CPU to spare), at
        once or after `warm_after_s`; StartWorkers before then reschedules them to start
        once the workers step."""
        self._schedule_refill(self.spec.warm_after_s)

    async def start(self, local_rank: int, *, refill: bool = True) -> Worker:
        """Start (or restart) one local rank, in a warm standby when one fits."""
        spec, launch = self.spec, self.launch
        old = self.workers.get(local_rank)
        w = Worker(
            local_rank,
            launch.rank_base + local_rank,
            Path(spec.log_dir) / f"worker-{local_rank}.log",
        )
        if old is not None:
            w.restarts = old.restarts + 1
        w.state = dpb.WORKER_STATE_STARTING
        self.workers[local_rank] = w
        logf = open(w.log_path, "ab", buffering=0)  # closed by _reap
        env = launch.environ(spec, local_rank, self.socket_path)
        w.proc = await self._from_standby(env)
        w.warm = w.proc is not None
        if w.proc is None:
            w.proc = await asyncio.create_subprocess_exec(
                *exec_wrapper(nice=spec.nice, die_with_agent=spec.die_with_agent),
                *launch.cmd,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                process_group=0,  # its own group, the agent's session (see the docstring)
            )
        if w.warm:
            self.warm_starts += 1
        else:
            self.cold_starts += 1
        w.state = dpb.WORKER_STATE_RUNNING
        w.last_progress = time.monotonic()
        assert w.proc.stdout is not None and w.proc.stderr is not None
        readers = [
            asyncio.create_task(self._pump(w, w.proc.stdout, logf)),
            asyncio.create_task(self._pump(w, w.proc.stderr, logf)),
        ]
        w.tasks = [*readers, asyncio.create_task(self._reap(w, readers, logf))]
        log.info(
            "worker started", local_rank=local_rank, pid=w.pid, restarts=w.restarts, warm=w.warm
        )
        if refill:
            self._schedule_refill(spec.warm_refill_after_s)
        return w

    # ------------------------------------------------------------ warm standbys
    async def _from_standby(self, env: dict[str, str]) -> asyncio.subprocess.Process | None:
        """Hand `env` to a live, compatible standby, the one whose dry run took this rank's
        place first (`_unwarmed_rank`); None: start cold."""
        target = warmlib.parse_target(self.launch.cmd) if self.spec.warm else None
        if target is None:
            return None
        self.standbys.sort(key=lambda s: any(s.env.get(k) != env.get(k) for k in _PLACE))
        while self.standbys:
            s = self.standbys.pop(0)
            why = "" if s.alive else f"exited with {s.proc.returncode}"
            why = why or ("" if s.key == target.key else "another interpreter or options")
            why = why or warmlib.compatible(s.env, env)
            if not why:
                try:
                    return await s.hand_off(target, env)
                except (OSError, TimeoutError) as e:
                    why = f"hand-off failed: {e}"
            log.info("standby discarded", pid=s.proc.pid, reason=why)
            await s.kill()
        return None

    def _unwarmed_rank(self) -> int:
        """The local rank the next standby dry-runs as: the lowest one no live standby's
        environment names. A standby's dry run fills DTensor's caches for its place (its
        RANK), and a worker started at another forgets them (trainer/rejoin.py
        `forget_dry_run_caches`): when every standby dry-ran as local rank 0, a node's
        other ranks were always replaced cold in that respect (their first state_dict and
        step then made every sharding decision again: 0.3-0.8 s on a loaded 2-core host)."""
        named = {s.env.get("LOCAL_RANK") for s in self.standbys if s.alive}
        return next((r for r in range(self.spec.nproc) if str(r) not in named), 0)

    def schedule_refill(self) -> None:
        """Top the standbys up once the workers step (after starts outside `start_all`)."""
        self._schedule_refill(self.spec.warm_refill_after_s)

    def _schedule_refill(self, after_s: float) -> None:
        if not self.spec.warm or warmlib.parse_target(self.launch.cmd) is None:
            return
        if self._refill is not None and not self._refill.done():
            self._refill.cancel()
        self._refill = asyncio.create_task(self._refill_when_stepping(after_s))

    async def _refill_when_stepping(self, after_s: float) -> None:
        """Top the standbys up once the workers step (their imports would slow a restore)."""
        deadline = time.monotonic() + after_s
        while time.monotonic() < deadline:
            if self.workers and all(
                w.step > 0 or w.state != dpb.WORKER_STATE_RUNNING for w in self.workers.values()
            ):
                break
            await asyncio.sleep(0.1)
        target = warmlib.parse_target(self.launch.cmd)
        if target is None:
            return
        spec = self.spec
        # Wait at a lower priority when the standby may take the workers' back at hand-off.
        target_nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + spec.nice)
        low = spec.warm_nice > spec.nice and warmlib.may_raise_priority(target_nice)
        wrapper = exec_wrapper(
            nice=spec.warm_nice if low else spec.nice, die_with_agent=spec.die_with_agent
        )
        try:
            for s in [s for s in self.standbys if not s.alive]:
                self.standbys.remove(s)
                await s.kill()
            while len(self.standbys) < spec.nproc:
                env = self.launch.environ(spec, self._unwarmed_rank(), self.socket_path)
                if target.module:  # a module's own warm hook may build its dry run from them
                    env[WARM_ARGV] = json.dumps(list(target.args))
                s = await warmlib.spawn_standby(
                    target,
                    env,
                    wrapper=wrapper,
                    preload=spec.warm_preload,
                    nice=target_nice if low else None,
                )
                self.standbys.append(s)
                log.info("standby started", pid=s.proc.pid, standbys=len(self.standbys))
        except OSError as e:  # cannot fork now: workers start cold, the next start retries
            log.warning("standby not started", error=str(e))

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker and every standby (the agent is going away)."""
        if self._refill is not None:
            self._refill.cancel()
            with contextlib.suppress(BaseException):
                await self._refill
        await self.stop_all(grace_s)
        # an exited worker's reaper may still wait for pipes a child holds: end it now
        await aio.cancel_all([t for w in self.workers.values() for t in w.tasks])
        standbys, self.standbys = self.standbys, []
        await asyncio.gather(*(s.kill() for s in standbys))

    async def _pump(self, w: Worker, stream: asyncio.StreamReader, logf: object) -> None:
        cap = self.spec.max_line_chars
        partial = b""
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                if partial:
                    self._line(w, partial, cap)
                return
            logf.write(chunk)  # type: ignore[attr-defined]
            data = partial + chunk
            *lines, partial = data.split(b"\n")
            for line in lines:
                self._line(w, line, cap)
            if len(partial) > cap:  # an endless line: scan what we have, drop the rest
                self._line(w, partial, cap)
                partial = b""

    def _line(self, w: Worker, raw: bytes, cap: int) -> None:
        line = raw[: cap * 4].decode("utf-8", "replace")[:cap]
        w.tail.append(line)
        w.nlines += 1
        for kw in self.spec.keywords:
            if kw in line:
                self.alerts.append(dpb.LogAlertLine(local_rank=w.local_rank, keyword=kw, line=line))
                break

    async def _reap(self, w: Worker, readers: list[asyncio.Task[None]], logf: object) -> None:
        assert w.proc is not None
        # its exit, not its pipes' close: a child it left behind may hold them (procexit)
        code = await procexit.exit_code(w.proc)
        # its last lines (an alert that makes the incident suspect) are in the pipes: the
        # readers take them at once when nothing else holds the pipes
        await asyncio.wait(readers, timeout=READ_AFTER_EXIT_S)
        if w.state != dpb.WORKER_STATE_STOPPED:
            w.state = dpb.WORKER_STATE_EXITED
            w.exit_code = code
            self.exited = self.exited or code != 0
            if code != 0 and self.on_failure is not None:
                self.on_failure()
        log.info("worker exited", local_rank=w.local_rank, pid=w.pid, code=code)
        try:
            await asyncio.wait(readers, timeout=2.0)
        finally:  # also when cancelled (the agent closing): the pipes must not outlive the loop
            if cut := [t for t in readers if not t.done() or t.cancelled()]:
                for t in cut:  # a child still writes into the dead worker's pipes: stop
                    t.cancel()  # reading, and close them (its writes fail), not left to a
                transport = getattr(w.proc, "_transport", None)  # closed loop's finalizer
                if transport is not None:  # (asyncio has no public close)
                    transport.close()
            logf.close()  # type: ignore[attr-defined]
        await asyncio.gather(*readers, return_exceptions=True)

    async def dump_stacks(self, w: Worker, timeout_s: float = 2.0, *, restop: bool = False) -> str:
        """The worker's Python stacks (py-spy, else faulthandler via SIGUSR1), or "".

        With `restop`, a worker found stopped (SIGSTOP) runs only its stack handler and is
        stopped again (the hang detector must not end the hang it reports).
        """
        if w.proc is None or w.proc.returncode is not None:
            return ""
        pyspy = shutil.which("py-spy")
        if pyspy:
            p = await asyncio.create_subprocess_exec(
                pyspy,
                "dump",
                "--pid",
                str(w.pid),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            try:
                out, _ = await aio.communicate(p, None, timeout_s)
                if p.returncode == 0:
                    return out.decode("utf-8", "replace")
            except TimeoutError:
                pass  # (killed and reaped) the SDK's own dump below
        if restop and process_stopped(w.pid):
            return await self._dump_stopped(w, timeout_s)
        if not w.stack_signal:
            return ""
        mark = w.nlines
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGCONT)
            os.kill(w.pid, signal.SIGUSR1)
        return await self._collect(w, mark, timeout_s)

    async def _dump_stopped(self, w: Worker, timeout_s: float) -> str:
        """A stopped worker's stacks without ending its stop.

        Its SDK's SIGUSR2 handler (trainer/hooks.py) dumps the stacks and stops the process
        again before a step can run; a worker without one is left stopped, undumped.
        """
        head = "(process stopped: SIGSTOP)"
        if not w.restop_signal:
            return head + " (no SIGUSR2 handler: install py-spy for its stacks)"
        mark = w.nlines
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGUSR2)
            os.kill(w.pid, signal.SIGCONT)
        return head + "\n" + await self._collect(w, mark, timeout_s, end=STACKS_END)

    @staticmethod
    async def _collect(w: Worker, mark: int, timeout_s: float, end: str | None = None) -> str:
        """The lines `w` wrote after line `mark`: up to the line `end` where the dump writes
        one (at once), else once they stop growing for `QUIET_S` (or at the deadline)."""
        deadline = time.monotonic() + timeout_s
        seen, quiet_since = -1, time.monotonic()

        def lines() -> list[str]:
            new = min(w.nlines - mark, len(w.tail))
            return list(w.tail)[len(w.tail) - new :] if new > 0 else []

        while time.monotonic() < deadline:
            await asyncio.sleep(COLLECT_POLL_S)
            now = time.monotonic()
            if end is not None and end in (got := lines()):
                return "\n".join(got[: got.index(end)])
            if w.nlines != seen:
                seen, quiet_since = w.nlines, now
            elif w.nlines > mark and now - quiet_since >= QUIET_S:
                break
        return "\n".join(line for line in lines() if line != end)

    def hang_check(self, statuses: list[dpb.WorkerStatus]) -> tuple[bool, str]:
        """(flag STALLED?, stacks to send) for one heartbeat's statuses.

        A hang episode starts when a rank is hung: the stacks of every running rank are
        dumped once (in the background); the flag is raised when they are in, so the one
        flagged heartbeat that opens the episode carries them, and stays up while any rank
        is hung. Progress on every rank ends the episode.
        """
        if not any(s.hung for s in statuses):
            if self._hang_dump is not None and not self._hang_dump.done():
                self._hang_dump.cancel()
            self._hang_dump, self._hang_sent = None, False
            return False, ""
        if self._hang_dump is None:
            self._hang_dump = asyncio.ensure_future(self._dump_node())
            kick = self.on_hang_dumped
            if kick is not None:
                self._hang_dump.add_done_callback(lambda _t: kick())
        if not self._hang_dump.done():
            return False, ""
        if self._hang_sent:
            return True, ""
        self._hang_sent = True
        try:
            return True, self._hang_dump.result()
        except Exception as e:  # a dump that failed must not hold back the flag
            return True, f"(stacks unavailable: {e})"

    async def _dump_node(self) -> str:
        running = [w for w in self.workers.values() if w.state == dpb.WORKER_STATE_RUNNING]
        dumps = await asyncio.gather(*(self.dump_stacks(w, 1.0, restop=True) for w in running))
        return hanglib.cap_stacks({w.local_rank: d for w, d in zip(running, dumps, strict=True)})

    async def stop(self, w: Worker, grace_s: float = 5.0, *, dump: bool = False) -> str:
        """Stop one worker (SIGTERM, SIGKILL after `grace_s`); return its stack dump."""
        stacks = await self.dump_stacks(w) if dump else ""
        if w.proc is None or w.proc.returncode is not None:
            return stacks
        w.state = dpb.WORKER_STATE_STOPPED
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.pid, sig)
                if sig == signal.SIGTERM:
                    os.killpg(w.pid, signal.SIGCONT)
            try:
                await aio.wait_for(procexit.exit_code(w.proc), wait_s)
                break
            except TimeoutError:
                continue
        for t in w.tasks:
            with contextlib.suppress(BaseException):
                await aio.wait_for(t, 2.0)
        return stacks

    async def stop_all(self, grace_s: float = 5.0, *, dump: bool = False) -> dict[int, str]:
        self.start_id = ""
        dumps = await asyncio.gather(
            *(self.stop(w, grace_s, dump=dump) for w in self.workers.values())
        )
        return dict(zip(self.workers, dumps, strict=True))

    def statuses(self, now: float) -> list[dpb.WorkerStatus]:
        watched = self.stops_watched
        return [w.status(now, self.spec.hang, watched) for w in self.workers.values()]

    async def watch_stops(self, kick: Callable[[], object]) -> None:
        """Time each worker's stop (SIGSTOP, a debugger) from when it is first seen, every
        `STOP_POLL_S`, and `kick` (a heartbeat now) once one has lasted `STOPPED_AFTER_MS`;
        the heartbeat judges it hung (`Worker._judge_hang`). Runs until cancelled."""
        self.stops_watched = True
        stop_after_s = hanglib.STOPPED_AFTER_MS / 1000.0
        try:
            while True:
                now = time.monotonic()
                for w in list(self.workers.values()):
                    proc = w.proc
                    live = w.state == dpb.WORKER_STATE_RUNNING and bool(w.pid)
                    live = live and proc is not None and proc.returncode is None
                    if not (live and hanglib.process_stopped(w.pid)):
                        # seen running twice in a row: a stopped worker's stack dump runs
                        # it for a moment (`_dump_stopped`), which must not end its stop
                        w.running_polls += 1
                        if w.running_polls >= 2 or not live:
                            w.stopped_since, w.stop_kicked = None, False
                        continue
                    w.running_polls = 0
                    if w.stopped_since is None:
                        w.stopped_since = now
                    elif not w.stop_kicked and now - w.stopped_since >= stop_after_s:
                        w.stop_kicked = True
                        kick()
                await asyncio.sleep(hanglib.STOP_POLL_S)
        finally:
            self.stops_watched = False

    def take_alerts(self) -> list[dpb.LogAlertLine]:
        out = list(self.alerts)
        self.alerts.clear()
        return out


def process_stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (state T in /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"T"
