"""Flags generated from config dataclasses (common/config.py): names, defaults, round trips."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from unbroken.common.config import add_config_flags, config_from_args, flag_fields

pytestmark = pytest.mark.unit


@dataclass(kw_only=True, slots=True, frozen=True)
class Inner:
    floor_ms: float = field(default=10.0, metadata={"help": "the floor"})
    k: int = field(default=3, metadata={"help": "k"})


@dataclass(kw_only=True, slots=True, frozen=True)
class Outer:
    name: str = field(default="x", metadata={"help": "a name", "choices": ("x", "y")})
    start: bool = field(default=True, metadata={"negate": "--no-start", "help": "wait"})
    loud: bool = field(default=False, metadata={"help": "say more"})
    port: int | None = field(default=None, metadata={"help": "a port (unset: off)"})
    tags: tuple[str, ...] = field(default=("a", "b"), metadata={"help": "comma-separated"})
    roots: tuple[str, ...] = field(default=(), metadata={"append": True, "help": "repeat"})
    cmd: list[str] = field(
        default_factory=list,
        metadata={"flag": "--cmd-line", "parse": str.split, "help": "a command"},
    )
    secret: str = field(default="", metadata={"flag": None, "why": "from a file"})
    inner: Inner = field(default_factory=Inner, metadata={"prefix": "in-", "group": "inner"})


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_config_flags(p, Outer)
    return p.parse_args(argv)


def test_defaults_come_from_the_fields() -> None:
    assert config_from_args(Outer, parse()) == Outer()


def test_every_kind_of_flag_maps_onto_its_field() -> None:
    ns = parse(
        "--name", "y", "--no-start", "--loud", "--port", "0", "--tags", "c, d",
        "--roots", "r1", "--roots", "r2", "--cmd-line", "python t.py", "--in-floor-ms", "5",
    )  # fmt: skip
    got = config_from_args(Outer, ns, secret="s")
    assert got == Outer(
        name="y",
        start=False,
        loud=True,
        port=0,
        tags=("c", "d"),
        roots=("r1", "r2"),
        cmd=["python", "t.py"],
        secret="s",
        inner=Inner(floor_ms=5.0),
    )


def test_help_shows_each_default_once_and_groups_nested_flags() -> None:
    p = argparse.ArgumentParser()
    add_config_flags(p, Outer)
    text = p.format_help()
    assert "(default: a,b)" in text and "(default: 10.0)" in text
    assert "inner:" in text and "--in-k" in text
    assert "--secret" not in text


def test_leaves_name_their_flags() -> None:
    flags = {f.path: f.flag for f in flag_fields(Outer)}
    assert flags["start"] == "--no-start" and flags["inner.k"] == "--in-k"
    assert flags["secret"] is None


def test_a_clash_of_flag_names_is_refused() -> None:
    @dataclass(kw_only=True)
    class Twice:
        a: Inner = field(default_factory=Inner)
        b: Inner = field(default_factory=Inner)

    with pytest.raises(argparse.ArgumentError):
        add_config_flags(argparse.ArgumentParser(), Twice)
