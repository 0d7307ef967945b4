"""The `unbroken` command: one console script, one subcommand per module.

Each subcommand module exposes `configure(parser)` (add its flags) and `run(args) -> int`
(the exit code). Modules are imported only when their subcommand is chosen, except to
build `--help`, so they must not import torch at module level. cli/ may import every other
part (it starts the driver, the agent and the trainer); nothing imports cli/.

Exit codes: 0 success, 1 the operation failed, 2 bad usage or input, 3 the driver or etcd
is unreachable, 130 interrupted.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import math
import os
import sys
from collections.abc import Sequence

from unbroken.common.config import finite_float

# name -> (module, one-line help). Add a subcommand by adding one line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("unbroken.cli.up", "a local cluster: etcd, drivers, agents, training, a drill"),
    "etcd": ("unbroken.driver.etcd", "run an embedded etcd server until Ctrl-C"),
    "train": ("unbroken.trainer.train_cli", "train a model locally (torchrun for N processes)"),
    "driver": ("unbroken.driver.main", "run a driver (leader or standby) serving agents"),
    "agent": ("unbroken.agent.main", "run a node agent: workers, heartbeats, checks"),
    "plan": ("unbroken.trainer.plan_cli", "estimate days, memory per GPU, failures, ckpt interval"),
    "status": ("unbroken.cli.status", "the job at a glance: phase, step, nodes, events"),
    "nodes": ("unbroken.cli.nodes", "list the job's nodes with their state and heartbeats"),
    "events": ("unbroken.cli.events", "print the event log (--since SEQ, --follow)"),
    "evict": ("unbroken.cli.evict", "evict a node from the job"),
    "resume": ("unbroken.cli.resume", "bring a failed or stuck job back (fresh restore budget)"),
    "diagnose": ("unbroken.cli.diagnose", "find bad and slow nodes (pause, check, resume)"),
    "checkpoints": ("unbroken.cli.checkpoints", "committed checkpoints; --request one now"),
    "selfcheck": ("unbroken.cli.selfcheck", "run the node self-checks; exit 1 if one fails"),
    "inject": ("unbroken.cli.inject", "inject a simulated fault into a node (drills)"),
    "slurm": ("unbroken.cli.slurm", "run under Slurm: submit, nodes, resume a drained node"),
    "completion": ("unbroken.cli.completion", "print a shell completion script (bash, zsh)"),
    "certs": (
        "unbroken.driver.certs",
        "a CA and per-principal certificates (node:ID, operator:NAME)",
    ),
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


CONFIGURABLE = ("driver", "agent")
# the driver's clients: grpc's own log lines (a failed TLS handshake) stay off their stderr,
# which carries one line per error (cli/tlsprobe.py names the cause)
CLIENTS = frozenset(
    {"status", "nodes", "events", "evict", "resume", "diagnose", "checkpoints", "selfcheck",
     "inject"}
)  # fmt: skip  # subcommands that take --config FILE / --print-config
NOT_IN_CONFIG = {"help", "config", "print_config", "token"}


class ConfigError(ValueError):
    """A config file that cannot be used (its message names the file and the key)."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with `only`, import just that subcommand's module."""
    parser = argparse.ArgumentParser(
        prog="unbroken",
        description="Keeps PyTorch training runs alive through node, GPU and process faults. "
        "--debug (anywhere) shows tracebacks.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only is None or only == name:
            importlib.import_module(module).configure(p)
            if name in CONFIGURABLE:
                p.add_argument(
                    "--config",
                    metavar="FILE",
                    help="TOML file of settings named as the flags, without the dashes "
                    '(listen = "0.0.0.0:50051", miss-limit = 5); flags override it',
                )
                p.add_argument(
                    "--print-config",
                    action="store_true",
                    help="print the effective settings as TOML and exit",
                )
            SUBPARSERS[name] = p
    return parser


SUBPARSERS: dict[str, argparse.ArgumentParser] = {}


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        a.dest: a
        for a in p._actions
        if a.option_strings and a.dest not in NOT_IN_CONFIG and a.help != argparse.SUPPRESS
    }


