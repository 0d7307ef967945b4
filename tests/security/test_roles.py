"""Principals and roles on the driver's API: each attack of the threat model (SECURITY.md), refused.

A real driver (DriverService on a real gRPC server, loopback, an in-memory event log) with
role tokens: a node's token, an operator's, a launcher's, a viewer's. Each test plays the
attacker holding one credential and shows the call refused with a clear status and nothing
changed in the log. The mTLS variant uses certificates from `unbroken certs`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests import inproc
from tests.inproc import status_of
from unbroken.agent.config import AgentConfig
from unbroken.agent.daemon import Agent
from unbroken.common import channel
from unbroken.common.tls import TlsConfig
from unbroken.driver import certs
from unbroken.driver.eventlog import InMemoryStore
from unbroken.driver.launcher_api import outside_roots
from unbroken.driver.main import DriverConfig
from unbroken.driver.scheduler import BridgeConfig, InMemoryScheduler, SchedulerBridge
from unbroken.driver.security import AUTHZ, RoleTokens
from unbroken.driver.service import DriverService, ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev
from unbroken.proto import rendezvous_pb2 as rpb

pytestmark = pytest.mark.integration

NODE_A = "node-a-token-0123456789abcdef"
NODE_B = "node-b-token-0123456789abcdef"
OPERATOR = "operator-token-0123456789abcd"
LAUNCHER = "launcher-token-0123456789abcd"
VIEWER = "viewer-token-0123456789abcdef"
TOKENS = {
    "node": [f"{NODE_A} node-a", f"{NODE_B} node-b"],
    "operator": [f"{OPERATOR} alice"],
    "launcher": [LAUNCHER],
    "viewer": [VIEWER],
}
DENIED = grpc.StatusCode.PERMISSION_DENIED


def md(token: str, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"), *extra)


def driver(**kw: Any) -> AbstractAsyncContextManager[tuple[DriverService, InMemoryStore, str]]:
    """The in-process driver with this file's role tokens (unless `tokens` is given)."""
    kw.setdefault("tokens", RoleTokens(TOKENS))
    return inproc.driver(ServiceConfig(**kw))


async def register(stub: dgrpc.DriverStub, node: str, token: str, epoch: int = 1) -> Any:
    return await stub.Register(
        dpb.RegisterRequest(node_id=node, epoch=epoch, hostname="h"), metadata=md(token), timeout=5
    )


