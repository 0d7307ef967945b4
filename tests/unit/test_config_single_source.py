"""Every config field has one default (on the field) and is in its command's `--help`.

The flags of `unbroken driver`, `unbroken agent` and `unbroken train` are generated from
their config trees (common/config.py). A field either has a flag of its own, whose argparse
default is the field's and whose help text does not restate it, or says in its metadata
(`why`) which flag or runtime fact it comes from; a nested config without flags says why too.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from unbroken.agent.config import AgentConfig
from unbroken.agent.flash import NodeFlashConfig
from unbroken.agent.launch import WorkerSpec
from unbroken.cli import main as cli
from unbroken.common.config import FlagField, flag_fields
from unbroken.driver.main import DriverConfig
from unbroken.trainer.config import TrainConfig

pytestmark = pytest.mark.unit

TREES = {
    "driver": (DriverConfig,),
    "agent": (AgentConfig, WorkerSpec, NodeFlashConfig),
    "train": (TrainConfig,),
}


def _leaves() -> list[tuple[str, FlagField]]:
    return [(cmd, ff) for cmd, roots in TREES.items() for root in roots for ff in flag_fields(root)]


def _subparser(command: str) -> argparse.ArgumentParser:
    cli.build_parser(command)
    return cli.SUBPARSERS[command]


def _help(command: str) -> str:
    return re.sub(r"\s+", " ", _subparser(command).format_help())


@pytest.mark.parametrize("command", sorted(TREES))
def test_every_field_is_a_flag_in_help_or_says_where_it_comes_from(command: str) -> None:
    text = _help(command)
    missing, unexplained = [], []
    for cmd, ff in _leaves():
        if cmd != command:
            continue
        if ff.flag is None:
            if not ff.field.metadata.get("why"):
                unexplained.append(ff.path)
        elif not re.search(re.escape(ff.flag) + r"\b", text):
            missing.append(f"{ff.path} ({ff.flag})")
    assert not missing, f"not in `unbroken {command} --help`: {missing}"
    assert not unexplained, f"no flag and no `why` in the metadata: {unexplained}"


@pytest.mark.parametrize("command", sorted(TREES))
def test_every_flag_default_is_its_fields_and_help_does_not_restate_it(command: str) -> None:
    actions = {a.dest: a for a in _subparser(command)._actions}
    wrong = []
    for cmd, ff in _leaves():
        if cmd != command or ff.flag is None:
            continue
        a = actions[ff.dest]
        meta, d = ff.field.metadata, ff.field.default
        if meta.get("negate") or meta.get("unset") or meta.get("env"):
            expected = False if meta.get("negate") else a.default  # nothing to restate
        elif d is dataclasses.MISSING:
            expected = None
        elif isinstance(d, tuple | list | frozenset):
            expected = list(d) if meta.get("append") else a.type(a.default)  # type: ignore[misc]
        else:
            expected = d
        got = a.default
        if isinstance(d, tuple | frozenset) and not meta.get("append") and isinstance(got, str):
            got = a.type(got)  # type: ignore[misc]
        elif hasattr(d, "value") and isinstance(got, str):  # an enum shown by its value
            got = a.type(got)  # type: ignore[misc]
        if got != expected:
            wrong.append(f"{ff.path}: argparse default {a.default!r}, field {d!r}")
        said = meta.get("help", "")
        if d not in (dataclasses.MISSING, None, "", (), True, False) and re.search(
            r"default:? " + re.escape(str(d)), said
        ):
            wrong.append(f"{ff.path}: help restates the default: {said!r}")
    assert not wrong, "\n".join(wrong)


def test_no_flag_name_is_shared_by_two_fields() -> None:
    for command in TREES:
        seen: dict[str, str] = {}
        for cmd, ff in _leaves():
            if cmd == command and ff.flag is not None:
                assert ff.flag not in seen, f"{ff.flag}: {seen[ff.flag]} and {ff.path}"
                seen[ff.flag] = ff.path
