"""LoopConfig: the job `unbroken driver --nodes ...` starts; bad layouts name the field."""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.driver.loop import LoopConfig

pytestmark = pytest.mark.unit


def test_dp_defaults_to_the_rest_of_the_world() -> None:
    cfg = LoopConfig(nodes=4, workers_per_node=2, pp=2, tp=2)
    assert cfg.dp == 2
    w = cfg.world(["a", "b", "c", "d"])
    assert (w.dp, w.pp, w.tp, w.workers_per_node, list(w.node_ids)) == (
        2,
        2,
        2,
        2,
        ["a", "b", "c", "d"],
    )


def test_no_nodes_means_no_loop_and_no_layout_check() -> None:
    assert LoopConfig().nodes == 0 and LoopConfig(dp=7).dp == 7


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"nodes": 2, "dp": 3}, "dp x pp x tp"),
        ({"nodes": 3, "pp": 2}, "pp x tp"),
        ({"nodes": -1}, "nodes"),
        ({"nodes": 2, "workers_per_node": 0}, "workers_per_node"),
        ({"nodes": 2, "min_nodes": 3}, "min_nodes"),
        ({"nodes": 2, "restore_timeout_s": 0}, "restore_timeout_s"),
    ],
)
def test_bad_config_names_the_field(kw: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoopConfig(**kw)  # type: ignore[arg-type]


def test_every_restore_after_a_rollback_carries_its_skip() -> None:
    """The rollback's own restart restores its target and skips; a later crash restart
    restores the newest copy and carries the same skip, which a worker applies only when
    its next step is the skipped one (a crash before it replays no poisoned batch)."""
    from types import SimpleNamespace

    from unbroken.driver import machine, worldplan
    from unbroken.driver import state as statelib
    from unbroken.proto import events_pb2 as ev

    s = statelib.apply(
        statelib.initial("j"),
        ev.Event(seq=1, rollback=ev.Rollback(from_step=50, to_step=40, skip_batches=12)),
    )
    fake = SimpleNamespace(state=s, policy=machine.Policy())
    restore = machine.Restore(step=40, sources=(), reshard=False, incident_id="i", attempt=1)
    first = worldplan.restore_point(fake.state, restore, fake.policy)
    assert first.step == 40 and first.skip_batches > 0
    assert first.skip_from_step == 50  # from the spike's batch (batch i feeds step i)
    # the rollback resumed (its target cleared), then a worker crashed: newest, same skip
    fake.state = statelib.apply(s, ev.Event(seq=2, training_resumed=ev.TrainingResumed(at_step=40)))
    assert not fake.state.HasField("rollback_to")
    later = worldplan.restore_point(fake.state, restore, fake.policy)
    assert later.step == 0  # the newest copy
    assert (later.skip_from_step, later.skip_batches) == (first.skip_from_step, first.skip_batches)
    assert (
        worldplan.restore_point(fake.state, None, fake.policy) == type(first)()
    )  # no restore, no point


def _driver_config(*flags: str) -> object:
    import argparse

    from unbroken.driver import main as driver_main

    parser = argparse.ArgumentParser()
    driver_main.configure(parser)
    return driver_main.config_from_args(parser.parse_args(["--event-log", "memory", *flags]))


def test_the_spike_policys_rollback_limit_is_a_driver_flag() -> None:
    cfg: Any = _driver_config()
    assert (cfg.loop.policy.spike.max_rollbacks, cfg.loop.policy.spike.rollback_window_steps) == (
        3,
        1000,
    )
    cfg = _driver_config("--spike-max-rollbacks", "50", "--spike-rollback-window-steps", "200")
    spike = cfg.loop.policy.spike
    assert (spike.max_rollbacks, spike.rollback_window_steps) == (50, 200)
    assert spike.window == 100  # the detector's tuning keeps its defaults (no flags)
    with pytest.raises(ValueError, match=r"\(--spike-max-rollbacks\) must be >= 0"):
        _driver_config("--spike-max-rollbacks", "-1")
    with pytest.raises(ValueError, match=r"\(--spike-rollback-window-steps\) must be >= 1"):
        _driver_config("--spike-rollback-window-steps", "0")
