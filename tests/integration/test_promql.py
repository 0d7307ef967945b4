"""Every shipped PromQL expression returns data once Prometheus adds its own labels.

The series come from real registries: a leading driver (`DriverMetrics` over a live view
with an alive and a lost node, after a few recorded events), a standby driver, and two
agents (`AgentMetrics`), exposed as Prometheus scrapes them and labelled as it labels them
(`job` from deploy/prometheus.yml's scrape jobs, `instance` per target). Counters and
histograms grow over the test's half hour; gauges stay put.

The expressions: every target of the Grafana dashboard (driver/grafana/unbroken.json),
every rule of deploy/unbroken-rules.yml, and every PromQL expression written in README.md
and docs/**/*.md (a code span that names an `unbroken_` metric and calls a function or
compares). Each must return at least one sample at the 10-minute mark, checked by
`promtool test rules` (Debian's `prometheus` package; the test skips, saying so, without
it). The alert rules are also run for what they are for: the failed-job alert fires on a
failed job's series and not on a running one's, and "no leader" fires when every driver
stands by.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.metricsdata import agent_metrics, driver_metrics, exprs
from unbroken.driver.metrics import DriverMetrics
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
SPAN = re.compile(r"`([^`]*\bunbroken_[a-z0-9_]+[^`]*)`")
RULES = ROOT / "deploy" / "unbroken-rules.yml"
RULE = re.compile(r"- alert: (\w+)\n\s+expr: (.+)")
PROMQL_HINT = re.compile(r"[()]|[<>=!]=?|\s[-+*/]\s")


def _series(registry: CollectorRegistry, job: str, instance: str) -> list[dict[str, str]]:
    """promtool input series of one scrape of `registry`, labelled as Prometheus does."""
    out = []
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        growing = fam.type in ("counter", "histogram")
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = {**s.labels, "job": job, "instance": instance}
            body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            v = float(s.value)
            values = f"{v:g}+{v + 1:g}x30" if growing else f"{v:g}+0x30"
            out.append({"series": f"{s.name}{{{body}}}", "values": values})
    return out


def _driver(
    *, leader: bool, phase: int = ev.PHASE_RUNNING, awaiting: bool = False
) -> DriverMetrics:
    """A driver's registry (tests/metricsdata.py), with a lost node beside an alive one."""
    m = driver_metrics(leader=leader, phase=phase, lost_node=True, awaiting=awaiting)
    m.fault_durable.observe(0.1)
    return m


def _scrape(
    *, phase: int = ev.PHASE_RUNNING, leaders: int = 1, awaiting: bool = False
) -> list[dict[str, str]]:
    leader = _driver(leader=leaders > 0, phase=phase, awaiting=awaiting)
    series = _series(leader.registry, "unbroken-driver", "driver-1:9400")
    series += _series(_driver(leader=False).registry, "unbroken-driver", "driver-2:9400")
    for i in range(2):
        series += _series(agent_metrics().registry, "unbroken-agent", f"node-{i}:9401")
    return series


def shipped_expressions() -> dict[str, str]:
    """Where -> expression, for every PromQL expression we ship."""
    out: dict[str, str] = {}
    dash = json.loads(
        resources.files("unbroken.driver").joinpath("grafana/unbroken.json").read_text()
    )
    for i, e in enumerate(exprs(dash["panels"])):
        out[f"grafana target {i}"] = e
    for alert, expr in RULE.findall(RULES.read_text()):
        out[f"deploy/unbroken-rules.yml {alert}"] = expr.strip()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"\s*\n\s*", " ", doc.read_text())  # spans wrap across lines
        for m in SPAN.finditer(text):
            expr = m.group(1).strip()
            if PROMQL_HINT.search(expr) and not expr.startswith("unbroken ") and "--" not in expr:
                out[f"{doc.relative_to(ROOT)}: {expr[:40]}"] = expr
    return out


