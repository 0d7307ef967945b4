"""Security of the driver's API: mTLS and the bearer token.

A client without valid credentials is refused (UNAUTHENTICATED for a missing or wrong
token; a failed TLS handshake for a missing or foreign client certificate) and changes
nothing: no node in the live view, no event in the log. Certificates are made here with
the `cryptography` package.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.security import TlsConfig
from unbroken.driver.service import DriverService, ServiceConfig, build_server
from unbroken.proto import channel
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration
TOKEN = "s3cret-token-0123456789"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(tmp: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (tmp / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def make_leaf(
    tmp: Path, name: str, ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], *, server: bool
) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca[1].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = b.sign(ca[0], hashes.SHA256())
    crt, k = tmp / f"{name}.crt", tmp / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(crt), str(k)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    ca = make_ca(tmp_path, "ca")
    other = make_ca(tmp_path, "other-ca")
    scrt, skey = make_leaf(tmp_path, "driver", ca, server=True)
    ccrt, ckey = make_leaf(tmp_path, "agent", ca, server=False)
    fcrt, fkey = make_leaf(tmp_path, "foreign", other, server=False)
    return {
        "ca": str(tmp_path / "ca.pem"),
        "scrt": scrt,
        "skey": skey,
        "ccrt": ccrt,
        "ckey": ckey,
        "fcrt": fcrt,
        "fkey": fkey,
    }


@contextlib.asynccontextmanager
async def driver(cfg: ServiceConfig) -> AsyncIterator[tuple[DriverService, InMemoryStore, str]]:
    svc = DriverService(cfg, driver_id="d1", job_id="job")
    store = InMemoryStore()
    svc.lead(InMemoryEventLog(store, "job", store.elect("d1")), "")
    svc.start()
    server, port, _ = await build_server(svc, "127.0.0.1:0")
    try:
        yield svc, store, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
        await svc.close()


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
        async with driver(ServiceConfig(token=TOKEN)) as (svc, store, addr):
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
        async with driver(ServiceConfig(tls=tls, token=TOKEN)) as (svc, _store, addr):
            token_file = tmp_path / "token"
            token_file.write_text(TOKEN + "\n")
            args = [
                sys.executable,
                "-m",
                "unbroken.driver.cli",
                "agent",
                "--driver",
                addr,
                "--node-id",
                "secure",
                "--tls-cert",
                pki["ccrt"],
                "--tls-key",
                pki["ckey"],
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
                [*args[:-2], "--token", "not-the-token-at-all", "--node-id", "intruder"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env={**os.environ},
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
