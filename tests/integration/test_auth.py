"""Security of the driver's API: mTLS and role tokens.

A client without valid credentials is refused (UNAUTHENTICATED for a missing or wrong
token; a failed TLS handshake for a missing or foreign client certificate) and changes
nothing: no node in the live view, no event in the log. Certificates are made here with
the `cryptography` package.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.inproc import driver
from unbroken.common import channel
from unbroken.common.tls import TlsConfig
from unbroken.driver import certs
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration
TOKEN = "s3cret-token-0123456789"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    """A CA, the driver's certificate, two nodes' and a foreign CA's client certificate."""
    certs.make_ca(tmp_path)
    other = tmp_path / "other"
    certs.make_ca(other)
    scrt, skey = certs.issue(tmp_path, "driver:main")
    ccrt, ckey = certs.issue(tmp_path, "node:good")
    secrt, sekey = certs.issue(tmp_path, "node:secure")
    fcrt, fkey = certs.issue(other, "node:foreign")
    return {
        "ca": str(tmp_path / "ca.pem"),
        **{k: str(v) for k, v in {"scrt": scrt, "skey": skey, "ccrt": ccrt, "ckey": ckey}.items()},
        **{k: str(v) for k, v in {"secrt": secrt, "sekey": sekey}.items()},
        "fcrt": str(fcrt),
        "fkey": str(fkey),
    }


async def register(
    ch: grpc.aio.Channel, node: str, md: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    try:
        await dgrpc.DriverStub(ch).Register(
            dpb.RegisterRequest(node_id=node, epoch=1), timeout=5, metadata=md
        )
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_bearer_token() -> None:
    async def go() -> None:
        async with driver(ServiceConfig(tokens=RoleTokens({"node": [f"{TOKEN} d"]}))) as (
            svc,
            store,
            addr,
        ):
            async with grpc.aio.insecure_channel(addr) as ch:
                U = grpc.StatusCode.UNAUTHENTICATED
                assert await register(ch, "a") == U
                assert await register(ch, "b", (("authorization", "Bearer wrong"),)) == U
                assert await register(ch, "c", (("authorization", TOKEN),)) == U
                call = dgrpc.DriverStub(ch).Session(
                    metadata=((channel.NODE_KEY, "a"), (channel.EPOCH_KEY, "1"))
                )
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await call.read()
                assert ei.value.code() == U and "bearer token" in (ei.value.details() or "")
                assert svc.view.nodes == {} and store.events == []
                # health stays open for probes; the right token works
                h = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert h.status == health_pb2.HealthCheckResponse.SERVING
                ok = await register(ch, "d", (("authorization", f"Bearer {TOKEN}"),))
                assert ok == grpc.StatusCode.OK and list(svc.view.nodes) == ["d"]

    asyncio.run(go())


def test_mutual_tls(pki: dict[str, str]) -> None:
    def creds(crt: str | None, key: str | None) -> grpc.ChannelCredentials:
        ca = Path(pki["ca"]).read_bytes()
        if crt is None or key is None:
            return grpc.ssl_channel_credentials(ca)
        return grpc.ssl_channel_credentials(ca, Path(key).read_bytes(), Path(crt).read_bytes())

    async def go() -> None:
        tls = TlsConfig(cert=pki["scrt"], key=pki["skey"], ca=pki["ca"])
        async with driver(ServiceConfig(tls=tls)) as (svc, store, addr):
            for name, c in (
                ("no-cert", creds(None, None)),
                ("foreign", creds(pki["fcrt"], pki["fkey"])),
            ):
                async with grpc.aio.secure_channel(addr, c) as ch:
                    assert await register(ch, name) == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(addr) as ch:
                assert await register(ch, "plain") == grpc.StatusCode.UNAVAILABLE
            assert svc.view.nodes == {} and store.events == []
            async with grpc.aio.secure_channel(addr, creds(pki["ccrt"], pki["ckey"])) as ch:
                assert await register(ch, "good") == grpc.StatusCode.OK
            assert list(svc.view.nodes) == ["good"]

    asyncio.run(go())


def test_agent_process_with_mtls_and_token(pki: dict[str, str], tmp_path: Path) -> None:
    """The real agent's flags: it registers and heartbeats through mTLS + token."""

    async def go() -> None:
        tls = TlsConfig(cert=pki["scrt"], key=pki["skey"], ca=pki["ca"])
        async with driver(ServiceConfig(tls=tls, tokens=RoleTokens({"node": [TOKEN]}))) as (
            svc,
            _store,
            addr,
        ):
            token_file = tmp_path / "token"
            token_file.write_text(TOKEN + "\n")
            token_file.chmod(0o600)  # token files must be private
            args = [
                sys.executable,
                "-m",
                "unbroken.cli.main",
                "agent",
                "--driver",
                addr,
                "--node-id",
                "secure",
                "--tls-cert",
                pki["secrt"],
                "--tls-key",
                pki["sekey"],
                "--tls-ca",
                pki["ca"],
                "--token-file",
                str(token_file),
            ]
            good = subprocess.Popen(
                args,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            bad = subprocess.Popen(
                [*args[:-2], "--node-id", "intruder"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env={**os.environ, "UNBROKEN_TOKEN": "not-the-token-at-all"},
            )
            try:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    s = svc.view.nodes.get("secure")
                    if s is not None and s.heartbeats >= 3:
                        break
                    await asyncio.sleep(0.1)
                assert svc.view.nodes["secure"].heartbeats >= 3
                # the intruder gives up with a clear message and exit code 2
                while bad.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert bad.returncode == 2
                assert bad.stderr is not None and b"refused our credentials" in bad.stderr.read()
                assert "intruder" not in svc.view.nodes
            finally:
                for p in (good, bad):
                    if p.poll() is None:
                        p.kill()
                    p.wait()

    asyncio.run(go())
