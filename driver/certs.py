"""`unbroken certs`: a small CA for a secured deployment, and the principal in a certificate.

A principal names who is calling: `node:<id>`, `operator:<name>`, `launcher:<name>` or
`driver:<name>`. It travels in a certificate's subjectAltName as a URI (`node:node-a` is a
valid URI with scheme `node`), so one mTLS handshake both authenticates the peer and says
which role it has. `principal_of_san` reads it back on the server side, from what gRPC
(`auth_context()["x509_subject_alternative_name"]`) or Python's ssl (`getpeercert()`) report.

    unbroken certs ca --dir pki                      # pki/ca.pem, pki/ca.key (0600)
    unbroken certs issue --dir pki driver:main --host driver.example --host 10.0.0.5
    unbroken certs issue --dir pki node:gpu-017      # pki/node-gpu-017.{crt,key}, no host
    unbroken certs issue --dir pki operator:alice

Keys are ECDSA P-256; files are written 0600 (keys) and 0644 (certificates). For a
production PKI, issue the same SAN URIs from your own CA (cert-manager, Vault, step-ca);
nothing here is special beyond the URI.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from unbroken.common.principal import (  # noqa: F401  (re-exported: callers import them here)
    ROLES,
    SERVING_ROLES,
    parse_principal,
    principal_of_peercert,
    principal_of_san,
)


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(directory: str | Path, *, name: str = "unbroken-ca", days: int = 3650) -> Path:
    """Write `ca.pem` and `ca.key` (0600) into `directory`; returns the CA certificate path."""
    d = Path(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write(d / "ca.key", _key_pem(key), 0o600)
    _write(d / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return d / "ca.pem"


def issue(
    directory: str | Path,
    principal: str,
    *,
    hosts: Sequence[str] | None = None,
    days: int = 365,
) -> tuple[Path, Path]:
    """Issue a certificate for `principal`, signed by the CA in `directory`.

    The certificate carries the principal as a SAN URI and only what its role needs:
    a driver's also `hosts` as DNS/IP SANs (default localhost and 127.0.0.1) and both
    serverAuth and clientAuth (standbys call the leader); a node's serverAuth for its
    replica server and relay (peers check its principal, not a host name) and host names
    only when given; an operator's, launcher's or viewer's clientAuth alone and no host
    name, so none of them can serve as a driver. Returns (certificate, key) paths, named
    after the principal.

    Raises:
        ValueError: a bad principal, no CA, or host names for a role that never serves.
    """
    role, name = parse_principal(principal)
    if hosts is None:
        hosts = ("localhost", "127.0.0.1") if role == "driver" else ()
    if hosts and role not in SERVING_ROLES:
        raise ValueError(
            f"a {role} certificate serves nothing: --host is for driver (and node) "
            "certificates only (a host name would let it pass as a server)"
        )
    d = Path(directory)
    try:
        ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    except FileNotFoundError as e:
        raise ValueError(f"no CA in {d}: run `unbroken certs ca --dir {d}` first") from e
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(principal)]
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, principal)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                if role in SERVING_ROLES
                else [ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    stem = f"{role}-{name}"
    crt, k = d / f"{stem}.crt", d / f"{stem}.key"
    _write(k, _key_pem(key), 0o600)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return crt, k


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken certs`."""
    sub = parser.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    ca = sub.add_parser("ca", help="create a CA (ca.pem, ca.key) in --dir")
    ca.add_argument("--dir", required=True, help="folder for the CA files")
    ca.add_argument("--days", type=int, default=3650)
    iss = sub.add_parser("issue", help="issue a certificate for ROLE:NAME signed by the CA")
    iss.add_argument(
        "principal", help="node:ID, operator:NAME, launcher:NAME, driver:NAME, viewer:NAME"
    )
    iss.add_argument("--dir", required=True, help="folder holding ca.pem and ca.key")
    iss.add_argument(
        "--host",
        action="append",
        default=None,
        help="a DNS name or IP the holder serves on (repeat; driver certificates only, "
        "default localhost and 127.0.0.1; a node's only for a relay)",
    )
    iss.add_argument("--days", type=int, default=365)


def run(args: argparse.Namespace) -> int:
    """`unbroken certs ca|issue`."""
    try:
        if args.certs_command == "ca":
            if (Path(args.dir) / "ca.key").exists():
                print(
                    f"unbroken certs: {args.dir}/ca.key exists; refusing to overwrite a CA",
                    file=sys.stderr,
                )
                return 2
            print(make_ca(args.dir, days=args.days))
            return 0
        crt, key = issue(args.dir, args.principal, hosts=args.host, days=args.days)
        print(f"{crt}\n{key}")
        return 0
    except (ValueError, OSError) as e:
        print(f"unbroken certs: {e}", file=sys.stderr)
        return 2
