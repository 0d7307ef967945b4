"""Fault specs, the check spec/result contract, events and self-checks (in-process)."""

from __future__ import annotations

import json

import pytest

from unbroken.common.faults import FaultSpec
from unbroken.diagnostics.judge import SlowReport
from unbroken.diagnostics.planner import GroupOutcome, Verdict
from unbroken.diagnostics.runner import Diagnosis, RoundRecord, round_event, verdict_event
from unbroken.diagnostics.schema import CheckResult, CheckSpec
from unbroken.diagnostics.selfcheck import (
    ITEM_NAMES,
    SelfCheckConfig,
    check_disk,
    failure_item,
    run_selfchecks,
)

pytestmark = pytest.mark.unit


def test_fault_parse_and_roundtrip() -> None:
    f = FaultSpec.parse("wrong_matmul+slow:2.0")
    assert f.wrong_matmul and f.slow_factor == 2.0 and not f.nan
    assert FaultSpec.parse(str(f)) == f
    assert FaultSpec.parse("nan, hang_allgather") == FaultSpec(nan=True, hang_allgather=True)
    assert FaultSpec.parse("") == FaultSpec.parse("none") == FaultSpec()
    assert not FaultSpec().any and FaultSpec(nan=True).any
    assert str(FaultSpec()) == "none"


@pytest.mark.parametrize(
    ("text", "msg"),
    [("explode", "unknown fault term"), ("slow:x", "needs a number"), ("slow:0.5", ">= 1.0")],
)
def test_bad_fault_specs_say_what_is_known(text: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        FaultSpec.parse(text)


def spec(**kw: object) -> dict:
    base = dict(check_id="c1", node_id="b", group=["a", "b"], rank=1, store_host="h", store_port=1)
    base.update(kw)
    return base


def test_spec_roundtrip() -> None:
    s = CheckSpec.from_json(json.dumps(spec(fault="nan")))
    assert CheckSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"rank": 0}, "rank 0 must be the index"),
        ({"node_id": "z"}, "not in group"),
        ({"group": ["a", "a"]}, "unique"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"phase_timeout_s": -1}, "phase_timeout_s"),
        ({"fault": "boom"}, "unknown fault term"),
        ({"matmul_iters": 0}, "matmul_iters"),
        ({"color": 1}, "unknown spec fields"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_bad_specs(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        CheckSpec.from_json(json.dumps(spec(**kw)))


def test_missing_fields_and_bad_json() -> None:
    with pytest.raises(ValueError, match="bad spec"):
        CheckSpec.from_json('{"check_id": "x"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        CheckSpec.from_json("{")


def test_result_ignores_unknown_fields() -> None:
    r = CheckResult(check_id="c", node_id="a", rank=0, group=["a"], ok=True)
    data = json.loads(r.to_json()) | {"future_field": 1}
    assert CheckResult.from_json(json.dumps(data)) == r
    with pytest.raises(ValueError, match="not JSON"):
        CheckResult.from_json("hello")


def test_events() -> None:
    ra = CheckResult(check_id="c", node_id="a", rank=0, group=["a", "b"], ok=True, matmul_ms=2.0)
    rb = CheckResult(check_id="c", node_id="b", rank=1, group=["a", "b"], ok=False, failure="nan")
    rec = RoundRecord(
        index=1,
        outcomes=[GroupOutcome(nodes=("a", "b"), ok=False, failure="nan", blamed=frozenset("b"))],
        results={("a", "b"): {"a": ra, "b": rb}},
        wall_s=1.0,
    )
    e = round_event("d1", rec)
    assert e.round == 1 and list(e.groups[0].node_ids) == ["a", "b"]
    assert e.groups[0].failure == "nan" and e.groups[0].per_node_ms["a"] == 2.0
    v = Verdict(bad=("b",), confirmed_directly=("b",), slow=("c",), rounds=1, checks=1)
    d = Diagnosis(diagnosis_id="d1", rounds=[rec], verdict=v, slow_report=SlowReport(), wall_s=3.0)
    ve = verdict_event(d)
    assert list(ve.bad_nodes) == ["b"] and list(ve.slow_nodes) == ["c"] and ve.wall_s == 3.0


def test_selfchecks(tmp_path: object) -> None:
    rep = run_selfchecks("n1", SelfCheckConfig(min_free_disk_gb=0.0, disk_path=str(tmp_path)))
    names = {i.name for i in rep.items}
    assert {"matmul", "disk"} <= names and rep.ok, rep.failures
    assert rep.to_event().ok
    bad = run_selfchecks("n1", SelfCheckConfig(min_free_disk_gb=0.0), fault="wrong_matmul")
    assert not bad.ok and bad.failures[0].startswith("matmul")
    # the names the driver's Policy.self_check_evicts is checked against
    assert {failure_item(i.name)[0] for i in rep.items + bad.items} <= ITEM_NAMES
    assert failure_item(bad.failures[0])[0] == "matmul"
    assert failure_item("ecc[3]: 2 uncorrected ECC errors") == ("ecc", "2 uncorrected ECC errors")
    assert list(bad.to_event().failures) == bad.failures
    full = check_disk(str(tmp_path), 1e9)
    assert not full.ok and "need" in full.detail
    with pytest.raises(ValueError, match="max_gpu_memory_used"):
        SelfCheckConfig(max_gpu_memory_used=0)
