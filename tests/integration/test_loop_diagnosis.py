"""Diagnosis inside the recovery loop: a silently corrupt node is found, evicted and replaced.

The cluster of test_recovery_loop.py (a real driver on real etcd that starts and recovers
a dp2 tiny-model job on agents n0, n1, with spare s0). Once training runs:

1. A second spare s1 joins with a corrupt device (`--inject-fault wrong_matmul`): its
   registration self-check fails and the machine marks the idle spare bad (evicted).
2. `unbroken inject wrong-matmul --node n1` corrupts n1 at runtime (no error, wrong
   numbers) and `unbroken selfcheck --node n1` reports it (exit 1). The loop pauses the
   job (PAUSED), runs the bisection over the suspect with the known-good n0 and s0
   (DiagnosisRound events), gets a verdict naming exactly n1, evicts it, puts the healthy
   spare s0 in its rank and training resumes past the fault, restored from flash copies.

The driver runs with `--self-check-evicts ""`: by default (Policy.self_check_evicts, matmul
and ECC) a node whose own self-check computed a wrong matmul is evicted at once, without
the diagnosis this test is about. A second, shorter test runs that default on its own
cluster: the same runtime wrong matmul on n1 is evicted without a DiagnosisRound or
DiagnosisVerdict, and s0 takes its rank.

A fast test checks that a diagnosis that cannot run still ends in a verdict (the loop
never waits in PAUSED for one that will not come): suspects without a session are named
bad at once, and a diagnosis past its deadline names every suspect bad, unconfirmed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import Job
from unbroken.cli.cluster import until
from unbroken.driver.diagnose import DriverDiagnoseConfig, diagnose_incident
from unbroken.driver.service import DriverService, ServiceConfig
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

WAIT_S = 600.0  # 2 shared cores: torch imports, checks and restores take their time


def unbroken(j: Job, *args: str) -> subprocess.CompletedProcess[str]:
    """`unbroken ARGS --driver <the job's driver>` as an operator would run it."""
    return subprocess.run(
        [sys.executable, "-m", "unbroken.cli", *args, "--driver", j.address],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


class FaultyJob(Job):
    """test_recovery_loop's Job whose agents can be started with extra flags, and run their
    registration self-check (what these tests are about)."""

    selfcheck = True

    def __init__(self, tmp: Path, endpoint: str) -> None:
        super().__init__(tmp, endpoint)
        self.extra: dict[str, list[str]] = {}

    def spawn(self, name: str, args: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        return super().spawn(name, [*args, *self.extra.get(name, [])], **kw)

    def start_driver(self, *extra: str, **kw: Any) -> str:  # type: ignore[override]
        """Job.start_driver for a heavily loaded machine: longer deadlines."""
        # 10 s: torch imports and checks on 2 loaded cores starve heartbeats; a node lost
        # here would be replaced without the diagnosis under test
        return super().start_driver("--miss-limit", "100", *extra, wait_s=WAIT_S, **kw)


@pytest.fixture
def job(tmp_path: Path, etcd_server: object) -> Iterator[FaultyJob]:
    j = FaultyJob(tmp_path, etcd_server.endpoint)  # type: ignore[attr-defined]
    try:
        yield j
    finally:
        j.close()


def was_evicted(j: Job, node: str) -> bool:
    return any(e.HasField("node_evicted") and e.node_evicted.node_id == node for e in j.events())


def corrupt_n1_and_check_it(j: Job) -> int:
    """`unbroken inject wrong-matmul` on n1, then its failing self-check; the step then."""
    r = unbroken(j, "inject", "wrong-matmul", "--node", "n1")
    assert r.returncode == 0, (r.stdout, r.stderr)
    # (a generous deadline: under heavy load a self-check that times out also fails)
    r = unbroken(j, "selfcheck", "--node", "n1", "--check-timeout", "500")
    assert r.returncode == 1 and "failed: n1" in r.stderr, (r.stdout, r.stderr)
    return j.max_step()


def s0_took_n1s_rank(j: Job, events: list[ev.Event]) -> None:
    """The spare s0 replaced n1 in its rank position, alone, and restored."""
    spares = [
        (e.spare_assigned.spare_node_id, e.spare_assigned.replaces_node_id)
        for e in events
        if e.HasField("spare_assigned")
    ]
    assert spares == [("s0", "n1")], spares
    resumed = [e.training_resumed for e in events if e.HasField("training_resumed")]
    start = next(e.job_started.world for e in events if e.HasField("job_started"))
    assert sorted(start.node_ids) == ["n0", "n1"], start
    replaced = ["s0" if n == "n1" else n for n in start.node_ids]  # s0 in n1's rank
    assert list(resumed[-1].world.node_ids) == replaced, resumed[-1]
    assert "restored" in j.worker_log("s0"), j.worker_log("s0")[-3000:]


def after_n1_failed_its_check(events: list[ev.Event]) -> list[str]:
    """The kinds of the events from n1's first failed SelfCheckReported on."""
    first_fail = next(
        i
        for i, e in enumerate(events)
        if e.HasField("self_check_reported")
        and e.self_check_reported.node_id == "n1"
        and not e.self_check_reported.ok
    )
    return [str(e.WhichOneof("payload")) for e in events[first_fail:]]


