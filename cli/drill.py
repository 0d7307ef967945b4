"""The fault drill of `unbroken up`: inject one fault at a time, measure what the log says.

Each fault is injected once training runs and the previous one is over; its record is
filled from the event log as it grows (`Drill.observe`) and the live view (`Drill.advance`):
the time to detect it (the proving event's own wall time minus the injection's), the time
until training resumed (TrainingResumed), the steps lost (TrainingPaused.at_step minus the
step rank 0 really restored, read from its worker log: the machine's restore step is the
newest *committed* one, while workers restore the newest step in flash memory), whether
the loss curve continued (the loss 3 steps after the resume within `LOSS_BAND` of the loss
before the fault) and the events written from the injection to the resume. `up.py` owns the
processes; this module only injects and measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from unbroken.common.faults import FAULT_FILE, LOSS_SPIKE, WorkerFault
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:
    from unbroken.cli.up import Cluster, Watcher

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
STRAGGLER_WARM_STEPS = 64  # steps in every worker's window before the straggler is injected
STRAGGLER_DETECT_LIMIT_S = 180.0  # its windows must fill and shift first (driver/straggler.py)
RESPAWN_DRIVER_S = 8.0  # a killed driver restarts this long after (its lease is 2 s)
RESTORED = re.compile(r"flash\.restored.*\brank=0\b.*\bstep=(\d+)")


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
    seq_at_inject: int = 0  # the newest event's seq when injected
    events_written: int | None = None  # from the injection to the resume (or detection)
    paused_at: int | None = None  # TrainingPaused.at_step of the incident
    log_restore: int | None = None  # TrainingPaused.restore_step (the driver's, from the rings)
    worker_restore: int | None = None  # the step rank 0 restored (its worker log)
    restores_at_inject: int = 0  # rank 0's flash.restored lines in the worker logs then
    loss_before: float | None = None
    resumed_step: int | None = None
    loss_after: float | None = None
    skipped: bool = False  # not injectable here (the note says why)
    armed: bool = True  # False: the fault waits for a trigger (mid-recovery driver kill)
    detect_limit_s: float = DETECT_LIMIT_S

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


def signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    """Send `sig` to `p`'s process group (gone already: nothing)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


