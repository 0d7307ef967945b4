"""The step every rank can restore from memory after a stop (`driver.loop.common_steps`)."""

from __future__ import annotations

import pytest

from unbroken.driver.loop import common_steps

pytestmark = pytest.mark.unit


def test_every_rank_in_its_own_ring() -> None:
    own = {0: {8, 9, 10}, 1: {9, 10, 11}}
    assert common_steps(2, own, {}) == {9, 10}


def test_a_lost_nodes_ranks_count_the_copies_its_buddy_holds() -> None:
    own = {0: set(range(19, 27)), 1: set(range(19, 27))}  # node-0's two ranks
    buddies = {2: {20, 25}, 3: {20, 25}}  # node-1 is gone; node-0 held its replicas
    assert max(common_steps(4, own, buddies) or {0}) == 25
    # without the buddy's report the commits decide
    assert common_steps(4, own, {}) is None
    # a rank nobody holds: the commits decide
    assert common_steps(4, own, {2: {25}}) is None


def test_a_rank_of_its_own_wins_over_a_buddy_copy() -> None:
    assert common_steps(1, {0: {5}}, {0: {7}}) == {5}
    assert common_steps(0, {}, {}) is None
