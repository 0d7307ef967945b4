"""`unbroken diagnose [--nodes N ...]`: run the bisection on the driver and print the verdict.

Progress (one bar per round, groups done of groups started) goes to stderr; the verdict
goes to stdout (a table, or JSON with `--json`). Exit 0 when the diagnosis finished
(whatever it found: the verdict says), 1 when it could not run, 2 for an unknown node,
3 when the driver is unreachable.
"""

from __future__ import annotations

import argparse
import sys

from unbroken.cli.client import ClientConfig, add_client_flags, print_json, run_command, to_dict
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken diagnose`."""
    parser.add_argument(
        "--nodes", nargs="+", default=[], metavar="NODE", help="nodes to check (default: all)"
    )
    parser.add_argument(
        "--round-timeout", type=float, default=0.0, help="seconds per round (default: driver's)"
    )
    add_client_flags(parser)


def _round_line(r: ev.DiagnosisRound) -> str:
    bad = [f"{'+'.join(g.node_ids)} ({g.failure or 'failed'})" for g in r.groups if not g.ok]
    return f"round {r.round}: {len(r.groups)} groups, " + (
        "failed: " + ", ".join(bad) if bad else "all passed"
    )


def run(ns: argparse.Namespace) -> int:
    """`unbroken diagnose`."""
    if ns.round_timeout < 0:
        print("unbroken diagnose: --round-timeout must be >= 0", file=sys.stderr)
        return 2

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        from rich.console import Console
        from rich.markup import escape
        from rich.progress import Progress, TaskID

        err = Console(stderr=True, highlight=False)
        req = dpb.DiagnoseRequest(node_ids=ns.nodes, round_timeout_s=ns.round_timeout)
        # a diagnosis takes rounds of checks: no overall deadline, the driver bounds each round
        call = stub.Diagnose(req, metadata=md)
        verdict: ev.DiagnosisVerdict | None = None
        bars: dict[int, TaskID] = {}
        with Progress(console=err, transient=False, disable=ns.json) as progress:
            async for msg in call:
                kind = msg.WhichOneof("kind")
                if kind == "started":
                    s = msg.started
                    paused = f"; paused training on {', '.join(s.paused_nodes)}" * bool(
                        s.paused_nodes
                    )
                    err.print(
                        escape(f"diagnosis {s.diagnosis_id} of {', '.join(s.node_ids)}{paused}")
                    )
                elif kind == "progress":
                    p = msg.progress
                    if p.round not in bars:
                        bars[p.round] = progress.add_task(f"round {p.round}", total=None)
                    progress.update(bars[p.round], total=p.groups_total, completed=p.groups_done)
                elif kind == "round":
                    if not ns.json:
                        progress.console.print(escape(_round_line(msg.round)))
                elif kind == "verdict":
                    verdict = msg.verdict
        if verdict is None:
            err.print("unbroken diagnose: the driver ended the stream without a verdict")
            return 1
        if ns.json:
            print_json(to_dict(verdict))
            return 0
        from rich.console import Console as Out
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=f"verdict of diagnosis {verdict.diagnosis_id}", show_header=False)
        t.add_column("what", style="bold")
        t.add_column("nodes")
        t.add_row("bad", escape(", ".join(verdict.bad_nodes) or "none"))
        t.add_row("slow", escape(", ".join(verdict.slow_nodes) or "none"))
        t.add_row("confirmed directly", escape(", ".join(verdict.confirmed_directly) or "-"))
        t.add_row("rounds / checks", f"{verdict.rounds} / {verdict.checks}")
        t.add_row("wall", f"{verdict.wall_s:.1f} s")
        Out().print(t)
        return 0

    return run_command("diagnose", ns, body)
