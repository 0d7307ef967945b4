"""Diagnosis through the agents: pause training, run the bisection, record it, resume.

The bisection itself (planner, judge, round loop) lives in diagnostics/runner.py and knows
nothing about gRPC. This module is its driver-side shell: `AgentRunGroup` runs one group
check by sending RunCheck to each member's agent over its session stream (the TCPStore
rendezvous sits on the group's first member), and `run_diagnosis` wraps the whole loop in
"pause, check, resume": agents whose workers are training get a Pause (acks awaited with a
deadline), every round and the verdict are appended to the event log as they finish, and
the paused agents get a Resume whatever happened in between.

Pause and resume are recorded as OperatorAction events, not TrainingPaused/Resumed: an
operator's check in the middle of training is not an incident, and TrainingResumed would
close one that is open.

`diagnose_incident` is the recovery loop's variant (driver/loop.py): the workers are
already stopped, so it neither pauses nor resumes; it checks the incident's suspects
against known-good partners and always returns a verdict, which the loop feeds to the
state machine. A diagnosis that cannot finish (deadline, agents gone, an error) yields
the fallback verdict: every suspect named bad, none confirmed directly, so the loop evicts
the suspects rather than wedging in PAUSED.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from unbroken.common import aio
from unbroken.diagnostics.check import free_port, group_specs
from unbroken.diagnostics.runner import (
    Diagnosis,
    DiagnosisConfig,
    Group,
    Results,
    RoundRecord,
    diagnose,
    round_event,
    verdict_event,
)
from unbroken.diagnostics.schema import CheckResult
from unbroken.driver.liveview import LiveView
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

LOOPBACK = "127.0.0.1"


class DiagnoseError(Exception):
    """The diagnosis could not run (e.g. an agent did not acknowledge Pause)."""


#: How a diagnosis records its events: the journal's `record` (one transaction per call).
Recorder = Callable[..., Awaitable[list[ev.Event]]]


class CommandSender(Protocol):
    """What this module needs of the driver service: send a command, await its reply."""

    view: LiveView

    async def request(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> dpb.AgentMessage: ...


@dataclass(kw_only=True, slots=True)
class DriverDiagnoseConfig:
    """Settings of a diagnosis run by the driver.

    Attributes:
        runner: rounds, planner and judge settings (diagnostics/runner.py).
        check_timeout_s: deadline of one group check inside the check process.
        reply_slack_s: extra time the driver waits for an agent's result after that.
        matmul_iters: matmul repetitions per check (more: steadier times, slower).
        ack_timeout_s: deadline for each Pause/Resume acknowledgement.
    """

    runner: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    check_timeout_s: float = 60.0
    reply_slack_s: float = 20.0
    matmul_iters: int = 16
    ack_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("check_timeout_s", "reply_slack_s", "ack_timeout_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.matmul_iters < 1:
            raise ValueError(f"matmul_iters must be >= 1, got {self.matmul_iters}")


def store_host(view: LiveView, group: Sequence[str]) -> str:
    """Where the group's members reach the TCPStore on its first member.

    Loopback when every member connected from the same address (one machine), otherwise
    the address the first member connected from (the transport's, not a claimed one).
    """
    ips = {view.nodes[n].peer_host if n in view.nodes else "" for n in group}
    first = view.nodes[group[0]].peer_host if group[0] in view.nodes else ""
    return LOOPBACK if len(ips) <= 1 or not first else first


class AgentRunGroup:
    """A diagnostics ``RunGroup`` that runs each member's check on its agent."""

    def __init__(
        self,
        service: CommandSender,
        config: DriverDiagnoseConfig,
        on_progress: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """Args: service: sends RunCheck; config: timeouts; on_progress(round, total, done)."""
        self.service = service
        self.config = config
        self.on_progress = on_progress
        self._total: dict[int, int] = {}
        self._done: dict[int, int] = {}

    async def __call__(self, check_id: str, group: Group, index: int) -> Results:
        cfg = self.config
        self._total[index] = self._total.get(index, 0) + 1
        self._progress(index)
        # The port is picked here, on the driver: exact on one machine; across machines a
        # collision on the first member makes that group fail as a timeout (retried by the
        # planner's next round as a suspect pair).
        specs = group_specs(
            check_id,
            group,
            store_host=store_host(self.service.view, group),
            store_port=free_port(),
            timeout_s=cfg.check_timeout_s,
            matmul_iters=cfg.matmul_iters,
        )

        async def one(node_id: str, spec_json: str) -> CheckResult | None:
            cmd = dpb.DriverMessage(
                run_check=dpb.RunCheck(
                    spec_json=spec_json, timeout_s=cfg.check_timeout_s + cfg.reply_slack_s / 2
                )
            )
            reply = await self.service.request(
                node_id, cmd, cfg.check_timeout_s + cfg.reply_slack_s
            )
            line = reply.check_result.result_json
            if not line:
                log.warning(
                    "check gave no result",
                    node=node_id,
                    check_id=check_id,
                    exit_code=reply.check_result.exit_code,
                    stderr=reply.check_result.stderr_tail[-400:],
                )
                return None
            return CheckResult.from_json(line)

        try:
            got = await asyncio.gather(
                *(one(s.node_id, s.to_json()) for s in specs), return_exceptions=True
            )
        finally:
            self._done[index] = self._done.get(index, 0) + 1
            self._progress(index)
        out: dict[str, CheckResult | None] = {}
        for s, r in zip(specs, got, strict=True):
            if isinstance(r, BaseException):
                log.warning("check failed", node=s.node_id, check_id=check_id, error=repr(r))
                out[s.node_id] = None
            else:
                out[s.node_id] = r
        return out

    def _progress(self, index: int) -> None:
        if self.on_progress is not None:
            self.on_progress(index, self._total.get(index, 0), self._done.get(index, 0))


def training_nodes(view: LiveView) -> list[str]:
    """Connected nodes whose last heartbeat shows a worker running (to pause)."""
    return sorted(
        s.node_id
        for s in view.nodes.values()
        if s.alive
        and s.outbox is not None
        and any(w.state == dpb.WORKER_STATE_RUNNING for w in s.hb.workers)
    )


def live_step(view: LiveView, nodes: Sequence[str]) -> int:
    """The highest step any worker of `nodes` reported."""
    return max(
        (w.step for n in nodes if n in view.nodes for w in view.nodes[n].hb.workers), default=0
    )


async def _command_all(
    service: CommandSender, nodes: Sequence[str], make: Callable[[], dpb.DriverMessage], t: float
) -> dict[str, str]:
    """Send a command to every node; node -> problem ("" when acknowledged ok)."""

    async def one(n: str) -> str:
        try:
            reply = await service.request(n, make(), t)
        except TimeoutError:
            return f"no acknowledgement within {t} s"
        except KeyError as e:
            return str(e)
        return "" if reply.ack.ok else (reply.ack.detail or "refused")

    got = await asyncio.gather(*(one(n) for n in nodes))
    return dict(zip(nodes, got, strict=True))


async def run_diagnosis(
    service: CommandSender,
    record: Recorder,
    nodes: Sequence[str],
    *,
    config: DriverDiagnoseConfig,
    diagnosis_id: str | None = None,
    who: str = "",
    known_good: Sequence[str] = (),
    on_started: Callable[[dpb.DiagnoseStarted], None] | None = None,
    on_progress: Callable[[int, int, int], None] | None = None,
    on_round: Callable[[ev.DiagnosisRound], object] | None = None,
) -> Diagnosis:
    """Pause training (if any), diagnose `nodes`, append the events, resume.

    Args:
        service: sends commands to agents (the driver service).
        record: the term journal's `record`; every round and the verdict are recorded.
        nodes: the nodes to check (each with an open session).
        config: timeouts and check size.
        diagnosis_id: id for events and check ids (default: fresh).
        who: the operator, for the OperatorAction event.
        known_good: trusted partners (not themselves under test).
        on_started, on_progress, on_round: observers for a streaming caller.

    Returns:
        The finished diagnosis (its verdict is also in the log).

    Raises:
        DiagnoseError: a training agent did not acknowledge Pause (the others are resumed).
        EventLogError: the log refused an append (e.g. leadership lost).
    """
    did = diagnosis_id or uuid.uuid4().hex[:12]
    (start,) = await record(
        ev.Event(
            cause="operator",
            operator_action=ev.OperatorAction(action="diagnose", target=",".join(nodes), who=who),
        )
    )
    paused, at_step = await _pause_training(service, record, config, did, start.event_id, who)
    if on_started is not None:
        on_started(dpb.DiagnoseStarted(diagnosis_id=did, node_ids=list(nodes), paused_nodes=paused))

    async def record_round(r: RoundRecord) -> None:
        payload = round_event(did, r)
        await record(ev.Event(cause=start.event_id, diagnosis_round=payload))
        if on_round is not None:
            on_round(payload)

    try:
        d = await diagnose(
            list(nodes),
            run_group=AgentRunGroup(service, config, on_progress),
            known_good=known_good,
            config=config.runner,
            diagnosis_id=did,
            on_round=record_round,
        )
        await record(ev.Event(cause=start.event_id, diagnosis_verdict=verdict_event(d)))
        return d
    finally:
        if paused:
            await _resume(service, record, paused, at_step, config, start.event_id, who)


async def _pause_training(
    service: CommandSender,
    record: Recorder,
    config: DriverDiagnoseConfig,
    did: str,
    cause: str,
    who: str,
) -> tuple[list[str], int]:
    """Pause every training node for diagnosis `did`; (the paused nodes, their live step).

    Raises:
        DiagnoseError: a node did not acknowledge Pause (the others are resumed first).
    """
    to_pause = training_nodes(service.view)
    at_step = live_step(service.view, to_pause)
    if not to_pause:
        return [], at_step
    problems = await _command_all(
        service,
        to_pause,
        lambda: dpb.DriverMessage(pause=dpb.Pause(reason=f"diagnosis {did}")),
        config.ack_timeout_s,
    )
    paused = [n for n in to_pause if not problems[n]]
    failed = {n: p for n, p in problems.items() if p}
    await record(
        ev.Event(
            cause=cause,
            operator_action=ev.OperatorAction(action="pause", target=",".join(paused), who=who),
        )
    )
    log.info("training paused for diagnosis", diagnosis_id=did, nodes=paused, step=at_step)
    if failed:
        await _resume(service, record, paused, at_step, config, cause, who)
        raise DiagnoseError(
            "could not pause training on "
            + "; ".join(f"{n}: {p}" for n, p in sorted(failed.items()))
            + " (the other nodes were resumed); check those agents and retry"
        )
    return paused, at_step


async def _resume(
    service: CommandSender,
    record: Recorder,
    nodes: Sequence[str],
    at_step: int,
    config: DriverDiagnoseConfig,
    cause: str,
    who: str,
) -> None:
    problems = await _command_all(
        service,
        nodes,
        lambda: dpb.DriverMessage(resume=dpb.Resume(at_step=at_step)),
        config.ack_timeout_s,
    )
    for n, p in problems.items():
        if p:
            log.error("resume after diagnosis not acknowledged", node=n, problem=p)
    await record(
        ev.Event(
            cause=cause,
            operator_action=ev.OperatorAction(
                action="resume", target=",".join(n for n in nodes if not problems[n]), who=who
            ),
        )
    )


async def diagnose_incident(
    service: CommandSender,
    diagnosis_id: str,
    suspects: Sequence[str],
    known_good: Sequence[str],
    *,
    config: DriverDiagnoseConfig,
    deadline_s: float,
    unreachable: Sequence[str] = (),
    on_round: Callable[[ev.DiagnosisRound], object] | None = None,
) -> ev.DiagnosisVerdict:
    """Diagnose an incident's suspects against known-good partners; always a verdict.

    Args:
        service: sends RunCheck to the agents.
        diagnosis_id: the incident's diagnosis id (``machine.diagnosis_id``): a re-run after
            a driver failover reports under the same id.
        suspects: the nodes under suspicion that can take commands.
        known_good: trusted partners (healthy world nodes that are not suspects, spares).
        config: check and round timeouts.
        deadline_s: deadline of the whole diagnosis.
        unreachable: suspects without a session: named bad at once (unconfirmed), not checked
            (a partner would wait out the check's rendezvous for nothing).
        on_round: called with each round's event payload, in order.

    Returns:
        The verdict. Suspects the checks could not decide are named bad (unconfirmed); when
        the diagnosis fails or runs out of time every suspect is named bad and none is
        confirmed directly (the fallback: evict the suspects).
    """
    t0 = time.monotonic()
    gone = sorted(set(unreachable))
    bound = log.bind(diagnosis_id=diagnosis_id)
    if not suspects:
        return ev.DiagnosisVerdict(diagnosis_id=diagnosis_id, bad_nodes=gone)

    def record(r: RoundRecord) -> None:
        if on_round is not None:
            on_round(round_event(diagnosis_id, r))

    try:
        d = await aio.wait_for(
            diagnose(
                list(suspects),
                run_group=AgentRunGroup(service, config),
                known_good=[n for n in known_good if n not in suspects],
                config=config.runner,
                diagnosis_id=diagnosis_id,
                on_round=record,
            ),
            deadline_s,
        )
    except Exception as e:  # TimeoutError included; CancelledError is not caught
        bound.error(
            "diagnosis failed; naming every suspect bad (unconfirmed)",
            suspects=list(suspects),
            error=repr(e),
        )
        return ev.DiagnosisVerdict(
            diagnosis_id=diagnosis_id,
            bad_nodes=sorted({*suspects, *gone}),
            wall_s=time.monotonic() - t0,
        )
    v = verdict_event(d)
    named = set(v.bad_nodes)
    extra = [n for n in (*d.verdict.undetermined, *gone) if n not in named]
    if extra:
        bound.warning("suspects not decided by the checks are named bad", nodes=extra)
        v.bad_nodes.extend(sorted(set(extra)))
    return v
