"""Benchmark of the diagnosis: simulated clusters (ours vs DLRover's two rounds vs naive
halving) and real check processes on this machine. Writes bench/results/diagnosis.json.

Simulation. N nodes, k bad, 2 slow (1.2x and 2x). Bad nodes fail their group by timeout
(not attributable to a member: the hardest case for us, since a wrong matmul would be
blamed directly). Every node's matmul time per round is base * slowdown * (1 + 1 %
part-to-part) with 3 % per-iteration jitter over 8 iterations.
* ours: the real planner, judge and runner (unbroken.diagnostics.runner.diagnose) with a
  simulated run_group.
* DLRover (per docs/peers.md): round 0 pairs by rank, round 1 sorts by time and
  pairs fastest with slowest; a failed check scores 3600; bad = failed both rounds;
  straggler = group time > 2 x median in both rounds; N <= 3 isolates nothing.
* naive halving: test the two halves, split every failing set, until single nodes; slow
  nodes judged by our rule on the same per-node times (every member runs the matmul).

Real. 8 real ``unbroken agent`` processes on this machine, one started with
``--inject-fault wrong_matmul`` and one with ``--inject-fault slow:F`` for F = 1.1, 1.2,
1.5, 2; an in-process driver service sends RunCheck commands for every group (gloo on
loopback) and the same runner judges them (``--local``: check processes without agents).
5 runs each; a slowdown is "named" when all 5 runs name exactly the bad node and the slow
node and no healthy node (a factor stops at its first miss, since 5 of 5 is then out of
reach).

Run: ``.venv/bin/python bench/diagnosis.py [--quick] [--local] [--no-real]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import structlog

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

from unbroken.diagnostics.check import free_port, group_specs  # noqa: E402
from unbroken.diagnostics.judge import JudgeConfig, find_slow  # noqa: E402
from unbroken.diagnostics.runner import (  # noqa: E402
    Diagnosis,
    DiagnosisConfig,
    Group,
    LocalRunGroup,
    Results,
    RunGroup,
    diagnose,
)
from unbroken.diagnostics.schema import CheckResult, CheckSpec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "diagnosis.json"
SLOW_FACTORS = (1.2, 2.0)
ITERS = 8
FAIL_S = 3600.0


class SimCluster:
    """Truthful simulated checks over a fixed set of bad and slow nodes."""

    def __init__(self, n: int, k: int, rng: random.Random) -> None:
        self.nodes = [f"n{i:04d}" for i in range(n)]
        picked = rng.sample(self.nodes, min(n, k + len(SLOW_FACTORS)))
        self.bad = set(picked[:k])
        self.slow = {node: f for node, f in zip(picked[k:], SLOW_FACTORS, strict=False)}
        self.part = {node: 1 + rng.gauss(0, 0.01) for node in self.nodes}
        self.rng = rng
        self.checks = 0

    def node_ms(self, node: str) -> list[float]:
        t = 10.0 * self.slow.get(node, 1.0) * self.part[node]
        return [t * (1 + self.rng.gauss(0, 0.03)) for _ in range(ITERS)]

    def result(self, node: str, group: Group, failed: bool) -> CheckResult:
        samples = self.node_ms(node)
        return CheckResult(
            check_id="sim",
            node_id=node,
            rank=group.index(node),
            group=list(group),
            ok=not failed,
            failure="timeout" if failed else "",
            matmul_ms=statistics.median(samples),
            matmul_samples_ms=samples,
        )

    async def run_group(self, check_id: str, group: Group, index: int) -> Results:
        self.checks += 1
        failed = bool(set(group) & self.bad)
        return {node: self.result(node, group, failed) for node in group}


def score(c: SimCluster, bad: set[str], slow: set[str]) -> dict[str, int]:
    return {
        "bad_fp": len(bad - c.bad),
        "bad_fn": len(c.bad - bad),
        "slow_fp": len(slow - set(c.slow)),
        "slow_fn": len(set(c.slow) - slow),
    }


def sim_ours(c: SimCluster) -> dict[str, int]:
    d = asyncio.run(diagnose(c.nodes, run_group=c.run_group, diagnosis_id="sim"))
    v = d.verdict
    return {"rounds": v.rounds, "checks": v.checks} | score(c, set(v.bad), set(v.slow))


def sim_dlrover(c: SimCluster) -> dict[str, int]:
    n = len(c.nodes)
    if n <= 3:  # "<= 3 nodes: no isolation"
        return {"rounds": 1, "checks": 1} | score(c, set(), set())

    def pairs(order: Sequence[str]) -> list[list[str]]:
        groups = [list(order[i : i + 2]) for i in range(0, n - n % 2, 2)]
        if n % 2:
            groups[-1].append(order[-1])
        return groups

    def run(groups: list[list[str]]) -> dict[str, float]:
        times: dict[str, float] = {}
        for g in groups:
            t = FAIL_S if set(g) & c.bad else max(statistics.median(c.node_ms(x)) for x in g)
            times.update(dict.fromkeys(g, t))
        return times

    t0 = run(pairs(c.nodes))
    ranked = sorted(c.nodes, key=lambda x: t0[x])
    round1 = [[ranked[i], ranked[n - 1 - i]] for i in range(n // 2)]
    if n % 2:
        round1[-1].append(ranked[n // 2])
    t1 = run(round1)
    bad = {x for x in c.nodes if t0[x] >= FAIL_S and t1[x] >= FAIL_S}
    ok0 = [t for t in t0.values() if t < FAIL_S]
    ok1 = [t for t in t1.values() if t < FAIL_S]
    m0 = statistics.median(ok0) if ok0 else FAIL_S
    m1 = statistics.median(ok1) if ok1 else FAIL_S
    slow = {x for x in c.nodes if FAIL_S > t0[x] > 2 * m0 and FAIL_S > t1[x] > 2 * m1}
    return {"rounds": 2, "checks": len(round1) + n // 2} | score(c, bad, slow)


def sim_halving(c: SimCluster) -> dict[str, int]:
    pending: list[list[str]] = [c.nodes]
    bad: set[str] = set()
    rounds = checks = 0
    per_round: list[dict[Group, dict[str, CheckResult | None]]] = []
    while pending:
        rounds += 1
        tests = []
        for s in pending:
            tests.extend([s] if len(s) == 1 else [s[: len(s) // 2], s[len(s) // 2 :]])
        checks += len(tests)
        pending, results = [], {}
        for t in tests:
            failed = bool(set(t) & c.bad)
            results[tuple(t)] = {x: c.result(x, tuple(t), failed) for x in t}
            if failed and len(t) == 1:
                bad.add(t[0])
            elif failed:
                pending.append(t)
        per_round.append(results)  # type: ignore[arg-type]
    slow = set(find_slow(per_round, exclude=sorted(bad)).slow)
    return {"rounds": rounds, "checks": checks} | score(c, bad, slow)


SCHEMES = {"ours": sim_ours, "dlrover": sim_dlrover, "halving": sim_halving}


def simulate(sizes: Sequence[int], ks: Sequence[int], trials_for: dict[int, int]) -> list[dict]:
    rows = []
    for n in sizes:
        for k in ks:
            if k >= n:
                continue
            for name, fn in SCHEMES.items():
                stats: dict[str, list[int]] = {}
                for t in range(trials_for.get(n, 3)):
                    c = SimCluster(n, k, random.Random(f"{n}-{k}-{t}"))
                    for key, val in fn(c).items():
                        stats.setdefault(key, []).append(val)
                row = {"n": n, "k": k, "scheme": name, "trials": trials_for.get(n, 3)}
                row |= {key: round(statistics.mean(v), 2) for key, v in stats.items()}
                rows.append(row)
    return rows


class AgentCluster:
    """An in-process driver service and one real `unbroken agent` process per node.

    Groups run by sending RunCheck to the members' agents (what the driver does); the
    faults are the agents' own ``--inject-fault``.
    """

    def __init__(self, faults: dict[str, str], tmp: Path) -> None:
        self.faults, self.tmp = faults, tmp
        self.procs: list[asyncio.subprocess.Process] = []

    async def __aenter__(self) -> AgentCluster:
        from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
        from unbroken.driver.liveview import LiveViewConfig
        from unbroken.driver.service import DriverService, ServiceConfig, build_server

        store = InMemoryStore()
        # 8 checks importing torch on 2 shared cores can delay a 100 ms heartbeat > 300 ms.
        cfg = ServiceConfig(live=LiveViewConfig(miss_limit=100))
        self.service = DriverService(cfg, driver_id="bench", job_id="bench")
        self.service.lead(InMemoryEventLog(store, "bench", store.elect("bench")), "")
        self.service.start()
        self.server, port, _ = await build_server(self.service, "127.0.0.1:0")
        for node, fault in self.faults.items():
            with open(self.tmp / f"agent-{node}.log", "wb") as out:
                self.procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "unbroken.cli", "agent",
                        "--driver", f"127.0.0.1:{port}", "--node-id", node,
                        "--inject-fault", fault, "--log-dir", str(self.tmp / f"logs-{node}"),
                        "--socket", str(self.tmp / f"{node}.sock"),
                        stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip
        deadline = time.monotonic() + 60
        while not set(self.faults) <= set(self.service.view.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"agents did not register in 60 s; logs in {self.tmp}")
            await asyncio.sleep(0.1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except TimeoutError:
                os.killpg(p.pid, signal.SIGKILL)
                await p.wait()
        await self.server.stop(0.5)
        await self.service.close()

    async def run_group(self, check_id: str, group: Group, index: int) -> Results:
        from unbroken.proto import driver_pb2 as dpb

        specs = group_specs(check_id, group, store_port=free_port(), **CHECK_OPTIONS)

        async def one(spec: CheckSpec) -> CheckResult | None:
            cmd = dpb.DriverMessage(
                run_check=dpb.RunCheck(spec_json=spec.to_json(), timeout_s=spec.timeout_s + 10)
            )
            reply = await self.service.request(spec.node_id, cmd, spec.timeout_s + 20)
            line = reply.check_result.result_json
            return CheckResult.from_json(line) if line else None

        got = await asyncio.gather(*(one(s) for s in specs))
        return {s.node_id: r for s, r in zip(specs, got, strict=True)}


CHECK_OPTIONS: dict = {"timeout_s": 90, "matmul_iters": 32}


async def _one_diagnosis(names: list[str], run_group: RunGroup) -> tuple[object, float]:
    t = time.monotonic()
    d = await diagnose(names, run_group=run_group, config=DiagnosisConfig(round_timeout_s=120))
    return d, time.monotonic() - t


async def _factor_runs(
    f: float, runs: int, names: list[str], bad_node: str, slow_node: str, agents: bool
) -> list[dict]:
    faults = {n: "" for n in names} | {bad_node: "wrong_matmul", slow_node: f"slow:{f}"}
    outcomes: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="diag-bench-") as tmp:
        cluster = AgentCluster(faults, Path(tmp)) if agents else None
        if cluster is not None:
            await cluster.__aenter__()
        try:
            for r in range(runs):
                run: RunGroup = (
                    cluster.run_group
                    if cluster is not None
                    else LocalRunGroup({k: v for k, v in faults.items() if v}, **CHECK_OPTIONS)
                )
                d, wall = await _one_diagnosis(names, run)
                assert isinstance(d, Diagnosis)
                v = d.verdict
                o = {
                    "wall_s": round(wall, 2),
                    "rounds": v.rounds,
                    "bad": list(v.bad),
                    "slow": list(v.slow),
                    "exact": v.bad == (bad_node,) and v.slow == (slow_node,),
                    "slow_score": round(d.slow_report.scores.get(slow_node, 0.0), 3),
                    "max_healthy_score": round(
                        max(s for x, s in d.slow_report.scores.items() if x != slow_node), 3
                    ),
                    "failures": [
                        [rec.index, list(o.nodes), o.failure]
                        + [f"{n}: {x.failure} {x.detail[:120]}" for n, x in res.items() if x]
                        + [f"{n}: no result" for n, x in res.items() if x is None]
                        for rec in d.rounds
                        for o in rec.outcomes
                        if not o.ok
                        for res in [rec.results[o.nodes]]
                    ],
                }
                print(f"  slow {f}: run {r}: {o}", flush=True)
                outcomes.append(o)
                if not o["exact"] and f != 2.0:
                    break  # 5 of 5 is already out of reach; 2x always runs 5 for the figures
        finally:
            if cluster is not None:
                await cluster.__aexit__(None, None, None)
    return outcomes


def real_runs(factors: Sequence[float], runs: int, nodes: int = 8, agents: bool = True) -> dict:
    names = [f"n{i}" for i in range(nodes)]
    bad_node, slow_node = names[2], names[5]
    per_factor: dict[str, dict] = {}
    for f in factors:
        outcomes = asyncio.run(_factor_runs(f, runs, names, bad_node, slow_node, agents))
        per_factor[str(f)] = {
            "named_runs": sum(o["exact"] for o in outcomes),
            "runs": runs,
            "median_wall_s": statistics.median(o["wall_s"] for o in outcomes),
            "outcomes": outcomes,
        }
    out = summarize(per_factor, runs, bad_node, slow_node)
    out["real_mode"] = (
        f"{nodes} real agent processes (in-process driver service sends RunCheck)"
        if agents
        else f"{nodes} local check processes per group (LocalRunGroup), no agents"
    ) + " on this 2-core machine"
    return out


def summarize(per_factor: dict[str, dict], runs: int, bad_node: str, slow_node: str) -> dict:
    """The result keys from the per-slowdown runs: verdict time and naming are over the
    runs at 2x (the median wall time; named = named in every run)."""
    named = [float(f) for f, v in per_factor.items() if v["named_runs"] == runs]
    ref = per_factor["2.0"]["outcomes"]
    return {
        "real_verdict_s": statistics.median(o["wall_s"] for o in ref),
        "real_bad_named": all(o["bad"] == [bad_node] for o in ref),
        "real_slow_named": all(slow_node in o["slow"] for o in ref),
        "min_slowdown_named": min(named) if named else None,
        "real_per_slowdown": per_factor,
    }


def table(rows: list[dict]) -> str:
    head = "| N | k bad | scheme | rounds | checks | bad FP | bad FN | slow FP | slow FN |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['k']} | {r['scheme']} | {r['rounds']} | {r['checks']} | "
            f"{r['bad_fp']} | {r['bad_fn']} | {r['slow_fp']} | {r['slow_fn']} |"
        )
    return "\n".join(lines)


def wide_table(rows: list[dict]) -> str:
    """One line per (N, k): ours / DLRover / halving side by side."""
    by: dict[tuple[int, int], dict[str, dict]] = {}
    for r in rows:
        by.setdefault((r["n"], r["k"]), {})[r["scheme"]] = r
    head = (
        "| N | k bad | rounds ours / DLRover / halving | checks ours / DLRover / halving "
        "| bad FP+FN ours / DLRover / halving | slow FP+FN ours / DLRover / halving |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    order = ("ours", "dlrover", "halving")
    for (n, k), s in sorted(by.items()):

        def col(f: Callable[[dict], float], s: dict[str, dict] = s) -> str:
            return " / ".join(f"{f(s[x]):g}" for x in order)

        lines.append(
            f"| {n} | {k} | {col(lambda r: r['rounds'])} | {col(lambda r: r['checks'])} | "
            f"{col(lambda r: round(r['bad_fp'] + r['bad_fn'], 2))} | "
            f"{col(lambda r: round(r['slow_fp'] + r['slow_fn'], 2))} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials and real runs")
    parser.add_argument("--no-real", action="store_true", help="simulation only")
    parser.add_argument(
        "--local", action="store_true", help="real part with local check processes, no agents"
    )
    args = parser.parse_args(argv)
    trials = {8: 40, 64: 20, 512: 6, 4096: 2} if not args.quick else {8: 5, 64: 3, 512: 1, 4096: 1}
    t = time.monotonic()
    rows = simulate((8, 64, 512, 4096), (1, 2, 4, 16), trials)
    print(table(rows))
    print()
    print(wide_table(rows))
    print(f"(simulation took {time.monotonic() - t:.1f} s)", flush=True)
    out: dict = {"sim": rows, "judge": {"k": JudgeConfig().k, "min_rel": JudgeConfig().min_rel}}
    if not args.no_real:
        out |= real_runs((1.1, 1.2, 1.5, 2.0), 2 if args.quick else 5, agents=not args.local)
        print(
            f"real: verdict {out['real_verdict_s']} s, bad named {out['real_bad_named']}, "
            f"slow named {out['real_slow_named']}, min slowdown named 5/5: "
            f"{out['min_slowdown_named']}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
