"""The judge: group outcomes from members' results, and the slow-node rule at any N."""

from __future__ import annotations

import random

import pytest

from unbroken.diagnostics.judge import JudgeConfig, find_slow, judge_group, scaled_mad
from unbroken.diagnostics.schema import CheckResult

pytestmark = pytest.mark.unit


def res(
    node: str, *, ok: bool = True, failure: str = "", ms: float = 10.0, **kw: object
) -> CheckResult:
    return CheckResult(
        check_id="c",
        node_id=node,
        rank=0,
        group=[node],
        ok=ok,
        failure=failure,
        matmul_ms=ms,
        **kw,  # type: ignore[arg-type]
    )


def test_passing_group() -> None:
    out = judge_group(("a", "b"), {"a": res("a"), "b": res("b")})
    assert out.ok and out.failure == ""


def test_wrong_matmul_is_blamed_and_the_mate_cleared() -> None:
    out = judge_group(("a", "b"), {"a": res("a"), "b": res("b", ok=False, failure="matmul")})
    assert not out.ok and out.failure == "matmul"
    assert out.blamed == {"b"} and out.cleared == {"a"}


def test_timeout_blames_nobody() -> None:
    out = judge_group(
        ("a", "b"),
        {"a": res("a", ok=False, failure="timeout"), "b": res("b", ok=False, failure="timeout")},
    )
    assert out.failure == "timeout" and not out.blamed and not out.cleared


def test_missing_member_fails_the_group_and_clears_nobody() -> None:
    out = judge_group(("a", "b", "c"), {"a": res("a"), "b": res("b", ok=False, failure="nan")})
    assert out.failure == "nan" and out.blamed == {"b"} and not out.cleared


def _rounds(times: dict[str, float], jitter: float, seed: int, iters: int = 8) -> list:
    rng = random.Random(seed)
    members = {}
    for n, t in times.items():
        samples = [t * (1 + rng.gauss(0, jitter)) for _ in range(iters)]
        members[n] = res(n, ms=sorted(samples)[iters // 2], matmul_samples_ms=samples)
    return [{tuple(times): members}]


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64, 512])
def test_a_2x_slow_node_is_named_at_any_n(n: int) -> None:
    times = {f"n{i}": 10.0 for i in range(n)}
    times["n1"] = 20.0
    rep = find_slow(_rounds(times, 0.01, n))
    assert rep.slow == ("n1",)


@pytest.mark.parametrize("n", [2, 3, 8, 64, 512])
def test_noise_alone_names_nobody(n: int) -> None:
    for seed in range(5):
        rep = find_slow(_rounds({f"n{i}": 10.0 for i in range(n)}, 0.01, seed))
        assert rep.slow == ()


def test_a_small_slowdown_needs_low_noise() -> None:
    times = {f"n{i}": 10.0 for i in range(16)}
    times["n3"] = 11.0
    assert find_slow(_rounds(times, 0.005, 1)).slow == ("n3",)
    assert find_slow(_rounds(times, 0.005, 1), config=JudgeConfig(min_rel=0.2)).slow == ()


def test_excluded_nodes_are_never_slow() -> None:
    times = {"a": 10.0, "b": 30.0, "c": 10.0}
    assert find_slow(_rounds(times, 0.0, 0), exclude=["b"]).slow == ()


def test_slow_link_needs_two_partners() -> None:
    def grp(a: str, b: str, ag: float) -> dict:
        return {n: res(n, allgather_ms=ag, allgather_samples_ms=[ag] * 4) for n in (a, b)}

    r1 = {
        ("a", "b"): grp("a", "b", 50.0),
        ("c", "d"): grp("c", "d", 5.0),
        ("e", "f"): grp("e", "f", 5.0),
    }
    rep = find_slow([r1])
    assert rep.slow == () and rep.slow_links == (("a", "b"),)
    r2 = {
        ("a", "c"): grp("a", "c", 50.0),
        ("b", "e"): grp("b", "e", 5.0),
        ("d", "f"): grp("d", "f", 5.0),
    }
    rep = find_slow([r1, r2])
    assert rep.slow == ("a",)


def test_scaled_mad_and_config_validation() -> None:
    assert scaled_mad([1.0]) == 0.0
    assert scaled_mad([1.0, 2.0, 3.0, 100.0]) == pytest.approx(1.4826 * 0.5 * 2)  # MAD = 1
    with pytest.raises(ValueError, match="k must"):
        JudgeConfig(k=0)
    with pytest.raises(ValueError, match="min_rel"):
        JudgeConfig(min_rel=-1)
