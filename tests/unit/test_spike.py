"""Loss-spike detection and the rollback/skip policy."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.recovery.spike import Prior, RollbackPolicy, Spike, SpikeConfig, SpikeDetector

pytestmark = pytest.mark.unit


def _noisy(n: int, seed: int = 0, level: float = 2.0) -> list[float]:
    rng = random.Random(seed)
    return [level + rng.gauss(0, 0.02) for _ in range(n)]


def test_noise_is_not_a_spike_and_a_jump_is() -> None:
    det = SpikeDetector(SpikeConfig(window=50, min_history=10, factor=6.0))
    for i, x in enumerate(_noisy(200)):
        assert det.observe(i, x) is None
    assert det.observe(200, 3.5) is None  # one high loss could be a noisy batch...
    spike = det.observe(201, 3.6)  # ...two in a row are a spike, from the first
    assert spike is not None and not spike.non_finite and spike.step == 200
    assert spike.baseline == pytest.approx(2.0, abs=0.02)
    assert spike.loss == 3.5 and spike.loss > spike.threshold


def test_a_lone_outlier_is_noise_and_a_huge_one_is_a_spike_at_once() -> None:
    det = SpikeDetector(SpikeConfig(window=50, min_history=10, factor=6.0))
    for i, x in enumerate(_noisy(200)):
        det.observe(i, x)
    assert det.observe(200, 3.5) is None  # +75 %, as the tiny model's noisy batches
    assert det.observe(201, 2.0) is None  # back to normal: it was noise
    assert det.observe(202, 3.5) is None  # a new lone one starts over
    assert det.observe(203, 2.0) is None
    spike = det.observe(204, 5.1)  # 2.5x the median: no need to wait
    assert spike is not None and spike.step == 204


def test_a_jump_during_the_early_descent_is_judged_against_the_newest_losses() -> None:
    """The drill's undetected spike: the window still held the first steps' descent (10 to
    4), whose median and spread put a jump from 3.2 to 8.7 under the threshold and under
    2.5x the window's median; against the newest 10 losses' median (3.2) it is 2.7x. Before
    the descent leaves the window, its own noisy batches (2x) are still no spike."""
    rng = random.Random(3)
    descent = [10.0 - 0.55 * i for i in range(11)]  # 10.0 .. 4.5
    steady = [3.2 + rng.gauss(0, 0.05) for _ in range(10)]
    losses = descent + steady
    old = SpikeDetector(SpikeConfig(window=100, recent=100))  # the window's median alone
    new = SpikeDetector(SpikeConfig(window=100))
    for i, x in enumerate(losses):
        assert old.observe(i, x) is None and new.observe(i, x) is None
    assert old.observe(21, 8.7) is None  # hidden: the drill's miss
    spike = new.observe(21, 8.7)
    assert spike is not None and spike.step == 21 and not spike.non_finite
    det = SpikeDetector(SpikeConfig(window=100))
    for i, x in enumerate(losses):
        det.observe(i, x)
    assert det.observe(21, 6.4) is None and det.observe(22, 3.2) is None  # a noisy batch


def test_spikes_do_not_enter_the_baseline() -> None:
    det = SpikeDetector(SpikeConfig(window=20, min_history=5))
    for i, x in enumerate(_noisy(20)):
        det.observe(i, x)
    before = det.baseline()
    for i in range(20, 40):
        assert det.observe(i, 50.0) is not None
    assert det.baseline() == before


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_is_always_a_spike(bad: float) -> None:
    det = SpikeDetector(SpikeConfig())
    spike = det.observe(0, bad)  # even before any history
    assert spike is not None and spike.non_finite


def test_nothing_is_called_before_min_history() -> None:
    det = SpikeDetector(SpikeConfig(window=10, min_history=5))
    for i, x in enumerate([1.0, 1.0, 1.0, 1.0]):
        assert det.observe(i, x) is None
    assert det.observe(4, 100.0) is None  # fifth value still builds the baseline
    assert det.observe(5, 100.0) is not None


def test_a_prior_judges_until_the_detectors_own_history_is_long_enough() -> None:
    """A driver that just took the lead: the rank's own recent losses (median 2.0, MAD
    0.02 over 40) are the baseline, so a 10x loss is a spike at once; a prior of fewer
    than `min_history` losses is not trusted; once the detector has its own history the
    prior is not used (a prior claiming a baseline of 50 no longer hides a spike)."""
    cfg = SpikeConfig(window=10, min_history=5)
    prior = Prior(median=2.0, mad=0.02, n=40)
    fresh = SpikeDetector(cfg)
    spike = fresh.observe(7, 20.0, prior)
    assert spike is not None and spike.step == 7 and spike.baseline == pytest.approx(2.0)
    assert SpikeDetector(cfg).observe(7, 20.0, Prior(2.0, 0.02, n=4)) is None
    assert SpikeDetector(cfg).observe(7, 2.01, prior) is None  # in the band: accepted
    own = SpikeDetector(cfg)
    for i, x in enumerate(_noisy(5)):
        assert own.observe(i, x) is None
    assert own.observe(5, 20.0, Prior(median=50.0, mad=1.0, n=40)) is not None


def test_flat_loss_uses_relative_spread_floor() -> None:
    det = SpikeDetector(
        SpikeConfig(window=10, min_history=5, factor=5.0, min_rel_spread=0.01, confirm=1)
    )
    for i in range(10):
        det.observe(i, 1.0)
    assert det.observe(10, 1.04) is None  # within 5 x 1 % of the median
    assert det.observe(11, 1.06) is not None


def test_falling_loss_is_never_a_spike() -> None:
    det = SpikeDetector(SpikeConfig(window=30, min_history=5))
    for i in range(300):
        assert det.observe(i, 10.0 * math.exp(-i / 50)) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=12, max_size=60), st.floats(2.0, 8.0))
def test_property_a_huge_loss_after_history_is_a_spike(xs: list[float], factor: float) -> None:
    det = SpikeDetector(SpikeConfig(window=len(xs), min_history=10, factor=factor, confirm=1))
    for i, x in enumerate(xs):
        det.observe(i, x)
    base = det.baseline()
    assert base is not None
    assert det.observe(len(xs), base[1] * 2 + 1) is not None
    assert det.observe(len(xs) + 1, min(xs)) is None


def _spike(step: int) -> Spike:
    return Spike(step, 9.0, 2.0, 3.0, 6.0, False)


def test_rollback_to_newest_checkpoint_strictly_before_the_spike() -> None:
    pol = RollbackPolicy(SpikeConfig(skip_before=2, skip_after=5))
    d = pol.decide(_spike(100), [50, 90, 99, 100, 110])
    assert (d.from_step, d.to_step, d.halt) == (100, 99, False)
    # batches 98..104, but never before the restored step + 1
    assert (d.skip_first, d.skip_last) == (100, 104)
    d2 = RollbackPolicy(SpikeConfig(skip_before=5, skip_after=3)).decide(_spike(100), [80])
    assert (d2.to_step, d2.skip_first, d2.skip_last, d2.skip_batches) == (80, 95, 102, 8)


def test_min_checkpoint_gap_reaches_further_back() -> None:
    pol = RollbackPolicy(SpikeConfig(min_checkpoint_gap=10))
    assert pol.decide(_spike(100), [80, 89, 95, 99]).to_step == 89


def test_no_checkpoint_before_the_spike_halts() -> None:
    d = RollbackPolicy(SpikeConfig()).decide(_spike(5), [5, 6])
    assert d.halt and "no checkpoint" in d.reason


def test_repeated_rollbacks_halt() -> None:
    pol = RollbackPolicy(SpikeConfig(max_rollbacks=2, rollback_window_steps=100))
    assert not pol.decide(_spike(100), [90]).halt
    assert not pol.decide(_spike(101), [90]).halt
    d = pol.decide(_spike(102), [90])
    assert d.halt and "2 rollbacks" in d.reason
    assert not pol.decide(_spike(300), [290]).halt  # outside the window again


def test_zero_skip_skips_nothing() -> None:
    d = RollbackPolicy(SpikeConfig(skip_before=0, skip_after=0)).decide(_spike(10), [5])
    assert d.skip_batches == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window": 2}, "window"),
        ({"min_history": 0}, "min_history"),
        ({"factor": 0}, "factor"),
        ({"skip_after": -1}, "skip_after"),
        ({"rollback_window_steps": 0}, "rollback_window_steps"),
        ({"confirm": 0}, "confirm"),
        ({"instant_ratio": 1.0}, "instant_ratio"),
        ({"recent": 0}, "recent"),
        ({"window": 5, "min_history": 5, "recent": 6}, "recent"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpikeConfig(**kwargs)  # type: ignore[arg-type]


def test_decisions_map_onto_events() -> None:
    s = Spike(7, math.inf, 2.0, 3.0, 6.0, True)
    e = s.to_event()
    assert (e.step, e.non_finite, e.factor) == (7, True, 6.0)
    d = RollbackPolicy(SpikeConfig(skip_after=4)).decide(s, [5])
    r = d.to_event()
    assert (r.from_step, r.to_step, r.skip_batches) == (7, 5, 4)
    assert "non-finite" in r.reason
