"""One node's credential cannot wear out what the job shares: streams, registrations,
relay capacity (the rendezvous' per-principal quotas are in test_rdzv_quota.py).

Real gRPC against the driver service in-process, with per-node named tokens; across a
failover, two real `unbroken driver` processes on the session's etcd, the leader SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.inproc import driver, session_md, until
from tests.security.conftest import running_driver
from unbroken.common import channel
from unbroken.driver import etcdlog
from unbroken.driver.etcd import EmbeddedEtcd
from unbroken.driver.principalquota import PrincipalQuotas
from unbroken.driver.security import RoleTokens
from unbroken.driver.server import LEADER_HEALTH
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

NODES = ("a", "b", "r0", "m1", "m2", "m3")
TOKENS = {n: f"quota-token-{n}-0123456789abcdef" for n in NODES}


def md(node: str, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[node]}"), *extra)


def _config(**quotas: int) -> ServiceConfig:
    tokens = RoleTokens({"node": [f"{t} {n}" for n, t in TOKENS.items()]})
    if not quotas:
        return ServiceConfig(tokens=tokens)
    return ServiceConfig(tokens=tokens, quotas=PrincipalQuotas(**quotas))


async def _ended(call: grpc.aio.StreamStreamCall, within_s: float) -> grpc.StatusCode | None:
    """The status the stream ended with within `within_s` (None: still open)."""
    try:
        async with asyncio.timeout(within_s):
            while True:
                if await call.read() == grpc.aio.EOF:
                    return grpc.StatusCode.OK
    except TimeoutError:
        return None
    except grpc.aio.AioRpcError as e:
        return e.code()


def test_a_newer_session_of_a_node_replaces_its_older_one() -> None:
    async def go() -> None:
        async with driver(_config()) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await stub.Register(dpb.RegisterRequest(node_id="a", epoch=1), metadata=md("a"))
                calls = []
                for _ in range(3):
                    calls.append(stub.Session(metadata=md("a", *session_md("a", 1))))
                    await until(lambda: svc.view.nodes["a"].connected, 5, "the session")
                    await asyncio.sleep(0.2)
                # the older streams are ended, the newest holds the node's commands
                for old in calls[:-1]:
                    assert await _ended(old, 5) == grpc.StatusCode.ABORTED, (
                        "an older session of the same node is still open"
                    )
                svc.send("a", dpb.DriverMessage(pause=dpb.Pause()))
                got = await asyncio.wait_for(calls[-1].read(), 5)
                assert got.WhichOneof("kind") == "pause"
                calls[-1].cancel()

    asyncio.run(go())


def test_one_node_registers_new_epochs_at_a_bounded_rate() -> None:
    async def go() -> None:
        async with driver(_config(registrations_per_minute=5)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                codes = []
                for epoch in range(1, 9):
                    try:
                        await stub.Register(
                            dpb.RegisterRequest(node_id="a", epoch=epoch), metadata=md("a")
                        )
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
                        detail = e.details() or ""
                assert codes[:5] == [grpc.StatusCode.OK] * 5
                assert codes[5:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3, codes
                assert "node:a" in detail and "registrations_per_minute=5" in detail
                assert svc.view.nodes["a"].epoch == 5  # nothing of the refused ones landed
                # another node is not held back by a's quota, and a's live epoch reconnects
                await stub.Register(dpb.RegisterRequest(node_id="b", epoch=1), metadata=md("b"))
                await stub.Register(dpb.RegisterRequest(node_id="a", epoch=5), metadata=md("a"))

    asyncio.run(go())


def test_a_relay_carries_a_bounded_number_of_members() -> None:
    async def go() -> None:
        async with driver(_config(max_relay_members=2)) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await stub.Register(dpb.RegisterRequest(node_id="r0", epoch=1), metadata=md("r0"))
                via = (channel.RELAY_KEY, "r0")
                for m in ("m1", "m2"):
                    await stub.Register(
                        dpb.RegisterRequest(node_id=m, epoch=1), metadata=md(m, via)
                    )
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Register(
                        dpb.RegisterRequest(node_id="m3", epoch=1), metadata=md("m3", via)
                    )
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_relay_members=2" in (e.value.details() or "")
                assert "m3" not in svc.view.nodes or svc.view.nodes["m3"].relay != "r0"
                # m3 may register directly; once m2 leaves the relay, m3 may join it
                await stub.Register(dpb.RegisterRequest(node_id="m3", epoch=1), metadata=md("m3"))
                await stub.Register(dpb.RegisterRequest(node_id="m2", epoch=2), metadata=md("m2"))
                await stub.Register(
                    dpb.RegisterRequest(node_id="m3", epoch=2), metadata=md("m3", via)
                )
                assert svc.view.nodes["m3"].relay == "r0"

    asyncio.run(go())


# ------------------------------------------------------------ across a failover
OK = grpc.StatusCode.OK
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


async def _leads(address: str) -> bool:
    """Whether the driver at `address` leads (its leader health check is SERVING)."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            got = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=LEADER_HEALTH), timeout=2
            )
        except grpc.aio.AioRpcError:
            return False
    return got.status == health_pb2.HealthCheckResponse.SERVING


