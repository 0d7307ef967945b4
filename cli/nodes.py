"""`unbroken nodes`: every node of the job, its logged state joined with its heartbeats."""

from __future__ import annotations

import argparse

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
from unbroken.proto import events_pb2 as ev


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken nodes`."""
    add_client_flags(parser)


def state_name(state: int) -> str:
    """`NODE_STATE_ACTIVE` -> `active`."""
    return ev.NodeState.Name(state).removeprefix("NODE_STATE_").lower()


PAGE = 1000  # nodes per ListNodes call


def run(ns: argparse.Namespace) -> int:
    """`unbroken nodes`; exit 0, or 3 when the driver is unreachable."""

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        # page by page: each call stays short on a 10,000-node job
        resp = dpb.ListNodesResponse()
        after = ""
        while True:
            page = await stub.ListNodes(
                dpb.ListNodesRequest(page_size=PAGE, after=after),
                timeout=cfg.timeout_s,
                metadata=md,
            )
            resp.nodes.extend(page.nodes)
            if not page.next_after:
                break
            after = page.next_after
        if ns.json:
            out = []
            for n in resp.nodes:
                d = to_dict(n)
                d["state"] = state_name(n.state)
                out.append(d)
            print_json(out)
            return 0
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=f"{len(resp.nodes)} nodes", title_justify="left")
        cols = ("node", "state", "alive", "host", "ip", "workers", "step", "silent ms", "fail")
        for col in cols:
            t.add_column(col, justify="right" if col in ("step", "silent ms", "fail") else "left")
        for n in resp.nodes:
            running = sum(w.state == dpb.WORKER_STATE_RUNNING for w in n.workers)
            # processes another launcher started, attached through the hooks SDK
            extra = f" + {len(n.attached)} attached" if n.attached else ""
            t.add_row(
                escape(n.node_id),
                state_name(n.state) + (" (spare)" if n.spare and n.state != 2 else ""),
                "[green]yes[/]" if n.alive else "[red]no[/]",
                escape(n.hostname),
                escape(n.ip),
                f"{running}/{n.num_workers}{extra}",
                str(n.step),
                f"{n.silent_ms:.0f}",
                str(n.failures),
            )
        console().print(t)
        return 0

    return run_command("nodes", ns, body)