async def until(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_every_rpc_has_an_entry_in_the_authorization_table() -> None:
    """Walks every service in proto/: a new RPC without a role entry fails here."""
    methods = set()
    for module in (dpb, rpb):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                methods.add(f"/{service.full_name}/{m.name}")
    assert methods, "no services found in proto/"
    assert methods - set(AUTHZ) == set(), "RPCs nobody may call: add them to security.AUTHZ"
    assert set(AUTHZ) - methods == set(), "AUTHZ names RPCs that do not exist"


def test_a_node_token_cannot_operate_or_launch() -> None:
    async def go() -> None:
        async with driver(allow_fault_injection=True) as (svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await register(stub, "node-a", NODE_A)
                before = list(store.events)
                m = md(NODE_A)
                calls = {
                    "Evict": stub.Evict(dpb.EvictRequest(node_id="node-a"), metadata=m),
                    "ClearNode": stub.ClearNode(dpb.ClearNodeRequest(node_id="node-a"), metadata=m),
                    "InjectFault": stub.InjectFault(
                        dpb.InjectFaultRequest(node_id="node-a", kind="node-loss"), metadata=m
                    ),
                    "RunSelfCheck": stub.RunSelfCheck(dpb.RunSelfCheckRequest(), metadata=m),
                    "RegisterJob": stub.RegisterJob(dpb.RegisterJobRequest(), metadata=m),
                    "ReportFailure": stub.ReportFailure(dpb.ReportFailureRequest(), metadata=m),
                    "RequestCheckpoint": stub.RequestCheckpoint(
                        dpb.RequestCheckpointRequest(), metadata=m
                    ),
                    "GetStatus": stub.GetStatus(dpb.GetStatusRequest(), metadata=m),
                    "Resume": stub.Resume(dpb.ResumeRequest(reason="x" * 10_000), metadata=m),
                }
                for name, call in calls.items():
                    try:
                        await call
                        raise AssertionError(f"{name} was allowed to a node")
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == DENIED, (name, e)
                        assert f"node:node-a may not call {name}" in (e.details() or "")
                diag = stub.Diagnose(dpb.DiagnoseRequest(), metadata=m)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await diag.read()
                assert ei.value.code() == DENIED
                assert list(store.events) == before  # nothing recorded
                assert svc.view.nodes["node-a"].alive

    asyncio.run(go())


def test_a_viewer_reads_and_a_launcher_launches_but_neither_operates() -> None:
    async def go() -> None:
        async with driver() as (_svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                st = await stub.GetStatus(dpb.GetStatusRequest(), metadata=md(VIEWER))
                assert st.job_id == "job"
                for token in (VIEWER, LAUNCHER):
                    code = await status_of(
                        stub.Evict(dpb.EvictRequest(node_id="x"), metadata=md(token))
                    )
                    assert code == DENIED
                code = await status_of(
                    stub.RegisterJob(dpb.RegisterJobRequest(), metadata=md(VIEWER))
                )
                assert code == DENIED
                assert store.events == []

    asyncio.run(go())


def test_a_node_registers_and_opens_sessions_only_as_itself() -> None:
    """node-b's token cannot take node-a's commands nor bump its epoch (the real agent
    exited on "stale epoch" when an attacker did)."""

    async def go() -> None:
        async with driver() as (svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await register(stub, "node-a", NODE_A, epoch=5)
                n = len(store.events)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await register(stub, "node-a", NODE_B, epoch=6)
                assert ei.value.code() == DENIED
                assert "node:node-b may not register as node 'node-a'" in (ei.value.details() or "")
                assert svc.view.nodes["node-a"].epoch == 5 and len(store.events) == n
                call = stub.Session(
                    metadata=md(NODE_B, (channel.NODE_KEY, "node-a"), (channel.EPOCH_KEY, "5"))
                )
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await call.read()
                assert ei.value.code() == DENIED
                assert svc.view.nodes["node-a"].outbox is None  # no session took its commands

    asyncio.run(go())


def _shard(rank: int, world_size: int, uri: str = "/tmp/x") -> dpb.AgentMessage:
    return dpb.AgentMessage(
        shard_persisted=dpb.ShardPersisted(
            step=10, rank=rank, uri=f"{uri}/rank-{rank}.ubf", world_size=world_size, url=uri
        )
    )


@pytest.mark.parametrize("batched", [False, True], ids=["one", "batched"])
def test_a_node_reports_only_its_own_ranks(batched: bool) -> None:
    """A forged ShardPersisted for another node's rank never completes a checkpoint, alone
    or hidden in a batch (ShardsPersisted) next to the node's own shard."""

    async def go() -> None:
        async with driver() as (svc, store, addr):
            assert svc.journal is not None
            world = ev.WorldLayout(dp=2, pp=1, tp=1, node_ids=["node-a", "node-b"])
            world.workers_per_node = 1
            await svc.journal.record(ev.Event(job_started=ev.JobStarted(world=world)))
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await register(stub, "node-a", NODE_A)
                call = stub.Session(
                    metadata=md(NODE_A, (channel.NODE_KEY, "node-a"), (channel.EPOCH_KEY, "1"))
                )
                shards = [_shard(1, 2), _shard(0, 4), _shard(0, 2)]  # node-b's, stale, own
                if batched:
                    batch = dpb.ShardsPersisted(shards=[m.shard_persisted for m in shards])
                    await call.write(dpb.AgentMessage(shards_persisted=batch))
                else:
                    for m in shards:
                        await call.write(m)
                await until(lambda: svc.commits.by_node.get("node-a") == {0: 10})
                await until(lambda: svc.commits.ignored >= 2)
                call.cancel()
            kinds = [e.WhichOneof("payload") for e in store.events]
            assert "checkpoint_committed" not in kinds

    asyncio.run(go())


def test_a_rank_of_a_launcher_owned_world_belongs_to_its_first_reporter() -> None:
    """A rank of a world no driver laid out is its first reporter's, until that node can no
    longer report (its session closed): then the next reporter's."""

    async def go() -> None:
        async with driver() as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                calls = []
                for node, token in (("node-a", NODE_A), ("node-b", NODE_B)):
                    await register(stub, node, token)
                    c = stub.Session(
                        metadata=md(token, (channel.NODE_KEY, node), (channel.EPOCH_KEY, "1"))
                    )
                    calls.append(c)
                await calls[0].write(_shard(0, 2))
                await until(lambda: "node-a" in svc.commits.by_node)
                await calls[1].write(_shard(0, 2))  # node-a's rank 0, claimed by node-b
                await calls[1].write(_shard(1, 2))
                await until(lambda: "node-b" in svc.commits.by_node)
                assert svc.commits.by_node["node-b"] == {1: 10}
                refused = svc.commits.ignored
                assert refused >= 1  # node-a's rank 0 stayed node-a's
                # node-a's session closes (a SIGKILLed agent): while it is still alive by
                # the miss limit, its replacement's report of rank 0 counts at once.
                calls[0].cancel()
                await until(lambda: not svc.view.nodes["node-a"].connected)
                assert svc.view.nodes["node-a"].alive
                await calls[1].write(_shard(0, 2))
                await until(lambda: svc.commits.by_node["node-b"] == {0: 10, 1: 10})
                assert svc.commits.ignored == refused
                calls[1].cancel()

    asyncio.run(go())


def test_the_audit_trail_names_the_authenticated_principal() -> None:
    async def go() -> None:
        async with driver() as (_svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await register(stub, "node-a", NODE_A)
                await stub.Evict(
                    dpb.EvictRequest(node_id="node-a", reason="test"),
                    metadata=md(OPERATOR, ("x-unbroken-user", "root@somewhere-else")),
                    timeout=5,
                )
            actions = [e.operator_action for e in store.events if e.HasField("operator_action")]
            assert [a.who for a in actions] == ["operator:alice"]

    asyncio.run(go())


def test_an_operators_oversized_evict_reason_is_cut_before_it_is_recorded() -> None:
    """The reason an operator gives rides on OperatorAction.reason, NodeEvicted and the
    agent's Evict: 10,000 characters are recorded as at most 512."""

    async def go() -> None:
        async with driver() as (_svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await register(stub, "node-a", NODE_A)
                await stub.Evict(
                    dpb.EvictRequest(node_id="node-a", reason="x" * 10_000),
                    metadata=md(OPERATOR),
                    timeout=5,
                )
            actions = [e.operator_action for e in store.events if e.HasField("operator_action")]
            assert actions and all(len(a.reason) <= 512 for a in actions), actions
            assert actions[-1].reason == "x" * 512
            evicted = [e.node_evicted for e in store.events if e.HasField("node_evicted")]
            assert all(len(e.reason) <= 1024 for e in evicted), evicted

    asyncio.run(go())


def test_fault_injection_is_off_unless_the_driver_allows_it() -> None:
    async def go() -> None:
        async with driver() as (_svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await register(stub, "node-a", NODE_A)
                n = len(store.events)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.InjectFault(
                        dpb.InjectFaultRequest(node_id="node-a", kind="node-loss"),
                        metadata=md(OPERATOR),
                    )
                assert ei.value.code() == DENIED
                assert "--allow-fault-injection" in (ei.value.details() or "")
                assert len(store.events) == n

    asyncio.run(go())


def test_a_refused_call_is_not_parsed() -> None:
    """A 3 MiB body that is not a protobuf: with a wrong token the answer is
    UNAUTHENTICATED (the body never reached a parser), not a parse error."""

    async def go() -> None:
        async with driver() as (_svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                raw = ch.unary_unary(
                    "/unbroken.driver.v1.Driver/Register",
                    request_serializer=lambda b: b,
                    response_deserializer=lambda b: b,
                )
                junk = b"\xff" * (3 << 20)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await raw(junk, metadata=md("wrong-token-0123456789abc"), timeout=10)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await raw(junk, metadata=md(VIEWER), timeout=10)
                assert ei.value.code() == DENIED
                assert store.events == []

    asyncio.run(go())


def test_commands_carry_the_leader_term() -> None:
    async def go() -> None:
        async with driver() as (svc, _store, addr):
            assert svc.journal is not None
            await svc.journal.record(
                ev.Event(leader_elected=ev.LeaderElected(driver_id="d1", term=7))
            )
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                await register(stub, "node-a", NODE_A)
                call = stub.Session(
                    metadata=md(NODE_A, (channel.NODE_KEY, "node-a"), (channel.EPOCH_KEY, "1"))
                )
                await until(lambda: svc.view.nodes["node-a"].outbox is not None)
                svc.send("node-a", dpb.DriverMessage(pause=dpb.Pause(reason="t")))
                msg = await asyncio.wait_for(call.read(), 5)
                assert msg.term == 7 and msg.HasField("pause")
                call.cancel()

    asyncio.run(go())


class _Stream:
    """The agent side of a session stream: what the agent writes back."""

    def __init__(self) -> None:
        self.sent: list[dpb.AgentMessage] = []

    async def write(self, msg: dpb.AgentMessage) -> None:
        self.sent.append(msg)


def test_an_agent_drops_commands_of_an_older_term() -> None:
    """A deposed leader still holding a stream cannot steer the node."""

    async def go() -> None:
        agent = Agent(AgentConfig(drivers=["127.0.0.1:1"], node_id="node-a"))
        stream = _Stream()
        await agent._command(stream, dpb.DriverMessage(command_id="c1", term=8, pause=dpb.Pause()))
        assert agent.term_seen == 8 and "stale" not in stream.sent[-1].ack.detail
        await agent._command(
            stream, dpb.DriverMessage(command_id="c2", term=7, shutdown=dpb.Shutdown())
        )
        ack = stream.sent[-1].ack
        assert ack.command_id == "c2" and not ack.ok and "stale leader term 7" in ack.detail
        assert not agent.stop.is_set()  # the old term's shutdown was not obeyed
        await agent._command(
            stream, dpb.DriverMessage(command_id="c3", term=9, shutdown=dpb.Shutdown())
        )
        assert agent.stop.is_set() and agent.term_seen == 9  # the current term's is

    asyncio.run(go())


def test_mtls_principals_name_the_node_and_the_operator(tmp_path: Path) -> None:
    certs.make_ca(tmp_path)
    server = certs.issue(tmp_path, "driver:main")
    node_a = certs.issue(tmp_path, "node:node-a")
    alice = certs.issue(tmp_path, "operator:alice")
    # a certificate our CA signed that names no principal (as issued before roles)
    plain = certs.issue(tmp_path, "viewer:x")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    ca_key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key(plain[1].read_bytes(), None)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agent")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(ca.not_valid_before_utc)
        .not_valid_after(ca.not_valid_after_utc)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    plain[0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def creds(pair: tuple[Path, Path]) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            (tmp_path / "ca.pem").read_bytes(), pair[1].read_bytes(), pair[0].read_bytes()
        )

    async def go() -> None:
        tls = TlsConfig(cert=str(server[0]), key=str(server[1]), ca=str(tmp_path / "ca.pem"))
        async with driver(tls=tls, tokens=None) as (_svc, store, addr):
            async with grpc.aio.secure_channel(addr, creds(node_a)) as ch:
                stub = dgrpc.DriverStub(ch)
                ok = await stub.Register(dpb.RegisterRequest(node_id="node-a", epoch=1))
                assert ok.job_id == "job"
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.Register(dpb.RegisterRequest(node_id="node-b", epoch=1))
                assert ei.value.code() == DENIED
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.Evict(dpb.EvictRequest(node_id="node-a"))
                assert ei.value.code() == DENIED
            async with grpc.aio.secure_channel(addr, creds(plain)) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await dgrpc.DriverStub(ch).GetStatus(dpb.GetStatusRequest())
                assert ei.value.code() == DENIED and "names no principal" in str(ei.value.details())
            async with grpc.aio.secure_channel(addr, creds(alice)) as ch:
                await dgrpc.DriverStub(ch).Evict(
                    dpb.EvictRequest(node_id="node-a", reason="t"),
                    metadata=(("x-unbroken-user", "mallory"),),
                )
            who = [e.operator_action.who for e in store.events if e.HasField("operator_action")]
            assert who == ["operator:alice"]

    asyncio.run(go())


def test_a_driver_beyond_loopback_needs_credentials_or_insecure(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--insecure"):
        DriverConfig(listen="0.0.0.0:50051")
    with pytest.raises(ValueError, match="--dashboard-host"):
        DriverConfig(listen="127.0.0.1:0", dashboard_port=0, dashboard_host="0.0.0.0")
    DriverConfig(listen="0.0.0.0:50051", insecure=True)
    DriverConfig(listen="0.0.0.0:50051", service=ServiceConfig(tokens=RoleTokens(TOKENS)))
    assert DriverConfig().listen.startswith("127.0.0.1:")
    assert DriverConfig().dashboard_host == "127.0.0.1"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "unbroken.cli", "driver", "--event-log", "memory"]
    out = subprocess.run(
        [*cli, "--listen", "0.0.0.0:0"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2 and "--insecure" in out.stderr, out.stderr
    out = subprocess.run(
        [*cli, "--token", "x" * 20], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2 and "visible to every local user" in out.stderr, out.stderr


def test_role_tokens_are_validated() -> None:
    with pytest.raises(ValueError, match="shorter than 16"):
        RoleTokens({"node": ["short"]})
    with pytest.raises(ValueError, match="roles node and operator"):
        RoleTokens({"node": [NODE_A], "operator": [NODE_A]})
    with pytest.raises(ValueError, match="unknown role"):
        RoleTokens({"admin": [NODE_A]})
    t = RoleTokens({"node": [f"{NODE_A} node-a", "# a comment", "", NODE_B]})
    assert str(t.principal(NODE_A.encode())) == "node:node-a"
    assert str(t.principal(NODE_B.encode())) == "node:*"
    assert t.principal(b"nope") is None


def test_list_checkpoints_never_opens_a_uri_outside_the_persist_root() -> None:
    """An agent-reported `ftp://` URI made the driver connect to an attacker's port."""
    assert outside_roots("/data/ckpt/step-1", ()) == ""
    assert "not a local path" in outside_roots("ftp://10.0.0.1:21/x", ())
    assert outside_roots("s3://bucket/run/step-1", ("s3://bucket/run",)) == ""
    assert "outside" in outside_roots("s3://bucket/other/step-1", ("s3://bucket/run",))
    assert "outside" in outside_roots("/etc/passwd", ("/data/ckpt",))
    assert "'..'" in outside_roots("s3://bucket/run/../other", ("s3://bucket/run",))

    async def go() -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        try:
            async with driver() as (svc, _store, addr):
                assert svc.journal is not None
                await svc.journal.record(
                    ev.Event(
                        checkpoint_committed=ev.CheckpointCommitted(
                            step=3, uri=f"ftp://127.0.0.1:{port}/x", ranks=1
                        )
                    )
                )
                async with grpc.aio.insecure_channel(addr) as ch:
                    r = await dgrpc.DriverStub(ch).ListCheckpoints(
                        dpb.ListCheckpointsRequest(), metadata=md(VIEWER), timeout=10
                    )
                assert "not a local path" in r.checkpoints[0].shards_error
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
        finally:
            listener.close()

    asyncio.run(go())


def test_the_cli_prints_event_text_literally(tmp_path: Path) -> None:
    """`[/data/shard-17]` in a log line made `unbroken events` exit 1 (rich markup)."""

    async def go() -> None:
        async with driver(tokens=None) as (svc, _store, addr):
            assert svc.journal is not None
            line = "cannot open [/data/shard-17] [bold red]x[/]"
            await svc.journal.record(
                ev.Event(log_alert=ev.LogAlert(node_id="n0", keyword="error", line=line))
            )
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "unbroken.cli", "events", "--driver", addr,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "300"},
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 0, err.decode()
            assert "[/data/shard-17]" in out.decode() and "[bold red]" in out.decode()

    asyncio.run(go())


def test_an_operator_clears_a_drained_node_through_the_driver() -> None:
    """ClearNode: refused without a scheduler; with one (the in-memory pool) the node is
    resumed and both the operator's action and the scheduler's answer are in the log."""

    async def go() -> None:
        async with driver() as (svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                req = dpb.ClearNodeRequest(node_id="n2")
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.ClearNode(req, metadata=md(OPERATOR))
                assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "without a cluster scheduler" in (ei.value.details() or "")
                pool = InMemoryScheduler.of(["n1", "n2"], ["n3"])
                await pool.drain("n2", "unbroken: i1 node n2 lost")
                bridge = SchedulerBridge(pool, svc.journal, BridgeConfig(poll_s=0))
                bridge.start()
                svc.leadership.bridge = bridge  # as a term does (driver/term.py)
                try:
                    for token in (VIEWER, LAUNCHER, NODE_A):
                        assert await status_of(stub.ClearNode(req, metadata=md(token))) == DENIED
                    resp = await stub.ClearNode(req, metadata=md(OPERATOR))
                    assert resp.scheduler == "memory" and resp.answer == "n2 idle", resp
                    assert pool.calls[-1] == ("resume", "n2")
                    # not drained any more: the scheduler's refusal is the error
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await stub.ClearNode(req, metadata=md(OPERATOR))
                    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "not drained or down" in (ei.value.details() or "")
                finally:
                    await bridge.close()
                events = list(store.events)
                ops = [e.operator_action for e in events if e.HasField("operator_action")]
                assert [(o.action, o.target, o.who) for o in ops] == [
                    ("clear", "n2", "operator:alice")
                ] * 2, ops
                calls = [e for e in events if e.HasField("scheduler_call")]
                assert [(c.scheduler_call.action, c.scheduler_call.ok) for c in calls] == [
                    ("resume", True),
                    ("resume", False),
                ]
                first = next(e for e in events if e.HasField("operator_action"))
                assert calls[0].seq == resp.seq and calls[0].cause == first.event_id

    asyncio.run(go())
