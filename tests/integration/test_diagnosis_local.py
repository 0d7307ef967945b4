"""A real diagnosis with real check processes (gloo on loopback): bad and slow nodes named."""

from __future__ import annotations

import asyncio

import pytest

from unbroken.diagnostics.runner import (
    DiagnosisConfig,
    LocalRunGroup,
    diagnose,
    round_event,
    verdict_event,
)

pytestmark = pytest.mark.integration

NODES = [f"n{i}" for i in range(4)]


def test_wrong_matmul_and_2x_slow_named_exactly() -> None:
    run = LocalRunGroup({"n1": "wrong_matmul", "n2": "slow:2.0"}, timeout_s=40, matmul_iters=10)
    d = asyncio.run(diagnose(NODES, run_group=run, config=DiagnosisConfig(round_timeout_s=90)))
    assert d.verdict.bad == ("n1",)
    assert d.verdict.confirmed_directly == ("n1",)
    assert d.verdict.slow == ("n2",), d.slow_report
    assert d.verdict.undetermined == ()
    ve = verdict_event(d)
    assert list(ve.bad_nodes) == ["n1"] and list(ve.slow_nodes) == ["n2"]
    assert round_event(d.diagnosis_id, d.rounds[0]).groups


def test_hung_allgather_is_isolated_by_bisection() -> None:
    # A hang cannot be pinned on a member from its output: round 1 fails a pair on
    # timeout, round 2 pairs both suspects with nodes that passed. Start-up (torch import)
    # gets a generous timeout_s on a loaded 2-core box; the hang is caught by
    # phase_timeout_s, counted once every member has arrived.
    run = LocalRunGroup({"n3": "hang_allgather"}, timeout_s=60, phase_timeout_s=6, matmul_iters=2)
    d = asyncio.run(diagnose(NODES, run_group=run, config=DiagnosisConfig(round_timeout_s=90)))
    assert d.verdict.bad == ("n3",)
    assert d.verdict.rounds == 2
    assert (
        d.rounds[0].outcomes[[("n3" in o.nodes) for o in d.rounds[0].outcomes].index(True)].failure
        == "timeout"
    )
    assert d.verdict.confirmed_directly == ("n3",)
