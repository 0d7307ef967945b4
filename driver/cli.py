"""The `unbroken` command: one console script, one subcommand per module.

Each subcommand module exposes `configure(parser)` (add its flags) and `run(args) -> int`
(the exit code). Modules are imported only when their subcommand is chosen, except to
build `--help`, so they must not import torch at module level. This dispatcher lives in
driver/ but is the only driver module allowed to reach into agent/ (for `unbroken agent`).

Exit codes: 0 success, 1 the operation failed, 2 bad usage or input, 3 the driver or etcd
is unreachable, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Add a subcommand by adding one line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("unbroken.driver.up", "a local cluster: etcd, drivers, agents, training, a drill"),
    "etcd": ("unbroken.driver.etcd", "run an embedded etcd server until Ctrl-C"),
    "train": ("unbroken.trainer.train_cli", "train a model locally (torchrun for N processes)"),
    "driver": ("unbroken.driver.main", "run a driver (leader or standby) serving agents"),
    "agent": ("unbroken.agent.main", "run a node agent: workers, heartbeats, checks"),
    "plan": ("unbroken.trainer.plan_cli", "estimate days, memory per GPU, failures, ckpt interval"),
    "status": ("unbroken.driver.cli_status", "the job at a glance: phase, step, nodes, events"),
    "nodes": ("unbroken.driver.cli_nodes", "list the job's nodes with their state and heartbeats"),
    "events": ("unbroken.driver.cli_events", "print the event log (--since SEQ, --follow)"),
    "evict": ("unbroken.driver.cli_evict", "evict a node from the job"),
    "diagnose": ("unbroken.driver.cli_diagnose", "find bad and slow nodes (pause, check, resume)"),
    "checkpoints": ("unbroken.driver.cli_checkpoints", "committed checkpoints; --request one now"),
    "selfcheck": ("unbroken.driver.cli_selfcheck", "run the node self-checks; exit 1 if one fails"),
    "inject": ("unbroken.driver.cli_inject", "inject a simulated fault into a node (drills)"),
    "certs": (
        "unbroken.driver.certs",
        "a CA and per-principal certificates (node:ID, operator:NAME)",
    ),
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with `only`, import just that subcommand's module."""
    parser = argparse.ArgumentParser(
        prog="unbroken",
        description="Keeps PyTorch training runs alive through node, GPU and process faults.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only is None or only == name:
            importlib.import_module(module).configure(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `unbroken` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if a in SUBCOMMANDS), None)
    wants_help = not args_list or args_list[0] in ("-h", "--help")
    parser = build_parser(None if wants_help else chosen)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
