"""`unbroken selfcheck [--node N ...]`: run the node self-checks now and print the results.

The driver asks each node's agent to run its self-checks (matmul checksum, GPU memory in
use, MIG, ECC, free disk; diagnostics/selfcheck.py) and waits for the reports; each is
also appended to the log as SelfCheckReported, where a failure on a node of the world is a
fault the recovery loop acts on. Exit 0 when every node passed, 1 when one failed or did
not answer, 2 for an unknown node, 3 when the driver is unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys

from unbroken.cli.client import (
    ClientConfig,
    add_client_flags,
    console,
    print_json,
    run_command,
    to_dict,
)
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken selfcheck`."""
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NODE",
        help="a node to check (repeat for more; default: every connected node)",
    )
    parser.add_argument(
        "--check-timeout",
        type=float,
        default=0.0,
        help="seconds per node's self-check (default: the driver's, 120)",
    )
    add_client_flags(parser)


def _items(details_json: str) -> list[dict[str, object]]:
    try:
        items = json.loads(details_json) if details_json else []
    except ValueError:
        return []
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def run(ns: argparse.Namespace) -> int:
    """`unbroken selfcheck`."""
    if ns.check_timeout < 0:
        print("unbroken selfcheck: --check-timeout must be >= 0", file=sys.stderr)
        return 2

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        req = dpb.RunSelfCheckRequest(node_ids=ns.node, timeout_s=ns.check_timeout)
        # the checks import torch on each node: the call's deadline covers them
        deadline = (ns.check_timeout or 120.0) + 30.0 + cfg.timeout_s
        resp = await stub.RunSelfCheck(req, timeout=deadline, metadata=md)
        failed = [r.node_id for r in resp.results if not r.ok]
        if ns.json:
            out = []
            for r in resp.results:
                d = to_dict(r)
                d["items"] = _items(r.details_json)
                del d["details_json"]
                out.append(d)
            print_json(out)
            return 1 if failed else 0
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=f"self-checks of {len(resp.results)} node(s)", title_justify="left")
        for col in ("node", "result", "checks", "failures"):
            t.add_column(col)
        for r in resp.results:
            items = _items(r.details_json)
            passed = sum(bool(i.get("ok")) and not i.get("skipped") for i in items)
            skipped = sum(bool(i.get("skipped")) for i in items)
            t.add_row(
                escape(r.node_id),
                "[green]ok[/]" if r.ok else "[red]FAILED[/]",
                f"{passed} passed, {skipped} skipped" if items else "-",
                escape("; ".join([*r.failures, *([r.error] if r.error else [])])),
            )
        console().print(t)
        if failed:
            print(
                f"unbroken selfcheck: {len(failed)} node(s) failed: {', '.join(failed)}",
                file=sys.stderr,
            )
        return 1 if failed else 0

    return run_command("selfcheck", ns, body)
