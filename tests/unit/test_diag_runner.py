"""The diagnosis loop over a simulated run_group (no processes): rounds, verdict, link retest."""

from __future__ import annotations

import asyncio
import random

import pytest

from unbroken.diagnostics.runner import DiagnosisConfig, Group, Results, RoundRecord, diagnose
from unbroken.diagnostics.schema import CheckResult

pytestmark = pytest.mark.unit

NODES = [f"n{i}" for i in range(8)]


class Sim:
    """Truthful checks: bad nodes time out their group, slow ones are slow."""

    def __init__(
        self, bad: set[str], slow: dict[str, float], slow_link: dict[str, float], seed: int
    ) -> None:
        self.bad, self.slow, self.slow_link = bad, slow, slow_link
        self.rng = random.Random(seed)
        self.groups: list[Group] = []

    async def __call__(self, check_id: str, group: Group, index: int) -> Results:
        self.groups.append(group)
        failed = bool(set(group) & self.bad)
        ag = 5.0 * max(self.slow_link.get(n, 1.0) for n in group)
        out: dict[str, CheckResult | None] = {}
        for n in group:
            t = 10.0 * self.slow.get(n, 1.0)
            samples = [t * (1 + self.rng.gauss(0, 0.01)) for _ in range(8)]
            ags = [ag * (1 + self.rng.gauss(0, 0.02)) for _ in range(4)]
            out[n] = CheckResult(
                check_id=check_id,
                node_id=n,
                rank=group.index(n),
                group=list(group),
                ok=not failed,
                failure="timeout" if failed else "",
                matmul_ms=sorted(samples)[4],
                matmul_samples_ms=samples,
                allgather_ms=0.0 if failed else sorted(ags)[2],
                allgather_samples_ms=[] if failed else ags,
            )
        return out


def test_bad_slow_and_link_slow_nodes_are_named() -> None:
    for seed in range(5):
        sim = Sim({"n3"}, {"n5": 2.0}, {"n6": 4.0}, seed)
        seen: list[int] = []

        def on_round(r: RoundRecord, seen: list[int] = seen) -> None:
            seen.append(r.index)

        cfg = DiagnosisConfig(link_retest=True)
        d = asyncio.run(diagnose(NODES, run_group=sim, on_round=on_round, config=cfg))
        v = d.verdict
        assert v.bad == ("n3",) and v.confirmed_directly == ("n3",)
        assert v.slow == ("n5", "n6"), d.slow_report
        assert seen == list(range(1, v.rounds + 1)) and v.checks == len(sim.groups)
        assert v.rounds == 3  # pairs, suspects with partners, link retest


def test_without_link_retest_a_slow_link_is_a_suspect_pair() -> None:
    sim = Sim(set(), {}, {"n6": 4.0}, 0)
    d = asyncio.run(diagnose(NODES, run_group=sim))
    assert d.verdict.rounds == 1 and d.verdict.slow == ()
    assert any("n6" in g for g in d.slow_report.slow_links)


def test_a_group_whose_transport_fails_counts_as_failed() -> None:
    async def broken(check_id: str, group: Group, index: int) -> Results:
        if "n1" in group:
            raise ConnectionError("agent unreachable")
        return await Sim(set(), {}, {}, 0)(check_id, group, index)

    d = asyncio.run(diagnose(NODES, run_group=broken))
    assert d.verdict.bad == ("n1",)
