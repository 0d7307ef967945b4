"""Node tokens bound to one node: `unbroken up` hands out no other kind, and torchrun works
with them.

The old `unbroken up` gave every node one shared, unbound node token (the torchrun key
derivation needed every node to hold the same one): its holder opened a session as any
node, took its commands and locked the real agent out with a higher epoch. Real gRPC (the
driver service in-process, with the rendezvous), real token files as `up` writes them,
and torch's own rendezvous handler over our backend.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from tests.inproc import driver, session_md, status_of
from unbroken.agent import rdzv
from unbroken.cli.cluster import LocalCluster
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

NODES = ["node-0", "node-1", "spare-0"]


def up_tokens(tmp_path: Path) -> tuple[LocalCluster, RoleTokens]:
    """The token files `unbroken up` writes, and the driver's view of them."""
    cluster = LocalCluster(tmp_path / "run", job="bound")
    flags = cluster.make_tokens(NODES)
    specs = [flags[i + 1] for i in range(0, len(flags), 2)]
    return cluster, RoleTokens.from_files(specs)


def token_of(cluster: LocalCluster, node: str) -> str:
    return cluster.node_token_file(node).read_text().strip()


def test_up_hands_out_only_bound_node_tokens(tmp_path: Path) -> None:
    """Every line of the node token file names its node; node-0's token registers node-0
    and is refused as node-1 (no session, no commands, no epoch over node-1's agent)."""
    cluster, tokens = up_tokens(tmp_path)
    lines = (cluster.run / "tokens" / "node.tokens").read_text().split("\n")
    assert sorted(line.split()[1] for line in lines if line) == sorted(NODES)
    assert not (cluster.run / "tokens" / "node.token").exists()  # no shared node token

    async def go() -> None:
        async with driver(ServiceConfig(tokens=tokens)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                md = (("authorization", f"Bearer {token_of(cluster, 'node-0')}"),)
                own = stub.Register(dpb.RegisterRequest(node_id="node-0", epoch=1), metadata=md)
                assert await status_of(own) == grpc.StatusCode.OK
                other = stub.Register(dpb.RegisterRequest(node_id="node-1", epoch=9), metadata=md)
                assert await status_of(other) == grpc.StatusCode.PERMISSION_DENIED
                assert "node-1" not in svc.view.nodes

    asyncio.run(go())


def _handler(addr: str, token_file: Path, node_id: str, run_id: str) -> Any:
    params = RendezvousParameters(
        "unbroken", addr, run_id, 1, 2, local_addr="127.0.0.1", node_id=node_id,
        token_file=str(token_file), connect_timeout="60", retry_timeout="30",
    )  # fmt: skip
    return rdzv.create_handler(params)


def test_torchrun_works_with_a_bound_token_and_only_as_its_node(tmp_path: Path) -> None:
    """No rendezvous key configured: each node gets the run's key from the driver with its
    own bound token, so two nodes with different tokens share one sealed state. A bound
    token naming another node id is refused by the rendezvous."""
    cluster, tokens = up_tokens(tmp_path)

    async def go() -> None:
        config = ServiceConfig(tokens=tokens)
        async with driver(config, rendezvous=True) as (_svc, _store, addr):
            f0, f1 = (cluster.node_token_file(n) for n in ("node-0", "node-1"))
            h0 = await asyncio.to_thread(_handler, addr, f0, "node-0", "run-b")
            h1 = await asyncio.to_thread(_handler, addr, f1, "node-1", "run-b")
            k0, k1 = [
                await asyncio.to_thread(lambda h=h: h._state_holder._backend._key) for h in (h0, h1)
            ]
            assert k0 == k1 and len(k0) == 32
            h0._state_holder.state.round = 4
            h0._state_holder.mark_dirty()
            assert await asyncio.to_thread(h0._state_holder.sync) is True
            h1._state_holder._cache_duration = 0
            await asyncio.to_thread(h1._state_holder.sync)  # opens node-0's sealed state
            assert h1._state_holder.state.round == 4
            with pytest.raises(rdzv.RendezvousConnectionError, match="only as node 'node-0'"):
                await asyncio.to_thread(_handler, addr, f0, "node-1", "run-b")

    asyncio.run(go())


def test_the_driver_refuses_an_unbound_node_token(tmp_path: Path) -> None:
    """A node token not bound to a node id (an old-style shared token) is refused for
    Register and Session, with the way to issue bound ones; nothing is recorded. The same
    driver takes a bound token for its node."""
    unbound, bound = "u" * 32, "b" * 32

    async def go() -> None:
        tokens = RoleTokens({"node": [unbound, f"{bound} node-0"]})
        async with driver(ServiceConfig(tokens=tokens)) as (svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                md = (("authorization", f"Bearer {unbound}"),)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.Register(dpb.RegisterRequest(node_id="node-1", epoch=9), metadata=md)
                assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "<token> <node-id>" in (ei.value.details() or "")
                session = stub.Session(metadata=(*session_md("node-1", 9), *md))
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await session.read()
                assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "not bound to a node id" in (ei.value.details() or "")
                assert svc.view.nodes == {} and store.events == []
                own = stub.Register(
                    dpb.RegisterRequest(node_id="node-0", epoch=1),
                    metadata=(("authorization", f"Bearer {bound}"),),
                )
                assert await status_of(own) == grpc.StatusCode.OK
                assert list(svc.view.nodes) == ["node-0"]

    asyncio.run(go())
