"""Property tests of the planner: with truthful checks the verdict names exactly the bad nodes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.diagnostics.planner import (
    GroupOutcome,
    PlannerConfig,
    Round,
    Verdict,
    next_step,
)

pytestmark = pytest.mark.unit


def simulate(
    nodes: list[str],
    bad: set[str],
    known_good: list[str] = (),  # type: ignore[assignment]
    *,
    blame: bool = False,
    config: PlannerConfig | None = None,
) -> Verdict:
    """Run the planner to its verdict; a group fails iff it holds a bad node."""
    history: list[list[GroupOutcome]] = []
    for _ in range(200):
        step = next_step(nodes, known_good, history, config)
        if isinstance(step, Verdict):
            return step
        assert isinstance(step, Round)
        assert step.index == len(history) + 1
        members = [n for g in step.groups for n in g]
        assert len(members) == len(set(members)), "a node is in two groups of one round"
        assert set(members) <= set(nodes) | set(known_good)
        outcomes = []
        for g in step.groups:
            hit = set(g) & bad
            outcomes.append(
                GroupOutcome(
                    nodes=g,
                    ok=not hit,
                    failure="matmul" if hit else "",
                    blamed=frozenset(hit) if blame else frozenset(),
                    cleared=frozenset(set(g) - hit) if blame and hit else frozenset(),
                )
            )
        history.append(outcomes)
    raise AssertionError("the planner did not reach a verdict in 200 rounds")


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[str], set[str], list[str]]:
    n = draw(st.integers(1, 40))
    nodes = [f"n{i:02d}" for i in range(n)]
    nodes = draw(st.permutations(nodes))
    bad = set(draw(st.lists(st.sampled_from(nodes), unique=True, max_size=n)))
    healthy = [x for x in nodes if x not in bad]
    known = draw(st.lists(st.sampled_from(healthy), unique=True)) if healthy else []
    spares = [f"s{i}" for i in range(draw(st.integers(0, 3)))]
    return list(nodes), bad, known + spares


@settings(max_examples=300, deadline=None)
@given(clusters(), st.booleans())
def test_verdict_names_exactly_the_bad_nodes(
    cluster: tuple[list[str], set[str], list[str]], blame: bool
) -> None:
    nodes, bad, known = cluster
    v = simulate(nodes, bad, known, blame=blame)
    assert set(v.bad) == bad
    assert v.undetermined == ()
    assert set(v.confirmed_directly) <= set(v.bad)
    assert v.suspect_links == ()


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_without_solo_checks_nothing_healthy_is_named(
    cluster: tuple[list[str], set[str], list[str]],
) -> None:
    nodes, bad, known = cluster
    v = simulate(nodes, bad, known, config=PlannerConfig(allow_solo=False))
    assert set(v.bad) <= bad
    assert bad - set(v.bad) <= set(v.undetermined)
    assert not (set(v.undetermined) & set(known))


@settings(max_examples=100, deadline=None)
@given(st.integers(8, 300), st.data())
def test_few_faults_take_two_rounds(n: int, data: st.DataObject) -> None:
    nodes = [f"n{i}" for i in range(n)]
    k = data.draw(st.integers(1, max(1, n // 8)))
    bad = set(data.draw(st.lists(st.sampled_from(nodes), unique=True, min_size=k, max_size=k)))
    v = simulate(nodes, bad)
    assert set(v.bad) == bad
    assert v.rounds <= 2
    assert set(v.confirmed_directly) == bad


def test_two_nodes_with_a_clean_history_reference() -> None:
    v = simulate(["a", "b"], {"a"}, ["b"])
    assert v.bad == ("a",) and v.rounds == 1 and v.confirmed_directly == ("a",)


def test_two_nodes_no_reference_uses_solo_checks() -> None:
    v = simulate(["a", "b"], {"b"})
    assert v.bad == ("b",) and v.rounds == 2


def test_two_nodes_no_reference_no_solo_is_undetermined() -> None:
    v = simulate(["a", "b"], {"b"}, config=PlannerConfig(allow_solo=False))
    assert v.bad == () and v.undetermined == ("a", "b")


def test_three_nodes_first_round_is_a_three_way_check() -> None:
    step = next_step(["a", "b", "c"])
    assert isinstance(step, Round) and step.groups == (("a", "c", "b"),)


def test_single_node_with_a_spare_partner() -> None:
    v = simulate(["a"], {"a"}, ["spare"])
    assert v.bad == ("a",) and v.rounds == 1


def test_all_bad() -> None:
    nodes = [f"n{i}" for i in range(9)]
    v = simulate(nodes, set(nodes))
    assert v.bad == tuple(sorted(nodes)) and v.rounds == 2


def test_inconsistent_failure_is_a_suspect_link() -> None:
    history = [
        [GroupOutcome(nodes=("a", "b"), ok=False, failure="allgather")],
        [
            GroupOutcome(nodes=("a", "c"), ok=True),
            GroupOutcome(nodes=("b", "d"), ok=True),
        ],
    ]
    v = next_step(["a", "b"], ["c", "d"], history)
    assert isinstance(v, Verdict)
    assert v.bad == () and v.suspect_links == (("a", "b"),)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        next_step([])
    with pytest.raises(ValueError, match="duplicate"):
        next_step(["a", "a"])
    with pytest.raises(ValueError, match="max_rounds"):
        PlannerConfig(max_rounds=0)


def test_large_cluster_few_rounds() -> None:
    nodes = [f"n{i}" for i in range(4096)]
    bad = {nodes[i] for i in range(0, 4096, 97)}
    v = simulate(nodes, bad)
    assert set(v.bad) == bad and v.rounds == 2
