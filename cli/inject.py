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
from unbroken.common.faults import RUNTIME_FAULTS, SDC_FAULTS, RuntimeFault, SdcDetail
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
    parser.add_argument(
        "--step", type=int, default=0, help="step for nan / loss-spike / sdc (0: next)"
    )
    sdc = parser.add_argument_group("sdc, sdc-matmul (docs/sdc.md)")
    sdc.add_argument(
        "--random-rank", action="store_true", help="sdc: the agent picks the local rank"
    )
    sdc.add_argument("--tensor", default="", help="sdc: a state tensor's name (default random)")
    sdc.add_argument("--bit", type=int, default=-1, help="sdc: the bit 0-31 (default random)")
    sdc.add_argument(
        "--target",
        default="",
        choices=("", "param", "optim", "copy"),
        help="sdc: a random flip's kind; copy: in the rank's next fingerprinted flash copy "
        "alone (its buddy's recomputation finds it)",
    )
    sdc.add_argument(
        "--size", type=float, default=1e-3, help="sdc-matmul: relative error (0 ends it)"
    )
    add_client_flags(parser)


def run(ns: argparse.Namespace) -> int:
    """`unbroken inject`."""
    try:
        f = RuntimeFault.of(ns.fault, ns.rank, ns.factor, ns.step)
        sdc = SdcDetail(bit=ns.bit, target=ns.target, tensor=ns.tensor, size=ns.size)
    except ValueError as e:
        print(f"unbroken inject: {e}", file=sys.stderr)
        return 2

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        req = dpb.InjectFaultRequest(
            node_id=ns.node, kind=f.kind, local_rank=f.local_rank, factor=f.factor, step=f.step
        )
        if f.kind in SDC_FAULTS:
            req.sdc.CopyFrom(
                dpb.SdcFault(
                    random_rank=ns.random_rank,
                    tensor=sdc.tensor,
                    bit=sdc.bit if sdc.bit >= 0 else None,
                    target=sdc.target,
                    size=sdc.size,
                )
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
