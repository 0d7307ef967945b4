"""The checkpoint lifecycle's pure decisions: the persistence interval and retention."""

from __future__ import annotations

import math

import pytest

from unbroken.recovery import lifecycle
from unbroken.recovery.lifecycle import PersistPolicy

pytestmark = pytest.mark.unit


def test_young_daly_is_sqrt_of_twice_cost_times_mtbf() -> None:
    assert lifecycle.young_daly_s(0.5, 3600.0) == pytest.approx(math.sqrt(3600.0))
    assert lifecycle.young_daly_s(0.0, 3600.0) == 0.0
    with pytest.raises(ValueError):
        lifecycle.young_daly_s(1.0, 0.0)


def test_mtbf_estimate_uses_a_prior_until_failures_are_seen() -> None:
    assert lifecycle.mtbf_estimate_s(0.0, 0, prior_s=86400.0) == 86400.0
    # 4 failures in 3 days of wall time (plus the prior day): a day over five
    assert lifecycle.mtbf_estimate_s(3 * 86400.0, 4, prior_s=86400.0) == pytest.approx(
        4 * 86400.0 / 5
    )


def test_interval_grows_with_cost_and_mtbf_and_is_bounded() -> None:
    policy = PersistPolicy(floor_s=10.0, ceiling_s=600.0, prior_mtbf_s=86400.0)
    cheap = lifecycle.persist_interval_s(0.05, 0.0, 0, policy)
    dear = lifecycle.persist_interval_s(0.5, 0.0, 0, policy)
    assert cheap == pytest.approx(math.sqrt(2 * 0.05 * 86400.0))  # ~93 s
    assert dear > cheap
    flaky = lifecycle.persist_interval_s(0.5, 3600.0, 60, policy)  # a failure a minute
    assert flaky < dear
    assert lifecycle.persist_interval_s(1e-6, 0.0, 1000, policy) == 10.0  # the floor
    assert lifecycle.persist_interval_s(100.0, 1e9, 0, policy) == 600.0  # the ceiling


def test_policy_rejects_inverted_bounds() -> None:
    with pytest.raises(ValueError, match="floor"):
        PersistPolicy(floor_s=100.0, ceiling_s=10.0)
    with pytest.raises(ValueError, match="prior"):
        PersistPolicy(prior_mtbf_s=0.0)


def test_retention_keeps_newest_commits_and_protected_steps() -> None:
    committed = [10, 20, 30, 40, 50]
    assert lifecycle.retained(committed, 2) == {40, 50}
    # a rollback target older than the newest two survives
    assert lifecycle.retained(committed, 2, protect=[20]) == {20, 40, 50}
    with pytest.raises(ValueError):
        lifecycle.retained(committed, 0)


def test_deletable_never_touches_steps_in_flight_or_kept() -> None:
    persisted = [10, 20, 30, 40, 50, 51, 52]  # 51, 52 persisted, not committed yet
    assert lifecycle.deletable(persisted, {20, 40, 50}, below=50) == [10, 30]
    assert lifecycle.deletable(persisted, set(), below=0) == []


def test_interval_at_a_known_mtbf_is_bounded_young_daly() -> None:
    policy = PersistPolicy(floor_s=10.0, ceiling_s=600.0, prior_mtbf_s=86400.0)
    assert lifecycle.persist_interval_at_s(0.05, 86400.0, policy) == pytest.approx(
        lifecycle.persist_interval_s(0.05, 0.0, 0, policy)
    )
    assert lifecycle.persist_interval_at_s(1e-6, 60.0, policy) == 10.0
    assert lifecycle.persist_interval_at_s(100.0, 1e9, policy) == 600.0
