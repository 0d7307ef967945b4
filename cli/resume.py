"""`unbroken resume`: bring a failed (or stuck) job back, with a fresh restore budget.

A job whose incident used up `--max-restore-attempts` failed restores stays in phase
PHASE_FAILED with its workers stopped. Once the cause is dealt with (a node repaired or
evicted, a spare started), `unbroken resume` records an OperatorAction "resume" (who, and
`--reason`, in the log) and the driver's recovery loop opens a new incident: it pauses
every node, reshapes the world (spares, or a smaller one) and restores from the newest
checkpoint every rank holds, with the whole restore budget again.
"""

from __future__ import annotations

import argparse

from unbroken.cli.client import ClientConfig, add_client_flags, print_json, run_command, to_dict
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken resume`."""
    parser.add_argument("--reason", default="", help="why, for the event log")
    add_client_flags(parser)


def run(ns: argparse.Namespace) -> int:
    """`unbroken resume`; exit 0 re-armed, 1 refused (running, finished, no recovery loop),
    3 driver unreachable."""

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        resp = await stub.Resume(
            dpb.ResumeRequest(reason=ns.reason), timeout=cfg.timeout_s, metadata=md
        )
        if ns.json:
            print_json(to_dict(resp))
            return 0
        was, now = resp.from_phase.removeprefix("PHASE_"), resp.phase.removeprefix("PHASE_")
        print(
            f"resumed (event seq {resp.seq}): {was.lower()} -> {now.lower()}; the recovery "
            "restores the job with a fresh restore budget (`unbroken status` follows it)"
        )
        return 0

    return run_command("resume", ns, body)
