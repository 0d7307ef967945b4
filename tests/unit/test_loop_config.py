"""LoopConfig: the job `unbroken driver --nodes ...` starts; bad layouts name the field."""

from __future__ import annotations

import pytest

from unbroken.driver.loop import LoopConfig


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