def _promtool(tmp: Path, rules: list[dict[str, Any]], tests: list[dict[str, Any]]) -> str:
    """promtool's complaints ("" when every test passes); JSON is YAML to promtool."""
    rule_file = "rules.yml"
    (tmp / rule_file).write_text(json.dumps({"groups": [{"name": "t", "rules": rules}]}))
    (tmp / "test.yml").write_text(
        json.dumps({"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests})
    )
    assert PROMTOOL is not None
    r = subprocess.run(
        [PROMTOOL, "test", "rules", "test.yml"],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return "" if r.returncode == 0 else r.stdout + r.stderr


needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found: `apt-get install prometheus` (Debian) to run these checks",
)


def test_the_expressions_are_found() -> None:
    found = shipped_expressions()
    assert sum(k.startswith("grafana") for k in found) >= 30
    assert sum(k.startswith("deploy") for k in found) >= 5
    # the metrics page's "useful query" (the README links there)
    assert any(k.startswith("docs/operations/metrics.md") for k in found), sorted(found)


PER_NODE = {"UnbrokenWorkerRestarting": [{"instance": f"node-{i}:9401"} for i in range(2)]}


def _returns_data(tmp: Path, exprs: dict[str, str]) -> list[str]:
    """The expressions of `exprs` that return no sample at 10 minutes (where: expr)."""
    names = {f"Q{i}": where for i, where in enumerate(exprs)}
    rules = [{"alert": q, "expr": f"count(({exprs[where]})) > 0"} for q, where in names.items()]
    test = {
        "interval": "1m",
        "input_series": _scrape(),
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": q, "exp_alerts": [{"exp_labels": {}}]} for q in names
        ],
    }
    out = _promtool(tmp, rules, [test])
    failed = sorted({names[q] for q in re.findall(r"alertname: (Q\d+)", out)})
    assert failed or not out, out[-3000:]  # promtool failed for another reason
    return [f"{w}: {exprs[w]}" for w in failed]


@needs_promtool
def test_grafana_and_docs_expressions_return_data_on_labelled_series(tmp_path: Path) -> None:
    exprs = {
        k: v
        for k, v in shipped_expressions().items()
        if not k.startswith(("deploy", "README", "docs/operations/metrics.md"))
    }
    empty = _returns_data(tmp_path, exprs)
    assert not empty, "expressions that return nothing on labelled series:\n" + "\n".join(empty)


@needs_promtool
def test_readme_and_metrics_page_expressions_return_data_on_labelled_series(
    tmp_path: Path,
) -> None:
    exprs = {
        k: v
        for k, v in shipped_expressions().items()
        if k.startswith(("README", "docs/operations/metrics.md"))
    }
    empty = _returns_data(tmp_path, exprs)
    assert not empty, "README expressions that return nothing on labelled series:\n" + "\n".join(
        empty
    )


@needs_promtool
def test_the_alerts_fire_when_they_should(tmp_path: Path) -> None:
    # the file's expressions as bare alerts (its `for` and annotations are not under test)
    rules = [{"alert": a, "expr": e.strip()} for a, e in RULE.findall(RULES.read_text())]

    def case(series: list[dict[str, str]], firing: dict[str, bool]) -> dict[str, Any]:
        return {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {
                    "eval_time": "15m",
                    "alertname": name,
                    "exp_alerts": [{"exp_labels": x} for x in PER_NODE.get(name, [{}])]
                    if fire
                    else [],
                }
                for name, fire in firing.items()
            ],
        }

    # every scrape's restart counters grow (by 2 a minute on rank 1): that alert fires in
    # each, once per node; the flash thread's scan age is 0 in each
    quiet = {
        "UnbrokenJobFailed": False,
        "UnbrokenNoLeader": False,
        "UnbrokenRecoveryStuck": False,
        "UnbrokenAwaitingNodes": False,
        "UnbrokenFlashStarved": False,
        "UnbrokenWorkerRestarting": True,
    }
    assert set(quiet) == {a for a, _ in RULE.findall(RULES.read_text())}  # every rule is run
    tests = [
        case(_scrape(), quiet),
        case(_scrape(phase=ev.PHASE_FAILED), {**quiet, "UnbrokenJobFailed": True}),
        case(_scrape(phase=ev.PHASE_PAUSED), {**quiet, "UnbrokenRecoveryStuck": True}),
        case(_scrape(leaders=0), {**quiet, "UnbrokenNoLeader": True}),
        case(
            _scrape(phase=ev.PHASE_DIAGNOSED, awaiting=True),
            {**quiet, "UnbrokenAwaitingNodes": True, "UnbrokenRecoveryStuck": True},
        ),
    ]
    out = _promtool(tmp_path, rules, tests)
    assert not out, out[-4000:]
