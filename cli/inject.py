"""`unbroken inject FAULT --node NODE`: inject a simulated fault into a running node (drills).

The driver logs an OperatorAction ("inject", who) and forwards the fault to the node's
agent, which applies it (common/faults.py RUNTIME_FAULTS lists the kinds). What
follows is the system's own doing: detection, diagnosis, eviction, recovery. Exit 0 when
the agent applied the fault, 1 when it refused or did not answer, 2 for an unknown fault
or node, 3 when the driver is unreachable.
"""

from __future__ import annotations

import argparse
import sys

from unbroken.cli.client import ClientConfig, add_client_flags, print_json, run_command, to_dict
from unbroken.common.faults import RUNTIME_FAULTS, RuntimeFault
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken inject`."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "faults:\n" + "\n".join(f"  {k:<13} {v}" for k, v in RUNTIME_FAULTS.items())
    parser.add_argument("fault", metavar="FAULT", help="the fault (listed below)")
    parser.add_argument("--node", required=True, help="node id (see `unbroken nodes`)")
    parser.add_argument("--rank", type=int, default=0, help="local rank for crash / hang")
    parser.add_argument("--factor", type=float, default=0.0, help="slowdown for slow (default 2)")
    parser.add_argument("--step", type=int, default=0, help="step for nan / loss-spike (0: next)")
    add_client_flags(parser)


def run(ns: argparse.Namespace) -> int:
    """`unbroken inject`."""
    try:
        f = RuntimeFault.of(ns.fault, ns.rank, ns.factor, ns.step)
    except ValueError as e:
        print(f"unbroken inject: {e}", file=sys.stderr)
        return 2

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        req = dpb.InjectFaultRequest(
            node_id=ns.node, kind=f.kind, local_rank=f.local_rank, factor=f.factor, step=f.step
        )
        resp = await stub.InjectFault(req, timeout=cfg.timeout_s + 15.0, metadata=md)
        if ns.json:
            print_json({"node_id": ns.node, "fault": f.kind, **to_dict(resp)})
        elif resp.ok:
            print(f"injected {f.kind} into {ns.node} (event seq {resp.seq}): {resp.detail}")
        if not resp.ok:
            print(
                f"unbroken inject: {ns.node} did not apply {f.kind}: {resp.detail}",
                file=sys.stderr,
            )
            return 1
        return 0

    return run_command("inject", ns, body)
