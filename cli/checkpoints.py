"""`unbroken checkpoints [--request [--wait]]`: committed checkpoints and each node's flash copies.

Without flags it lists what the driver's log says is committed (step, time, ranks, bytes,
where, and every rank's shard file when the driver can read the storage) and, per node,
the newest step its agent persisted from flash memory next to the step its workers are
at. `--request` asks every world node to save and persist a checkpoint now (the driver
picks a step just ahead of the live one); `--wait` then waits, with a spinner, until that
step is committed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

import grpc

from unbroken.cli.client import (
    ClientConfig,
    CliError,
    add_client_flags,
    print_json,
    run_command,
    to_dict,
)
from unbroken.cli.client import (
    console as make_console,
)
from unbroken.cli.main import EXIT_FAILED, EXIT_USAGE
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

DEFAULT_WAIT_S = 120.0
MAX_WAIT_S = 3600.0


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken checkpoints`."""
    parser.add_argument(
        "--request",
        action="store_true",
        help="ask every world node to flash-save and persist a checkpoint now",
    )
    parser.add_argument(
        "--wait", action="store_true", help="with --request: wait until the step is committed"
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="S",
        help=f"with --wait: give up after S seconds (default {DEFAULT_WAIT_S:g})",
    )
    parser.add_argument(
        "--lead-steps",
        type=int,
        default=0,
        metavar="N",
        help="with --request: save at the live step + N (default 0: the driver's, 2)",
    )
    parser.add_argument(
        "--no-shards",
        action="store_true",
        help="do not list each rank's shard file (the driver then skips reading the storage)",
    )
    add_client_flags(parser)


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def when(unix_ns: int) -> str:
    """Wall time for display (UTC), '?' when unknown."""
    if not unix_ns:
        return "?"
    return f"{dt.datetime.fromtimestamp(unix_ns / 1e9, dt.UTC):%Y-%m-%d %H:%M:%S}"


def usage_problem(ns: argparse.Namespace) -> str:
    """What is wrong with the flags ("" when nothing)."""
    if ns.wait and not ns.request:
        return "--wait needs --request (it waits for the requested checkpoint)"
    if not 0 < ns.wait_timeout <= MAX_WAIT_S:
        return f"--wait-timeout must be in (0, {MAX_WAIT_S:g}] seconds, got {ns.wait_timeout}"
    if ns.lead_steps < 0:
        return f"--lead-steps must be >= 0, got {ns.lead_steps}"
    return ""


def shards_text(c: dpb.CheckpointInfo) -> str:
    """The shards cell: each rank's file (up to 4), else a summary; or why there are none."""
    if c.pruned:
        return "pruned by retention"
    if c.shards_error:
        return c.shards_error[:120]
    if not c.shards:
        return "-"
    if len(c.shards) <= 4:
        return ", ".join(
            f"r{s.rank}" + (f"@{s.node_id}" if s.node_id else "") + f" {human_bytes(s.bytes)}"
            for s in c.shards
        )
    sizes = [s.bytes for s in c.shards]
    nodes = len({s.node_id for s in c.shards if s.node_id})
    return (
        f"{len(c.shards)} files on {nodes} nodes, "
        f"{human_bytes(min(sizes))}-{human_bytes(max(sizes))} each"
    )


def print_list(resp: dpb.ListCheckpointsResponse) -> None:
    """The two tables: committed checkpoints, then flash copies by node."""
    from rich.markup import escape
    from rich.table import Table

    console = make_console()
    t = Table(title="committed checkpoints (newest last)", title_justify="left")
    for col in ("step", "verified", "committed (UTC)", "ranks", "bytes", "location", "shards"):
        right = col in ("step", "ranks", "bytes")
        t.add_column(col, justify="right" if right else "left", overflow="fold")
    for c in resp.checkpoints:
        t.add_row(
            str(c.step),
            "yes" if c.verified else "-",
            when(c.wall_time_unix_ns),
            str(c.ranks or "?"),
            human_bytes(c.bytes),
            escape(c.uri),
            escape(shards_text(c)),
        )
    if not resp.checkpoints:
        console.print("no checkpoint committed yet")
    else:
        console.print(t)
    if resp.verified_steps:  # docs/sdc.md: a rollback after an SDC goes to the newest held
        steps = ", ".join(map(str, resp.verified_steps[-8:]))
        console.print(f"verified steps (replicas' fingerprints agreed, newest last): {steps}")
    n = Table(title="flash copies by node", title_justify="left")
    for col in ("node", "persisted step", "ranks", "live step"):
        n.add_column(col, justify="left" if col in ("node", "ranks") else "right")
    for x in resp.nodes:
        n.add_row(
            escape(x.node_id),
            str(x.persisted_step) if x.persisted_step or x.ranks else "-",
            ",".join(map(str, x.ranks)) or "-",
            str(x.live_step),
        )
    if resp.nodes:
        console.print(n)


def run(ns: argparse.Namespace) -> int:
    """`unbroken checkpoints`; exit 0, 1 refused or not committed in time, 2 bad usage,
    3 driver unreachable."""
    problem = usage_problem(ns)
    if problem:
        print(f"unbroken checkpoints: {problem}", file=sys.stderr)
        return EXIT_USAGE

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        if not ns.request:
            resp = await stub.ListCheckpoints(
                dpb.ListCheckpointsRequest(skip_shards=ns.no_shards),
                timeout=cfg.timeout_s,
                metadata=md,
            )
            if ns.json:
                data = to_dict(resp)
                print_json({"checkpoints": data["checkpoints"], "nodes": data["nodes"]})
            else:
                print_list(resp)
            return 0
        return await request(cfg, stub, md)

    async def request(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        req = dpb.RequestCheckpointRequest(
            wait=ns.wait, timeout_s=ns.wait_timeout if ns.wait else 0.0, lead_steps=ns.lead_steps
        )
        deadline = cfg.timeout_s + (ns.wait_timeout if ns.wait else 0.0)

        err = make_console(stderr=True)
        try:
            if ns.wait and not ns.json:
                with err.status(f"waiting up to {ns.wait_timeout:g} s for the commit..."):
                    resp = await stub.RequestCheckpoint(req, timeout=deadline, metadata=md)
            else:
                resp = await stub.RequestCheckpoint(req, timeout=deadline, metadata=md)
        except grpc.aio.AioRpcError as e:
            # the driver's own wait ran out: the driver is fine, the checkpoint is not in
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "committed" in (e.details() or ""):
                raise CliError(e.details() or "", EXIT_FAILED) from e
            raise
        if ns.json:
            print_json(to_dict(resp))
            return 0
        n = len(resp.node_ids)
        print(
            f"asked {n} node{'s' if n != 1 else ''} ({', '.join(resp.node_ids[:8])}"
            f"{', ...' if len(resp.node_ids) > 8 else ''}) to checkpoint step {resp.step} "
            f"(event seq {resp.seq})"
        )
        if ns.wait:
            print(f"committed step {resp.committed_step} at {resp.uri}")
        return 0

    return run_command("checkpoints", ns, body)