def apply_config(p: argparse.ArgumentParser, path: str) -> None:
    """Make `path`'s settings the defaults of `p` (flags given on the line still win)."""
    import tomllib
    from pathlib import Path

    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    options = _options(p)
    values: dict[str, object] = {}
    for key, value in data.items():
        a = options.get(key.replace("-", "_"))
        if a is None:
            raise ConfigError(
                f"{path}: unknown key {key!r}; keys are the flags of `unbroken {p.prog.split()[-1]}"
                " --help` without the dashes"
            )
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
            if not isinstance(value, bool):
                raise ConfigError(f"{path}: {key} must be true or false, got {value!r}")
        elif isinstance(a, argparse._AppendAction):
            value = value if isinstance(value, list) else [value]
            value = [str(v) for v in value]
        elif a.type in (int, float, finite_float):
            value = _config_number(path, key, value, int if a.type is int else float)
        elif a.type is not None and not isinstance(value, bool):
            try:
                value = a.type(value)  # type: ignore[misc,operator]
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{path}: {key} = {value!r} is not valid: {e}") from None
        elif isinstance(value, dict | list):
            raise ConfigError(f"{path}: {key} must be a single value, got {value!r}")
        if a.choices is not None and value not in a.choices:
            raise ConfigError(f"{path}: {key} must be one of {list(a.choices)}, got {value!r}")
        values[a.dest] = value
        a.required = False
    p.set_defaults(**values)


def _config_number(path: str, key: str, value: object, kind: type) -> int | float:
    """`value` of a number key of a config file, or a ConfigError naming the key: a number
    (not a bool or a string), finite, and whole where the flag takes an integer (2.7 is
    not silently read as 2)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}: {key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{path}: {key} must be a finite number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{path}: {key} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def effective_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The settings `args` holds, as a TOML file `--config` accepts."""
    import json

    lines = []
    for dest, a in _options(p).items():
        v = getattr(args, dest, None)
        key = a.option_strings[-1].lstrip("-")
        if v is None:
            lines.append(f"# {key} =  (unset)")
        elif isinstance(v, bool):
            lines.append(f"{key} = {'true' if v else 'false'}")
        elif isinstance(v, int | float):
            lines.append(f"{key} = {v}")
        elif isinstance(v, list | tuple) and isinstance(a, argparse._AppendAction):
            lines.append(f"{key} = {json.dumps([str(x) for x in v])}")
        elif isinstance(v, list | tuple | frozenset):  # a comma-separated flag, parsed
            items = sorted(v) if isinstance(v, frozenset) else v
            lines.append(f"{key} = {json.dumps(','.join(str(x) for x in items))}")
        elif isinstance(v, enum.Enum):
            lines.append(f"{key} = {json.dumps(str(v.value))}")
        else:
            lines.append(f"{key} = {json.dumps(str(v))}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `unbroken` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list or os.environ.get("UNBROKEN_DEBUG") == "1"
    args_list = [a for a in args_list if a != "--debug"]
    if args_list[:1] == ["--version"]:  # before any subcommand module is imported
        from unbroken.common.version import __version__

        print(f"unbroken {__version__}")
        return EXIT_OK
    chosen = next((a for a in args_list if a in SUBCOMMANDS), None)
    if chosen in CLIENTS and not debug:
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    wants_help = not args_list or args_list[0] in ("-h", "--help")
    parser = build_parser(None if wants_help else chosen)
    if chosen in CONFIGURABLE and chosen in SUBPARSERS:
        path = _config_path(args_list)
        if path is not None:
            try:
                apply_config(SUBPARSERS[chosen], path)
            except ConfigError as e:
                print(f"unbroken {chosen}: {e}", file=sys.stderr)
                return EXIT_USAGE
    args = parser.parse_args(args_list)
    if args.version:
        from unbroken.common.version import __version__

        print(f"unbroken {__version__}")
        return EXIT_OK
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if getattr(args, "print_config", False):
        print(effective_config(SUBPARSERS[args.command], args), end="")
        return EXIT_OK
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        if debug:
            raise
        print(f"unbroken {args.command}: {e}; check the path and its permissions", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # a bug or an unforeseen condition: one line, unless --debug
        if debug:
            raise
        print(
            f"unbroken {args.command}: {type(e).__name__}: {e} (run with --debug for the "
            "traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED


def _config_path(args: list[str]) -> str | None:
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


if __name__ == "__main__":
    sys.exit(main())
