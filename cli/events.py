"""`unbroken events [--since SEQ] [--follow]`: the job's event log, one line per event."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

from unbroken.cli.client import (
    ClientConfig,
    add_client_flags,
    print_json,
    run_command,
    to_dict,
)
from unbroken.cli.client import (
    console as make_console,
)
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

SUMMARY_CHARS = 160
#: lines of a stack dump that are not frames (faulthandler's and py-spy's headers)
HEADERS = ("Current thread", "Thread ", "Process ", "Python v", "(")


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken events`."""
    parser.add_argument(
        "--since", type=int, default=0, metavar="SEQ", help="only events after this seq"
    )
    parser.add_argument(
        "--follow", "-f", action="store_true", help="keep printing new events (Ctrl-C ends)"
    )
    add_client_flags(parser)


def _short(v: Any) -> Any:
    """A value as a person reads it: floats to 4 significant digits (float32 fields print
    as 0.30000001192092896 otherwise), lists and nested messages compactly."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ",".join(str(_short(x)) for x in v) + "]"
    if isinstance(v, dict):
        inner = " ".join(f"{k}={_short(x)}" for k, x in v.items() if x not in ("", 0, [], {}))
        return "{" + inner + "}"
    return v


def line(e: ev.Event, width: int = 80) -> str:
    """`e` as one human line of at most `width` characters: seq, kind, the short summary."""
    kind = e.WhichOneof("payload") or "?"
    if kind == "recovery_transition":  # the phases the job moved between, and why
        t = e.recovery_transition
        was, now = (
            ev.Phase.Name(p).removeprefix("PHASE_").lower() for p in (t.from_phase, t.to_phase)
        )
        text = f"{e.seq:>5} {was} -> {now} {t.incident_id}: {t.reason}"
    else:
        text = f"{e.seq:>5} {kind} {summary(e)}"
    return text if len(text) <= width else text[: width - 1] + "…"


def summary(e: ev.Event) -> str:
    """The payload of `e` as one short `key=value` line (stacks abbreviated: `stacks`)."""
    kind = e.WhichOneof("payload") or ""
    fields = to_dict(getattr(e, kind)) if kind else {}
    dump = fields.pop("stack_dump", "") if kind == "hang_suspected" else ""
    text = " ".join(
        f"{k}={_short(v)}" for k, v in fields.items() if v not in ("", 0, [], {}, False)
    )
    text = text[:SUMMARY_CHARS]
    return f"{text} stacks: {stacks(dump)}" if dump else text


def stacks(dump: str) -> str:
    """One line from a HangSuspected's stacks: each rank's innermost frame (where it is stuck).

    faulthandler and py-spy both list the most recent call first, so the first frame line
    of a rank's section is where it waits; `--json` prints the whole dump.
    """
    parts = []
    rank, frame, stopped = "", "", False
    for line in [*dump.splitlines(), "--- end ---"]:
        if line.startswith("--- "):
            if rank:
                parts.append(f"r{rank}{' stopped' if stopped else ''} {frame or '?'}")
            rank, frame, stopped = line.strip("- ").removeprefix("local rank "), "", False
        elif "process stopped" in line:
            stopped = True
        elif frame or line.startswith(HEADERS) or not line.strip():
            continue
        elif line.strip().startswith("File "):
            # faulthandler: File "/path/x.py", line 16 in fn
            where, _, fn = line.strip().removeprefix("File ").rpartition(" in ")
            path, _, lineno = where.partition(", line ")
            frame = f"{fn} ({path.strip(chr(34)).rsplit('/', 1)[-1]}:{lineno})"
        elif line.rstrip().endswith(")"):
            frame = line.strip()  # py-spy: "all_reduce (torch/distributed/c10d.py:3252)"
    lines = len(dump.splitlines())
    return " | ".join(parts) + f" [{lines} lines; --json for all]"


def run(ns: argparse.Namespace) -> int:
    """`unbroken events`; exit 0, 2 for a negative --since, 3 when unreachable."""
    if ns.since < 0:
        print("unbroken events: --since must be >= 0 (a sequence number)", file=sys.stderr)
        return 2

    since = ns.since  # the newest event printed: a call again (a new leader) goes on after it

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        nonlocal since
        from rich.markup import escape

        console = make_console(highlight=False)
        req = dpb.WatchEventsRequest(since_seq=since, follow=ns.follow)
        # following has no overall deadline (it runs until Ctrl-C); a one-shot read has one
        call = stub.WatchEvents(req, timeout=None if ns.follow else cfg.timeout_s, metadata=md)
        async for resp in call:
            e = resp.event
            since = e.seq  # WatchEvents sends seq > since_seq
            if ns.json:
                print_json(to_dict(e))
                continue
            when = dt.datetime.fromtimestamp(e.wall_time_unix_ns / 1e9, dt.UTC)
            console.print(
                f"{e.seq:>6} {when:%H:%M:%S.%f}"[:-3]
                + f" [bold]{e.WhichOneof('payload')}[/] {escape(summary(e))}",  # data: no markup
                soft_wrap=True,
            )
        return 0

    return run_command("events", ns, body)
