"""The restore decision: exhaustive over small worlds, property-based over larger ones."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.recovery.restore import (
    Availability,
    NoCommonStepError,
    Source,
    availability_of,
    common_steps,
    decide,
    describe_newest,
)

pytestmark = pytest.mark.unit

STEPS = (1, 2)


def _check_plan(avail: dict[int, Availability], groups: list[list[int]] | None) -> None:
    """The invariants every plan satisfies, against a brute-force oracle."""
    obtainable = {s for s in range(0, 10) if all(a.best(s) is not None for a in avail.values())}
    if not obtainable:
        with pytest.raises(NoCommonStepError):
            decide(avail, groups)
        return
    plan = decide(avail, groups)
    assert plan.step == max(obtainable)
    assert set(plan.source_by_rank) == set(avail)
    received = {r for b in plan.broadcasts for r in b.receivers}
    for r, src in plan.source_by_rank.items():
        own = avail[r].best(plan.step)
        assert own is not None
        if r in received:
            assert own is Source.STORAGE  # only storage-only ranks receive broadcasts
        else:
            assert src is own  # memory > buddy > storage, never a corrupt copy
            assert plan.step in avail[r].steps(src)
    for b in plan.broadcasts:
        assert plan.step in avail[b.root].steps(b.root_source)
        assert b.root not in b.receivers
        group = next(g for g in (groups or [[r] for r in avail]) if b.root in g)
        assert set(b.receivers) <= set(group)
    # one storage reader per replica group at most, and only where no peer holds memory
    for g in groups or [[r] for r in avail]:
        readers = [r for r in plan.storage_readers if r in g]
        assert len(readers) <= 1
        storage_only = [r for r in g if avail[r].best(plan.step) is Source.STORAGE]
        peers = [r for r in g if avail[r].best(plan.step) is not Source.STORAGE]
        assert bool(readers) == bool(storage_only and not peers)


def _rank_options() -> list[Availability]:
    """Every availability of one rank over steps {1, 2} and three sources, with corruption."""
    out = []
    subsets = [frozenset(c) for n in range(3) for c in itertools.combinations(STEPS, n)]
    for mem, bud, sto in itertools.product(subsets, repeat=3):
        out.append(Availability(mem, bud, sto))
        if 2 in mem:
            out.append(Availability(mem, bud, sto, frozenset({(Source.MEMORY, 2)})))
    return out


def test_exhaustive_two_ranks_each_alone_and_as_replica_group() -> None:
    options = _rank_options()
    for a, b in itertools.product(options, repeat=2):
        avail = {0: a, 1: b}
        _check_plan(avail, None)
        _check_plan(avail, [[0, 1]])


def test_prefers_memory_then_buddy_then_storage() -> None:
    plan = decide(
        {
            0: availability_of(memory={5}, buddy={5}, storage={5}),
            1: availability_of(buddy={5}, storage={5}),
            2: availability_of(storage={5}),
        }
    )
    assert plan.labels() == {0: "memory", 1: "buddy", 2: "storage"}
    assert plan.storage_readers == (2,)


def test_newest_common_step_not_newest_local() -> None:
    plan = decide({0: availability_of(memory={7, 8}), 1: availability_of(memory={6, 7})})
    assert plan.step == 7


def test_corrupt_memory_falls_back_to_buddy() -> None:
    a = availability_of(memory={4}, buddy={4}, corrupt={(Source.MEMORY, 4)})
    assert decide({0: a}).source_by_rank[0] is Source.BUDDY


def test_one_reader_per_replica_group_and_broadcast() -> None:
    avail = {r: availability_of(storage={3}) for r in range(4)}
    plan = decide(avail, [[0, 2], [1, 3]])
    assert plan.storage_readers == (0, 1)
    assert {(b.root, b.receivers) for b in plan.broadcasts} == {(0, (2,)), (1, (3,))}


def test_peer_memory_replaces_storage_read() -> None:
    avail = {0: availability_of(memory={3}, storage={3}), 1: availability_of(storage={3})}
    plan = decide(avail, [[0, 1]])
    assert plan.storage_readers == ()
    assert plan.broadcasts[0].root == 0 and plan.broadcasts[0].receivers == (1,)


def test_not_after_bounds_a_rollback() -> None:
    avail = {0: availability_of(memory={3, 9}, storage={3})}
    assert decide(avail, not_after=8).step == 3
    with pytest.raises(NoCommonStepError, match="at or before step 2"):
        decide(avail, not_after=2)


def test_no_common_step_names_what_each_rank_has() -> None:
    with pytest.raises(NoCommonStepError, match=r"rank 1: memory=\[2\]"):
        decide({0: availability_of(memory={1}), 1: availability_of(memory={2})})


@pytest.mark.parametrize(
    "groups", [[[0]], [[0, 1], [1]], [[0, 1], [2]]], ids=["missing", "dup", "unknown"]
)
def test_groups_must_partition_ranks(groups: list[list[int]]) -> None:
    avail = {0: availability_of(memory={1}), 1: availability_of(memory={1})}
    with pytest.raises(ValueError, match="partition"):
        decide(avail, groups)


def test_empty_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        decide({})


_steps = st.frozensets(st.integers(0, 6), max_size=4)


@st.composite
def _worlds(draw: st.DrawFn) -> tuple[dict[int, Availability], list[list[int]]]:
    n = draw(st.integers(1, 8))
    avail = {}
    for r in range(n):
        mem, bud, sto = draw(_steps), draw(_steps), draw(_steps)
        pool = [(s, x) for s, xs in zip(Source, (mem, bud, sto), strict=True) for x in xs]
        bad = draw(st.frozensets(st.sampled_from(pool), max_size=2)) if pool else frozenset()
        avail[r] = Availability(mem, bud, sto, bad)
    ranks = list(range(n))
    size = draw(st.sampled_from([1, 2, 4]))
    groups = [ranks[i : i + size] for i in range(0, n, size)]
    return avail, groups


@settings(max_examples=200, deadline=None)
@given(_worlds())
def test_property_plans_are_valid(world: tuple[dict[int, Availability], list[list[int]]]) -> None:
    avail, groups = world
    _check_plan(avail, groups)
    if common_steps(avail):
        assert decide(avail, groups).step == max(common_steps(avail))


def test_plan_maps_onto_restore_started_event() -> None:
    plan = decide({0: availability_of(memory={4}), 1: availability_of(buddy={4})})
    e = plan.to_event(reshard=True)
    assert (e.step, dict(e.source_by_rank), e.reshard) == (4, {0: "memory", 1: "buddy"}, True)


def test_a_takeover_whose_newest_replica_is_ahead_of_the_survivor_still_restores_from_memory() -> (
    None
):
    """The bench's 314-step loss: the replaced rank's buddy held steps 3810 and 3824, the
    survivor's ring ended at 3823 (stopped while saving 3824). With only the newest replica
    fetched no step was common but storage's; with both, 3810 comes from memory and buddy."""
    survivor = availability_of(memory=set(range(3808, 3824)), storage={3510})
    newest_only = availability_of(buddy={3824}, storage={3510})
    both = availability_of(buddy={3810, 3824}, storage={3510})
    worse = decide({0: survivor, 1: newest_only})
    assert worse.step == 3510 and worse.source_by_rank == {0: Source.STORAGE, 1: Source.STORAGE}
    assert describe_newest({0: survivor, 1: newest_only}) == {
        0: "memory=3823 storage=3510",
        1: "buddy=3824 storage=3510",
    }
    plan = decide({0: survivor, 1: both})
    assert plan.step == 3810 and plan.source_by_rank == {0: Source.MEMORY, 1: Source.BUDDY}
