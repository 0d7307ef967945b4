"""The agent's default for warm standby workers."""

from __future__ import annotations

import pytest

from unbroken.agent.launch import warm_default

pytestmark = pytest.mark.unit


def test_standbys_are_on_by_default_only_with_spare_cores() -> None:
    assert warm_default(8, cpus=96)  # a GPU node: 8 workers, 96 cores
    assert warm_default(1, cpus=4)
    assert not warm_default(2, cpus=2)  # this project's 2-core machine
    assert not warm_default(1, cpus=2)
    assert not warm_default(8, cpus=16)
