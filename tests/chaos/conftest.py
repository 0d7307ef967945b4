"""Chaos options: `--chaos-seed N` (or UNBROKEN_CHAOS_SEED=N) replays one seed.

A chaos test takes the `chaos_seed` fixture, parametrized indirectly with its default
seeds; the option (or the variable) replaces every default, so a failing seed printed by
a run is replayed with `pytest tests/chaos -k <test> --chaos-seed <seed>`.
"""

from __future__ import annotations

import os

import pytest

ENV = "UNBROKEN_CHAOS_SEED"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-seed",
        type=int,
        default=None,
        help=f"run every chaos test with this seed instead of its defaults (or set ${ENV})",
    )


def override(config: pytest.Config) -> int | None:
    """The seed from --chaos-seed or $UNBROKEN_CHAOS_SEED, if either is given."""
    opt = config.getoption("--chaos-seed", default=None)
    if opt is not None:
        return int(opt)
    env = os.environ.get(ENV, "").strip()
    if not env:
        return None
    if not env.isdigit():
        raise pytest.UsageError(f"{ENV} must be a non-negative integer seed, got {env!r}")
    return int(env)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    seed = override(metafunc.config)
    if seed is None or "chaos_seed" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        if "chaos_seed" in str(mark.args[0]):
            mark.args[1][:] = [seed]  # the same test, the given seed only


@pytest.fixture
def chaos_seed(request: pytest.FixtureRequest) -> int:
    """The seed of this chaos run."""
    return int(request.param)