def test_a_diagnosis_that_cannot_run_still_gives_a_verdict() -> None:
    async def scenario() -> list[ev.DiagnosisVerdict]:
        service = DriverService(ServiceConfig(), driver_id="d", job_id="j")
        cfg = DriverDiagnoseConfig(check_timeout_s=5.0, reply_slack_s=1.0)
        gone = await diagnose_incident(
            service, "i7-dx", [], ["n0"], config=cfg, deadline_s=30, unreachable=["n1"]
        )
        # sessions gone after the suspects were chosen: their checks cannot be sent
        failed = await diagnose_incident(
            service, "i8-dy", ["n2", "n3"], [], config=cfg, deadline_s=30
        )
        # a deadline that has passed before the first round
        late = await diagnose_incident(service, "i9-dz", ["n4", "n5"], [], config=cfg, deadline_s=0)
        await service.close()
        return [gone, failed, late]

    gone, failed, late = asyncio.run(scenario())
    assert (gone.diagnosis_id, list(gone.bad_nodes), gone.rounds) == ("i7-dx", ["n1"], 0)
    assert (failed.diagnosis_id, list(failed.bad_nodes)) == ("i8-dy", ["n2", "n3"])
    assert failed.rounds >= 1, failed
    assert (late.diagnosis_id, list(late.bad_nodes)) == ("i9-dz", ["n4", "n5"])
    assert not late.confirmed_directly and late.rounds == 0  # unconfirmed: evicted anyway


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_wrong_matmul_node_is_diagnosed_evicted_and_replaced(job: FaultyJob) -> None:
    job.start_driver("--self-check-evicts", "")  # diagnose a failed matmul self-check too
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    job.start_agent("s0", buddy="n0", spare=True)
    until(lambda: job.max_step() >= 3, WAIT_S, "training to start", job)

    # 1. A spare whose registration self-check fails is marked bad.
    job.extra["s1"] = ["--inject-fault", "wrong_matmul"]
    job.start_agent("s1", buddy="n0", spare=True)

    until(lambda: was_evicted(job, "s1"), WAIT_S, "the corrupt spare marked bad", job)

    # 2. n1 goes silently bad at runtime; its self-check says so.
    fault_step = corrupt_n1_and_check_it(job)

    def verdict() -> ev.DiagnosisVerdict | None:
        got = [e.diagnosis_verdict for e in job.events() if e.HasField("diagnosis_verdict")]
        return got[-1] if got else None

    until(lambda: verdict() is not None, WAIT_S, "the diagnosis verdict", job)
    until(
        lambda: job.worker("s0") is not None and job.max_step() >= fault_step + 3,
        WAIT_S,
        "s0 to train past the fault",
        job,
    )

    events = job.events()
    v = verdict()
    assert v is not None and list(v.bad_nodes) == ["n1"], v
    assert "n1" in v.confirmed_directly, v
    rounds = [e.diagnosis_round for e in events if e.HasField("diagnosis_round")]
    mine = [r for r in rounds if r.diagnosis_id == v.diagnosis_id]
    assert mine, rounds
    for r in mine:
        for g in r.groups:
            assert g.ok == ("n1" not in g.node_ids), r  # only groups with n1 fail
            assert "s1" not in g.node_ids, r  # a bad spare is no partner
    evicted = {e.node_evicted.node_id: e.node_evicted for e in events if e.HasField("node_evicted")}
    assert evicted["n1"].diagnosis_id == v.diagnosis_id, evicted
    assert "n0" not in evicted and "s0" not in evicted, evicted
    s0_took_n1s_rank(job, events)
    phases = [
        ev.Phase.Name(e.recovery_transition.to_phase)
        for e in events
        if e.HasField("recovery_transition")
    ]
    for p in ("PHASE_SUSPECTED", "PHASE_DIAGNOSED", "PHASE_RESHAPED"):  # (PAUSED: the
        assert p in phases, phases  # TrainingPaused event moves the fold; checked below)
    tail = after_n1_failed_its_check(events)
    assert (
        tail.index("training_paused")
        < tail.index("diagnosis_round")
        < tail.index("diagnosis_verdict")
        < tail.index("node_evicted")
        < tail.index("spare_assigned")
    ), tail


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_wrong_matmul_node_is_evicted_on_its_self_check_without_a_diagnosis(
    job: FaultyJob,
) -> None:
    job.start_driver()  # the default policy: a wrong matmul self-check evicts at once
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    job.start_agent("s0", buddy="n0", spare=True)
    until(lambda: job.max_step() >= 3, WAIT_S, "training to start", job)

    fault_step = corrupt_n1_and_check_it(job)
    until(lambda: was_evicted(job, "n1"), WAIT_S, "n1 evicted", job)
    until(
        lambda: job.worker("s0") is not None and job.max_step() >= fault_step + 3,
        WAIT_S,
        "s0 to train past the fault",
        job,
    )

    events = job.events()
    order = [e.WhichOneof("payload") for e in events]
    assert "diagnosis_round" not in order and "diagnosis_verdict" not in order, order
    evicted = {e.node_evicted.node_id: e.node_evicted for e in events if e.HasField("node_evicted")}
    assert set(evicted) == {"n1"}, evicted
    assert evicted["n1"].diagnosis_id == "", evicted
    assert "without a diagnosis" in evicted["n1"].reason, evicted
    assert "matmul" in evicted["n1"].reason, evicted
    s0_took_n1s_rank(job, events)
    suspected = [
        e.recovery_transition
        for e in events
        if e.HasField("recovery_transition")
        and e.recovery_transition.to_phase == ev.PHASE_SUSPECTED
    ]
    assert suspected and list(suspected[0].bad_nodes) == ["n1"], suspected
    assert not any(t.diagnose for t in suspected), suspected  # no diagnosis was asked for
    tail = after_n1_failed_its_check(events)
    assert (
        tail.index("training_paused")
        < tail.index("node_evicted")
        < tail.index("spare_assigned")
        < tail.index("training_resumed")
    ), tail
