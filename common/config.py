"""Command-line flags generated from a tree of config dataclasses: one source of truth.

A config field's default is written once, on the field. `add_config_flags` turns the fields of
a dataclass (and of the dataclasses nested in it) into argparse flags whose defaults are read
from the fields and whose help comes from the field's metadata, with the default appended by
this module (so help text never restates it); `config_from_args` builds the dataclass back from
the parsed namespace. The flag's namespace name is its long name without the dashes
(`--miss-limit` -> `miss_limit`), which is also its key in a `--config` TOML file.

A field's metadata (`field(default=..., metadata={"help": "..."})`) may hold:
  help     the flag's help; the helper adds "(default: X)".
  flag     the flag's name when it is not `--<prefix><name-with-dashes>`; None: no flag of its
           own, and then `why` says where the value comes from (another flag, a command).
  negate   the flag is this `--no-...` switch and the field is True unless it is given.
  choices  the values argparse accepts.
  parse    str -> value, for a field whose type is not a plain scalar or a comma list.
  unset    the flag defaults to unset (None), so the caller can tell "not given" apart
           (the field's default still applies when it is not given).
  append   a repeatable flag collected into a tuple.
  env      an environment variable that gives the flag's default when set (a flag given
           on the line wins; nothing overrides a flag).
  metavar, nargs, const  as in argparse.
  group    the title of the argument group the flag is listed under.
On a nested dataclass field: `prefix` (put before its fields' flag names), `group` (the title
of an argument group for them), or `flag: None` (its fields get no flags; the caller builds it).

Why not tyro (torchtitan's choice): our CLI is argparse subcommands whose flags are also the
keys of `--config` TOML files and whose names are public (README, deploy/, tests), many of
them not the field's path (`--no-start` for `start_workers`); a hundred lines over
`dataclasses.fields` keep those names and add no dependency to every process.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FlagField", "add_config_flags", "config_from_args", "finite_float", "flag_fields"]


@dataclasses.dataclass(frozen=True, slots=True)
class FlagField:
    """One field of the tree and the flag it gets (`flag` None: none of its own)."""

    path: str  # "service.live.miss_limit"
    field: dataclasses.Field[Any]
    type: Any  # the field's type with None stripped
    flag: str | None  # "--miss-limit"

    @property
    def dest(self) -> str | None:
        """The flag's name in the argparse namespace."""
        return None if self.flag is None else self.flag.lstrip("-").replace("-", "_")


def _strip_none(t: Any) -> Any:
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return t


