"""The diagnosis loop: ask the planner for a round, run its groups, judge them, repeat.

A thin async shell around the pure planner and judge. How a group check is run is
pluggable (``RunGroup``): the driver sends "run check" commands to the agents of the
group's nodes and collects their result lines; ``LocalRunGroup`` runs the members as
local processes (tests, the bench, a single machine). The result is plain data; the
driver turns it into events with ``round_event`` / ``verdict_event``. Nothing here
imports driver/ or agent/.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from unbroken.diagnostics.check import run_group_local
from unbroken.diagnostics.judge import JudgeConfig, SlowReport, find_slow, judge_group
from unbroken.diagnostics.planner import (
    GroupOutcome,
    PlannerConfig,
    Round,
    Verdict,
    analyze,
    next_step,
)
from unbroken.diagnostics.schema import CheckResult
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

Group = tuple[str, ...]
Results = Mapping[str, CheckResult | None]
# (check_id, group in rank order, round index) -> node id -> its result (absent: none came)
RunGroup = Callable[[str, Group, int], Awaitable[Results]]


@dataclass(kw_only=True, slots=True)
class DiagnosisConfig:
    """Settings of one diagnosis.

    Attributes:
        planner: planner settings.
        judge: slow-node thresholds.
        round_timeout_s: deadline for all groups of one round (a group still running then
            counts as timed out).
        link_retest: after the verdict, re-pair both ends of a pair whose all-gather was
            slow with different healthy nodes (one extra round) to find the slow end. Off
            by default: on a shared CPU box loopback all-gather times are noisy enough
            that a two-group retest round named a healthy node; suspect pairs are then
            reported as ``slow_links`` instead.
    """

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    round_timeout_s: float = 120.0
    link_retest: bool = False

    def __post_init__(self) -> None:
        if not self.round_timeout_s > 0:
            raise ValueError(f"round_timeout_s must be > 0, got {self.round_timeout_s}")


@dataclass(slots=True)
class RoundRecord:
    """One round as it happened."""

    index: int
    outcomes: list[GroupOutcome]
    results: dict[Group, dict[str, CheckResult | None]]
    wall_s: float


@dataclass(slots=True)
class Diagnosis:
    """A finished diagnosis: every round, the verdict (with slow nodes) and the numbers."""

    diagnosis_id: str
    rounds: list[RoundRecord]
    verdict: Verdict
    slow_report: SlowReport
    wall_s: float


OnRound = Callable[[RoundRecord], Any]


async def _run_one(
    run_group: RunGroup, check_id: str, group: Group, index: int
) -> dict[str, CheckResult | None]:
    try:
        got = await run_group(check_id, group, index)
    except Exception as e:  # one group's transport failing must not end the diagnosis
        log.warning("check_run_failed", check_id=check_id, group=group, error=str(e))
        got = {}
    return {n: got.get(n) for n in group}


async def diagnose(
    nodes: Sequence[str],
    *,
    run_group: RunGroup,
    known_good: Sequence[str] = (),
    config: DiagnosisConfig | None = None,
    diagnosis_id: str | None = None,
    on_round: OnRound | None = None,
) -> Diagnosis:
    """Run rounds until the planner gives its verdict.

    Args:
        nodes: the nodes to diagnose.
        run_group: runs one group check and returns its members' results.
        known_good: trusted healthy partners (spares, nodes with a clean history).
        config: settings.
        diagnosis_id: id for events and check ids (default: a fresh uuid).
        on_round: called (and awaited if it returns an awaitable) after every round,
            e.g. to append a DiagnosisRound event.

    Returns:
        The diagnosis with every round and the verdict.
    """
    cfg = config or DiagnosisConfig()
    did = diagnosis_id or uuid.uuid4().hex[:12]
    t0 = time.monotonic()
    history: list[list[GroupOutcome]] = []
    records: list[RoundRecord] = []
    while True:
        step = next_step(nodes, known_good, history, cfg.planner)
        if isinstance(step, Verdict):
            break
        assert isinstance(step, Round)
        record = await _run_round(did, step, run_group, cfg.round_timeout_s)
        log.info(
            "diagnosis_round",
            diagnosis_id=did,
            round=step.index,
            groups=len(step.groups),
            failed=[o.nodes for o in record.outcomes if not o.ok],
            wall_s=round(record.wall_s, 3),
        )
        history.append(record.outcomes)
        records.append(record)
        if on_round is not None:
            maybe = on_round(record)
            if inspect.isawaitable(maybe):
                await maybe
    excluded = list(step.bad) + list(step.undetermined)
    report = find_slow([r.results for r in records], exclude=excluded, config=cfg.judge)
    verdict = step
    retest = _link_retest(nodes, known_good, history, report, excluded)
    if cfg.link_retest and retest:
        # A slow all-gather in one pair cannot say which end is slow: re-pair each end
        # with a different healthy node once, then judge again.
        record = await _run_round(
            did, Round(index=len(records) + 1, groups=retest), run_group, cfg.round_timeout_s
        )
        records.append(record)
        if on_round is not None:
            maybe = on_round(record)
            if inspect.isawaitable(maybe):
                await maybe
        report = find_slow([r.results for r in records], exclude=excluded, config=cfg.judge)
        verdict = replace(verdict, rounds=verdict.rounds + 1, checks=verdict.checks + len(retest))
    verdict = replace(verdict, slow=report.slow)
    wall = time.monotonic() - t0
    log.info(
        "diagnosis_verdict",
        diagnosis_id=did,
        bad=verdict.bad,
        slow=verdict.slow,
        rounds=verdict.rounds,
        wall_s=round(wall, 3),
    )
    return Diagnosis(
        diagnosis_id=did, rounds=records, verdict=verdict, slow_report=report, wall_s=wall
    )


def _link_retest(
    nodes: Sequence[str],
    known_good: Sequence[str],
    history: Sequence[Sequence[GroupOutcome]],
    report: SlowReport,
    excluded: Sequence[str],
) -> tuple[Group, ...]:
    suspects = sorted({n for g in report.slow_links for n in g} - set(excluded))
    if not suspects:
        return ()
    good = analyze(nodes, known_good, history).good
    partners = sorted(good - set(suspects) - set(report.slow) - set(excluded))
    return tuple((s, p) for s, p in zip(suspects, partners, strict=False))


async def _run_round(did: str, step: Round, run_group: RunGroup, timeout_s: float) -> RoundRecord:
    t = time.monotonic()
    tasks = [
        asyncio.ensure_future(_run_one(run_group, f"{did}-r{step.index}-g{i}", g, step.index))
        for i, g in enumerate(step.groups)
    ]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    results: dict[Group, dict[str, CheckResult | None]] = {}
    for g, task in zip(step.groups, tasks, strict=True):
        results[g] = task.result() if task in done else dict.fromkeys(g)
    outcomes = [judge_group(g, results[g]) for g in step.groups]
    return RoundRecord(
        index=step.index, outcomes=outcomes, results=results, wall_s=time.monotonic() - t
    )


class LocalRunGroup:
    """A ``RunGroup`` that runs each member as a local check process (one machine)."""

    def __init__(self, faults: Mapping[str, str] | None = None, **options: Any) -> None:
        """Args: faults: node id -> fault spec; options: CheckSpec fields for every check."""
        self.faults = dict(faults or {})
        self.options = options

    async def __call__(self, check_id: str, group: Group, index: int) -> Results:
        return await run_group_local(check_id, group, faults=self.faults, **self.options)


# ---------------------------------------------------------------- events


def round_event(diagnosis_id: str, record: RoundRecord) -> ev.DiagnosisRound:
    """The DiagnosisRound event payload of one round."""
    msg = ev.DiagnosisRound(diagnosis_id=diagnosis_id, round=record.index)
    for outcome in record.outcomes:
        members = record.results.get(outcome.nodes, {})
        done = [r for r in members.values() if r is not None]
        g = msg.groups.add(node_ids=list(outcome.nodes), ok=outcome.ok, failure=outcome.failure)
        if done:
            g.matmul_ms = max(r.matmul_ms for r in done)
            g.allgather_ms = max(r.allgather_ms for r in done)
            g.total_ms = max(r.total_ms for r in done)
        for r in done:
            g.per_node_ms[r.node_id] = r.matmul_ms
    return msg


def verdict_event(diagnosis: Diagnosis) -> ev.DiagnosisVerdict:
    """The DiagnosisVerdict event payload of a finished diagnosis."""
    v = diagnosis.verdict
    return ev.DiagnosisVerdict(
        diagnosis_id=diagnosis.diagnosis_id,
        bad_nodes=list(v.bad),
        slow_nodes=list(v.slow),
        confirmed_directly=list(v.confirmed_directly),
        rounds=v.rounds,
        checks=v.checks,
        wall_s=diagnosis.wall_s,
    )
