"""The reshard side of the restore decision: which step, saved under another layout, every
rank of the new world can reshard from; checked against a brute-force oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.recovery.restore import (
    StepCopies,
    newest_healable,
    newest_reshardable,
    same_layout_steps,
    saved_layouts,
)

pytestmark = pytest.mark.unit

DP1 = {"world": 1, "dp_shard": 1}
DP2 = {"world": 2, "dp_shard": 2}


def test_dp2_copies_reshard_into_dp1() -> None:
    reach = {0: {3: StepCopies(DP2, frozenset({0, 1})), 2: StepCopies(DP2, frozenset({0}))}}
    assert newest_reshardable(reach, DP1) == 3  # step 2 lacks saved rank 1
    assert same_layout_steps(reach, DP1) == frozenset()
    assert newest_reshardable(reach, DP1, not_after=2) is None


def test_same_layout_and_unknown_layouts_are_not_resharded() -> None:
    reach = {0: {5: StepCopies(DP2, frozenset({0, 1})), 4: StepCopies({}, frozenset({0, 1}))}}
    assert newest_reshardable(reach, DP2) is None
    assert same_layout_steps(reach, DP2) == {4, 5}


def test_every_new_rank_must_reach_every_saved_rank() -> None:
    reach = {
        0: {5: StepCopies(DP1, frozenset({0})), 3: StepCopies(DP2, frozenset({0, 1}))},
        1: {5: StepCopies({}, frozenset()), 3: StepCopies(DP2, frozenset({0, 1}))},
    }
    assert newest_reshardable(reach, DP2) is None  # rank 1 cannot reach step 5 at all
    reach[1][5] = StepCopies({}, frozenset({0}))  # storage only: layout learnt from rank 0
    assert saved_layouts(reach)[5] == DP1
    assert newest_reshardable(reach, DP2) == 5
    del reach[1][5]
    assert newest_reshardable(reach, {"world": 4, "dp_shard": 4}) == 3


def test_a_step_heals_when_the_ranks_together_reach_every_saved_rank() -> None:
    """The grow-back onto a spare: rank 0 holds the dp1 copy of step 9, rank 1 (the spare)
    nothing but storage's step 1; together they reach step 9, which only rank 0 can open."""
    reach = {
        0: {9: StepCopies(DP1, frozenset({0})), 1: StepCopies(DP2, frozenset({0, 1}))},
        1: {1: StepCopies({}, frozenset({0, 1}))},
    }
    assert newest_reshardable(reach, DP2) is None  # rank 1 cannot reach step 9 itself
    assert newest_healable(reach) == 9
    assert newest_healable(reach, not_after=8) == 1
    # a saved rank nobody reaches: that step cannot heal
    reach = {0: {9: StepCopies(DP2, frozenset({0}))}, 1: {9: StepCopies(DP2, frozenset())}}
    assert newest_healable(reach) is None
    # nor can a step whose layout no rank knows
    assert newest_healable({0: {4: StepCopies({}, frozenset({0}))}}) is None


def test_conflicting_layouts_for_one_step_are_never_used() -> None:
    reach = {
        0: {7: StepCopies(DP1, frozenset({0, 1}))},
        1: {7: StepCopies(DP2, frozenset({0, 1}))},
    }
    assert saved_layouts(reach)[7] is None
    assert newest_reshardable(reach, {"world": 2, "tp": 2}) is None
    assert same_layout_steps(reach, DP2) == frozenset()


layouts = st.sampled_from([{}, DP1, DP2, {"world": 2, "tp": 2}])


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 2),
        st.dictionaries(
            st.integers(0, 5),
            st.tuples(layouts, st.frozensets(st.integers(0, 1))),
            max_size=4,
        ),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from([DP1, DP2, {"world": 2, "tp": 2}]),
)
def test_newest_reshardable_matches_an_oracle(
    raw: dict[int, dict[int, tuple[dict[str, int], frozenset[int]]]], layout: dict[str, int]
) -> None:
    reach = {r: {s: StepCopies(lay, rk) for s, (lay, rk) in by.items()} for r, by in raw.items()}
    ok = []
    for step in range(6):
        if not all(step in by for by in reach.values()):
            continue
        known = {tuple(sorted(by[step].layout.items())) for by in reach.values() if by[step].layout}
        if len(known) != 1:
            continue
        saved = dict(next(iter(known)))
        if saved == layout:
            continue
        if all(set(range(saved["world"])) <= by[step].ranks for by in reach.values()):
            ok.append(step)
    assert newest_reshardable(reach, layout) == (max(ok) if ok else None)