def flag_fields(cls: type, prefix: str = "", path: str = "") -> Iterator[FlagField]:
    """Every leaf field of the dataclass tree under `cls`, with its flag name.

    A nested dataclass with `flag: None` in its metadata is one leaf (no flags for its fields).
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = _strip_none(hints[f.name])
        meta = f.metadata
        if dataclasses.is_dataclass(t) and meta.get("flag", "") is not None:
            yield from flag_fields(t, prefix + meta.get("prefix", ""), f"{path}{f.name}.")  # type: ignore[arg-type]
            continue
        if "flag" in meta:
            flag = meta["flag"]
        else:
            flag = meta.get("negate") or "--" + prefix + f.name.replace("_", "-")
        yield FlagField(path=path + f.name, field=f, type=t, flag=flag)


def _is_seq(t: Any) -> bool:
    return typing.get_origin(t) in (tuple, list)


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _shown(value: Any) -> str:
    if isinstance(value, tuple | list | frozenset):
        return ",".join(sorted(str(v) for v in value) if isinstance(value, frozenset) else value)
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def add_config_flags(
    parser: argparse._ActionsContainer, cls: type, prefix: str = ""
) -> dict[str, argparse._ActionsContainer]:
    """Add a flag for every field of the dataclass tree `cls` that has one.

    Returns:
        The argument groups made, by title (the caller may add flags of its own to them).

    Raises:
        argparse.ArgumentError: two fields ask for the same flag name.
    """
    groups: dict[str, argparse._ActionsContainer] = {}
    for ff in flag_fields(cls, prefix):
        if ff.flag is None:
            continue
        meta, f = ff.field.metadata, ff.field
        where = parser
        title = meta.get("group") or _group_title(cls, ff.path)
        if title:
            where = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        kw: dict[str, Any] = {"dest": ff.dest}
        help_ = meta.get("help", "")
        default = f.default
        if default is dataclasses.MISSING or meta.get("unset"):
            default = None
        if meta.get("negate"):
            kw.update(action="store_true", default=False)
        elif ff.type is bool and not meta.get("unset"):
            if default is True:
                raise ValueError(f"{ff.path}: a field that defaults to True needs `negate`")
            kw.update(action="store_true", default=False)
        elif ff.type is bool:
            kw.update(action=argparse.BooleanOptionalAction, default=None)
        elif meta.get("append"):
            kw.update(action="append", default=list(default or ()))
        else:
            shown = _shown(default) if default is not None else None
            if meta.get("env"):  # the variable names the default; a flag still wins
                help_ = f"{help_} (default: ${meta['env']}, else {shown or 'empty'})"
                default = os.environ.get(meta["env"]) or default
            elif shown:
                help_ = f"{help_} (default: {shown})"
            kw["default"] = default if isinstance(default, str | int | float) else shown
            kw["type"] = meta.get("parse") or _scalar(ff.type)
        for key in ("choices", "metavar", "required", "nargs", "const"):
            if key in meta:
                kw[key] = meta[key]
        where.add_argument(ff.flag, help=help_.strip() or None, **kw)
    return groups


def _group_title(cls: type, path: str) -> str:
    """The `group` metadata of the innermost nested field on `path` that has one ("": none)."""
    title = ""
    for name in path.split(".")[:-1]:
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        title = str(f.metadata.get("group", title))
        cls = _strip_none(typing.get_type_hints(cls)[name])
    return title


def finite_float(text: str) -> float:
    """A float flag's value: a finite number (`nan` and `inf` are no duration or limit)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _scalar(t: Any) -> Callable[[str], Any]:
    if _is_seq(t):
        return _comma_list
    if t is float:
        return finite_float
    if t in (int, str):
        return t  # type: ignore[no-any-return]
    if isinstance(t, type) and issubclass(t, str):  # a str enum
        return t
    raise TypeError(f"no flag type for {t!r}: give the field `parse` or `flag: None` metadata")


def config_from_args(cls: type, ns: argparse.Namespace, /, **given: Any) -> Any:
    """Build `cls` from the flags `add_config_flags(parser, cls)` declared.

    `given` sets fields that have no flag of their own, or overrides a flag with a value the
    caller derived (keys are field names; a nested dataclass may be given whole). A flag left
    unset (None) keeps the field's default.

    Raises:
        ValueError: the dataclass refuses the values (its message names the field).
    """
    return _build(cls, ns, "", given)


def _build(cls: type, ns: argparse.Namespace, prefix: str, given: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    flags = {x.path: x for x in flag_fields(cls, prefix) if "." not in x.path}
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kw[f.name] = given[f.name]
            continue
        t = _strip_none(hints[f.name])
        meta = f.metadata
        if dataclasses.is_dataclass(t):
            if meta.get("flag", "") is not None and t is hints[f.name]:  # not optional
                kw[f.name] = _build(t, ns, prefix + meta.get("prefix", ""), {})  # type: ignore[arg-type]
            continue
        ff = flags[f.name]
        if ff.dest is None or not hasattr(ns, ff.dest):
            continue
        value = getattr(ns, ff.dest)
        if meta.get("negate"):
            value = not value
        elif value is None:
            continue
        elif meta.get("append") or (_is_seq(t) and isinstance(value, list)):
            value = tuple(value)
        elif _is_seq(t) and isinstance(value, str):  # a default shown as text
            value = _comma_list(value)
        if typing.get_origin(t) is list:
            value = list(value)
        kw[f.name] = value
    return cls(**kw)