async def leader_view(
    addresses: dict[str, str],
    drivers: dict[str, subprocess.Popen[bytes]],
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[str, list[dpb.NodeLive]] | None:
    """The leading driver's name and live view, asking each running driver; None if none leads."""
    for name, addr in addresses.items():
        proc = drivers.get(name)
        if proc is None or proc.poll() is not None:
            continue
        try:
            async with grpc.aio.insecure_channel(addr) as ch:
                resp = await dgrpc.DriverStub(ch).LiveView(
                    dpb.LiveViewRequest(), timeout=2, metadata=metadata
                )
        except grpc.RpcError:
            continue
        if resp.leader:
            return name, list(resp.nodes)
    return None


def stop_groups(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every process group, SIGKILL what is left after `grace_s` in all."""
    for p in procs:
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    for p in procs:
        signal_group(p, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)


def fault_table(faults: list[FaultRecord]) -> Any:
    """The drill's table (rich)."""
    from rich.table import Table

    t = Table(title="drill")
    for col in (
        "fault",
        "target",
        "detected in",
        "resumed in",
        "steps lost",
        "loss continued",
        "events",
        "event (seq)",
        "note",
    ):
        t.add_column(col)
    for f in faults:
        if f.skipped:
            t.add_row(
                f.fault, f.target, "-", "-", "-", "-", "-", "-", f"[yellow]skipped[/]: {f.note}"
            )
            continue
        det = f"{f.detected_s:.2f} s" if f.detected_s is not None else "[red]not yet[/]"
        res = lost = cont = "-"
        if f.recovers:
            res = f"{f.resumed_s:.2f} s" if f.resumed_s is not None else "[red]not yet[/]"
            lost = str(f.steps_lost) if f.steps_lost is not None else "?"
            restored, paused = f.log_restore, f.paused_at
            if (
                restored is not None
                and paused is not None
                and f.worker_restore
                not in (
                    None,
                    restored,
                )
            ):
                lost += f" [yellow](log said {paused - restored})[/]"
            c = f.continued
            if c is not None and f.loss_before is not None and f.loss_after is not None:
                cont = f"{'yes' if c else '[red]no[/]'} ({f.loss_before:.2f} → {f.loss_after:.2f})"
        evs = str(f.events_written) if f.events_written is not None else "-"
        t.add_row(
            f.fault, f.target, det, res, lost, cont, evs, f"{f.expect} ({f.event_seq or '-'})",
            f.note,
        )  # fmt: skip
    return t


def rank0_restores(run: Path) -> list[int]:
    """Steps rank 0 restored, oldest first, from every worker log of the run."""
    out: list[tuple[float, int]] = []
    for log in sorted(run.glob("workers/*/worker-*.log")):
        with contextlib.suppress(OSError):
            mtime = log.stat().st_mtime
            for i, m in enumerate(RESTORED.finditer(log.read_text(errors="replace"))):
                out.append((mtime + i * 1e-6, int(m.group(1))))
    return [s for _, s in sorted(out)]


class Drill:
    """Injects one fault at a time once training runs, and measures each from the log."""

    def __init__(self, c: Cluster, w: Watcher, faults: list[FaultRecord]) -> None:
        self.c, self.w, self.faults = c, w, faults
        self.plan = list(c.cfg.faults)
        self.next_at = 0.0
        self.done = False
        self._checks: set[asyncio.Task[None]] = set()

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
                    if kind == f.expect and _matches(e, f):
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
                    f.events_written = e.seq - f.seq_at_inject

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
            if f.recovers and f.resumed_s is not None:
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
            if f.over:
                self.next_at = now + GAP_S
            return  # one fault at a time
        if now < self.next_at or self.w.step() < 10 or not self._running():
            return
        if not self.plan:
            self.done = True
            return
        kind = self.plan.pop(0)
        f = await getattr(self, f"_inject_{kind}")(now)
        if f is not None:
            self.faults.append(f)
            self.next_at = now + GAP_S

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

    def _record(self, fault: str, target: str, expect: str, now: float, **kw: Any) -> FaultRecord:
        return FaultRecord(
            fault=fault,
            target=target,
            injected_at=now,
            expect=expect,
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
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim[1], signal.SIGKILL)
        return self._record(
            "worker SIGKILL", f"{victim[0]} pid {victim[1]}", "worker_failed", now,
            note="every worker restarts and restores from flash memory", recovers=True,
        )  # fmt: skip

    async def _inject_node_loss(self, now: float) -> FaultRecord | None:
        spares = [n for n in self.c.agents if n.startswith("spare-")]
        working = [n.node_id for n in self._world()]
        gone = next((n for n in reversed(working) if n in self.c.agents), None)
        if gone is None:
            return None
        signal_group(self.c.agents[gone], signal.SIGKILL)
        f = self._record(
            "node lost (agent SIGKILL)", gone, "node_lost", now, recovers=True,
            note="a spare takes its place" if spares else "no spare: the job shrinks",
        )  # fmt: skip
        # the node comes back later as an idle node the world can take (a replacement)
        asyncio.get_running_loop().call_later(15.0, self._respawn_agent, gone)
        return f

    def _respawn_agent(self, name: str) -> None:
        if self.c.stopping or self.c.agents[name].poll() is None:
            return
        self.c.agents[name] = self.c.spawn(f"agent-{name}", self.c.args[f"agent-{name}"])

    async def _inject_hang(self, now: float) -> FaultRecord | None:
        victim = self._worker_pid()
        if victim is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim[1], signal.SIGSTOP)
        return self._record(
            "hang (worker SIGSTOP)", f"{victim[0]} pid {victim[1]}", "hang_suspected", now,
            note=f"no progress for max({self.c.cfg.hang_floor_s:g} s, 5 steps); the world restarts",
            recovers=True,
        )  # fmt: skip

    async def _inject_straggler(self, now: float) -> FaultRecord | None:
        world = self._world()
        steps = [w.window_steps for n in world for w in n.workers]
        if not steps or min(steps) < STRAGGLER_WARM_STEPS:
            # not yet: the detector learns each node's usual cost from its first windows
            self.plan.insert(0, "straggler")
            return None
        target = world[0].node_id
        f = self._record(
            f"straggler (node {STRAGGLER_FACTOR - 1:.0%} slower)", target, "straggler_suspected",
            now, recovers=True, detect_limit_s=STRAGGLER_DETECT_LIMIT_S,
            note="named by the straggler sweep; evicted, a spare takes its ranks",
        )  # fmt: skip
        req = dpb.InjectFaultRequest(node_id=target, kind="slow-train", factor=STRAGGLER_FACTOR)
        ok, detail = await self._rpc("InjectFault", req)
        if not ok:
            f.skipped, f.note = True, f"the driver cannot inject it ({detail[:60]})"
        return f

    async def _inject_loss_spike(self, now: float) -> FaultRecord | None:
        if self.w.step() < SPIKE_MIN_STEP:
            self.plan.insert(0, "loss_spike")  # not yet: asked again at the next poll
            return None
        nodes = [n.node_id for n in self._world()]
        step = self.w.step() + SPIKE_AHEAD
        f = self._record(
            "loss spike (poisoned batch)", ",".join(nodes), "loss_spike", now, recovers=True,
            note="rollback to the newest committed step before it; batches skipped",
        )  # fmt: skip
        for n in nodes:
            req = dpb.InjectFaultRequest(node_id=n, kind=LOSS_SPIKE, step=step)
            ok, _ = await self._rpc("InjectFault", req)
            if not ok:  # an agent without InjectFault: write its workers' fault file
                fault = WorkerFault(LOSS_SPIKE, step, uuid.uuid4().hex)
                fault.write(self.c.run / "workers" / n / FAULT_FILE)
        return f

    async def _inject_bad_node(self, now: float) -> FaultRecord | None:
        nodes = [n.node_id for n in self._world()]
        if not nodes:
            return None
        target = nodes[0]
        f = self._record(
            "silently bad node (wrong matmul)", target, "self_check_reported", now,
            recovers=True, note="found by its self-check",
        )  # fmt: skip
        ok, detail = await self._rpc(
            "InjectFault", dpb.InjectFaultRequest(node_id=target, kind="wrong-matmul")
        )
        if not ok:
            f.skipped, f.note = True, f"the driver cannot inject it ({detail[:60]})"
            return f

        async def check() -> None:  # in the background: the live view keeps updating
            ok, detail = await self._rpc(
                "RunSelfCheck", dpb.RunSelfCheckRequest(node_ids=[target]), timeout_s=90.0
            )
            if not ok and f.detected_s is None:
                f.skipped, f.note = True, f"no self-check ({detail[:60]})"

        self._checks.add(t := asyncio.create_task(check()))
        t.add_done_callback(self._checks.discard)
        return f

    async def _inject_driver_kill(self, now: float) -> FaultRecord | None:
        leader = self.w.leader
        if len(self.c.drivers) < 2 or not leader:
            return self._skip("driver SIGKILL", "needs a standby (--no-standby)", now)
        signal_group(self.c.drivers[leader], signal.SIGKILL)
        other = next(n for n in self.c.drivers if n != leader)
        f = self._record(
            "driver SIGKILL", leader, "leader_elected", now,
            note=f"standby {other} took over; training went on; {leader} restarts as standby",
        )  # fmt: skip
        # back as a standby once the election is over (not racing the standby for it)
        asyncio.get_running_loop().call_later(RESPAWN_DRIVER_S, self._respawn_driver, leader)
        return f

    def _respawn_driver(self, name: str) -> None:
        """The killed driver comes back as the standby, on its old address."""
        if self.c.stopping or self.c.drivers[name].poll() is None:
            return
        args = list(self.c.args[name])
        args[args.index("--listen") + 1] = self.c.addresses[name]
        self.c.drivers[name] = self.c.spawn(name, args)

    async def _inject_driver_kill_mid_recovery(self, now: float) -> FaultRecord | None:
        leader = self.w.leader
        standbys = [n for n, p in self.c.drivers.items() if n != leader and p.poll() is None]
        if not leader or len(self.c.drivers) < 2:
            return self._skip("driver SIGKILL mid-recovery", "needs a standby (--no-standby)", now)
        if not standbys:  # the driver killed before is still restarting: ask again next poll
            self.plan.insert(0, "driver_kill_mid_recovery")
            return None
        victim = self._worker_pid()
        if victim is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim[1], signal.SIGKILL)
        return self._record(
            "driver SIGKILL mid-recovery", leader, "leader_elected", now, recovers=True,
            armed=False,
            note=f"worker {victim[0]} SIGKILLed; leader killed after TrainingPaused",
        )  # fmt: skip

    def _kill_leader_now(self, f: FaultRecord, now: float) -> None:
        p = self.c.drivers.get(f.target)
        if p is not None:
            signal_group(p, signal.SIGKILL)
        f.armed = True
        f.injected_at, f.injected_wall_ns = now, time.time_ns()

    def _skip(self, fault: str, why: str, now: float) -> FaultRecord:
        return self._record(fault, "-", "-", now, skipped=True, note=why)

    async def _rpc(self, method: str, req: Any, timeout_s: float = 30.0) -> tuple[bool, str]:
        """Call the leader's operator RPC; (ok, detail)."""
        addr = self.c.addresses.get(self.w.leader, "")
        if not addr:
            return False, "no leader"
        try:
            async with grpc.aio.insecure_channel(addr) as ch:
                resp = await getattr(dgrpc.DriverStub(ch), method)(
                    req, timeout=timeout_s, metadata=self.c.metadata()
                )
        except (grpc.RpcError, AttributeError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            return False, detail or type(e).__name__
        if isinstance(resp, dpb.RunSelfCheckResponse):
            return True, "; ".join(f"{r.node_id}: ok={r.ok}" for r in resp.results)
        return bool(getattr(resp, "ok", True)), str(getattr(resp, "detail", ""))


def _matches(e: ev.Event, f: FaultRecord) -> bool:
    kind = e.WhichOneof("payload")
    if kind == "leader_elected":  # after the kill: a new term, whoever won it
        return True
    if kind == "node_lost":
        return e.node_lost.node_id == f.target
    if kind in ("worker_failed", "hang_suspected"):
        return f.target.startswith(getattr(e, kind).node_id + " ")
    if kind == "straggler_suspected":
        return e.straggler_suspected.node_id == f.target
    if kind == "self_check_reported":
        return e.self_check_reported.node_id == f.target and not e.self_check_reported.ok
    return kind == "loss_spike"