async def _until_leads(address: str, what: str) -> None:
    for _ in range(600):
        if await _leads(address):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def _two_drivers(
    tmp: Path, etcd: EmbeddedEtcd, *quota_flags: str
) -> Iterator[tuple[dict[str, Any], dict[str, Any], str]]:
    """driver-a leading and driver-b standing by, one job on `etcd`, the module's node
    tokens bound to their ids, `quota_flags` given to both; yields their port files (with
    "address" their gRPC address, "pid" a's process) and the job id."""
    bound = tmp / "bound-tokens"
    bound.write_text("".join(f"{t} {n}\n" for n, t in TOKENS.items()))
    bound.chmod(0o600)
    job = f"quota-{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        started = []
        for name in ("driver-a", "driver-b"):
            (tmp / name).mkdir()
            args = [
                "--etcd", etcd.endpoint, "--archive-url", "none", "--job-id", job,
                "--driver-id", name, "--token-file", f"node={bound}", *quota_flags,
            ]  # fmt: skip
            ports = stack.enter_context(running_driver(tmp / name, args))
            ports["address"] = f"127.0.0.1:{ports['grpc_port']}"
            started.append(ports)
            if name == "driver-a":  # b stands by behind it
                asyncio.run(_until_leads(ports["address"], "driver-a to lead"))
        yield started[0], started[1], job


async def _register(address: str, node: str, epoch: int, *extra: tuple[str, str]) -> Any:
    """Register `node` at `epoch` with the driver at `address`: OK, or the AioRpcError."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await dgrpc.DriverStub(ch).Register(
                dpb.RegisterRequest(node_id=node, epoch=epoch),
                metadata=md(node, *extra),
                timeout=10,
            )
        except grpc.aio.AioRpcError as e:
            return e
    return OK


def _code(got: Any) -> grpc.StatusCode:
    return OK if got is OK else got.code()


async def _logged(etcd: EmbeddedEtcd, job: str, registrations: int) -> None:
    """Wait until the job's log holds `registrations` NodeRegistered events (an acknowledged
    registration is appended just after its reply: a kill before that loses it)."""
    client = await etcdlog.connect(etcd.config)
    try:
        log = etcdlog.EtcdEventLog(client, job, None, archive_url=etcdlog.NO_ARCHIVE)
        for _ in range(300):
            events = await log.read(1)
            if sum(e.HasField("node_registered") for e in events) >= registrations:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the log did not hold {registrations} registrations: {events}")
    finally:
        await client.close()


def _fail_over(a: dict[str, Any], b: dict[str, Any]) -> None:
    """SIGKILL driver-a (nothing handed over but the log); wait for driver-b to lead."""
    os.kill(a["pid"], signal.SIGKILL)
    asyncio.run(_until_leads(b["address"], "driver-b to lead once driver-a died"))


def test_a_new_leader_goes_on_with_the_quota_the_old_one_counted(
    tmp_path: Path, etcd_server: EmbeddedEtcd
) -> None:
    """A principal that used its registrations just before a failover gets no fresh quota
    from the new leader; its agent still comes back once under its live epoch."""
    flags = ("--quota-registrations-per-minute", "3")
    with _two_drivers(tmp_path, etcd_server, *flags) as (a, b, job):

        async def with_a() -> None:
            for epoch in (1, 2, 3):
                assert await _register(a["address"], "a", epoch) is OK
            assert _code(await _register(a["address"], "a", 4)) == RESOURCE_EXHAUSTED
            await _logged(etcd_server, job, 3)

        asyncio.run(with_a())
        _fail_over(a, b)

        async def with_b() -> None:
            # its agent (epoch 3) registers with the new leader: back, not a new epoch
            assert await _register(b["address"], "a", 3) is OK
            refused = await _register(b["address"], "a", 4)
            assert _code(refused) == RESOURCE_EXHAUSTED, (
                "the new leader gave node:a a fresh registration quota"
            )
            detail = refused.details() or ""
            assert "node:a" in detail and "registrations_per_minute=3" in detail, detail
            assert await _register(b["address"], "b", 1) is OK  # others are not held back

        asyncio.run(with_b())


def test_a_plain_failover_refuses_none_of_the_nodes_coming_back(
    tmp_path: Path, etcd_server: EmbeddedEtcd
) -> None:
    """Every node registered (its quota of one used, the relay full) registers once more
    with the new leader: none is refused, and the quotas still hold after."""
    flags = ("--quota-registrations-per-minute", "1", "--quota-max-relay-members", "2")
    via = (channel.RELAY_KEY, "r0")
    direct, relayed = ("a", "b", "r0"), ("m1", "m2")
    with _two_drivers(tmp_path, etcd_server, *flags) as (a, b, job):

        async def with_a() -> None:
            for n in direct:
                assert await _register(a["address"], n, 1) is OK
            for n in relayed:
                assert await _register(a["address"], n, 1, via) is OK
            await _logged(etcd_server, job, len(direct) + len(relayed))

        asyncio.run(with_a())
        _fail_over(a, b)

        async def with_b() -> None:
            got = {n: await _register(b["address"], n, 1) for n in direct}
            got |= {n: await _register(b["address"], n, 1, via) for n in relayed}
            assert {n: _code(g) for n, g in got.items()} == dict.fromkeys(got, OK), got
            # and nothing was handed out fresh: a new epoch, a third member of r0
            assert _code(await _register(b["address"], "a", 2)) == RESOURCE_EXHAUSTED
            assert _code(await _register(b["address"], "m3", 1, via)) == RESOURCE_EXHAUSTED

        asyncio.run(with_b())
