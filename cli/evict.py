"""`unbroken evict NODE`: take a node out of the job (logged as an operator action)."""

from __future__ import annotations

import argparse

from unbroken.cli.client import ClientConfig, add_client_flags, print_json, run_command, to_dict
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken evict`."""
    parser.add_argument("node", metavar="NODE", help="node id (see `unbroken nodes`)")
    parser.add_argument("--reason", default="operator", help="why, for the event log")
    add_client_flags(parser)


def run(ns: argparse.Namespace) -> int:
    """`unbroken evict`; exit 0 evicted, 1 refused (already evicted, not leader), 2 unknown
    node, 3 driver unreachable."""

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        resp = await stub.Evict(
            dpb.EvictRequest(node_id=ns.node, reason=ns.reason), timeout=cfg.timeout_s, metadata=md
        )
        if ns.json:
            print_json({"node_id": ns.node, **to_dict(resp)})
            return 0
        if resp.recovering:
            told = "the recovery loop takes it out now (a spare, or a smaller world)"
        elif resp.agent_notified:
            told = "its agent stopped"
        else:
            told = "its agent was not reachable"
        print(f"evicted {ns.node} (event seq {resp.seq}); {told}")
        return 0

    return run_command("evict", ns, body)
