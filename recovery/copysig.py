"""The origin node's signature on a buddy replica, so the buddy that holds it cannot forge it.

A buddy keeps node X's newest copies and serves them to whoever replaces X. Its stream is
authenticated (recovery/replica.py), but that proves only who *sent* the bytes, not who
*made* them: a compromised buddy could serve X's replacement weights of its own making,
with a valid xxh3 checksum (a checksum, not a signature). So the sender signs each copy
it sends, the buddy keeps the signature beside the copy (`slot-N.origin`) and sends it
along on a fetch, and both the buddy on receipt and the fetcher (the restorer) refuse a
copy whose signature does not verify for the node it claims to be from.

What is signed: the node id, the SHA-256 of the manifest's bytes and the SHA-256 of the
data as streamed (the sender hashes while it sends; a slot overwritten meanwhile fails
the buddy's checksum anyway).

- With mutual TLS the signature is made with the node's certificate key (ECDSA or RSA,
  SHA-256), and the record carries that certificate: the verifier checks that the CA it
  trusts issued it directly, that it is valid now, that its SAN URI is `node:X`, and the
  signature. Only the holder of X's key can sign a copy of X.
- Without TLS the record carries an HMAC-SHA256 under the job's replica key, which proves
  only that some holder of the job's key made the copy, and, when the node has a key of its
  own (recovery/nodekey.py, from its node token), an Ed25519 signature with it: a verifier
  that was handed the node's public key (by the driver, StartWorkers) requires that one,
  so no other node of the job can sign a copy as this node.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from unbroken.recovery import nodekey
from unbroken.recovery.nodekey import NodeKey

DOMAIN = b"unbroken-replica-copy-v1\0"
MAX_RECORD = 3000  # bytes of one JSON record (a certificate and a signature)


class BadSignature(ValueError):
    """A copy whose origin signature is missing, malformed or does not verify."""


def message(node: str, manifest_sha256: bytes, data_sha256: bytes) -> bytes:
    """The bytes signed for one copy of `node`."""
    raw = node.encode()
    return DOMAIN + len(raw).to_bytes(2, "big") + raw + manifest_sha256 + data_sha256


@dataclass(frozen=True, slots=True)
class CopySigner:
    """Signs this node's copies and verifies other nodes': a certificate key and the CA
    (`tls`), or the job's replica key (`keyed`)."""

    key: bytes | None = None  # the job's replica key (keyed mode)
    cert_pem: bytes = b""  # this node's certificate (TLS mode)
    private_key: Any = None  # its key (ec or rsa private key)
    ca: x509.Certificate | None = None  # the CA a signer's certificate must be issued by
    node_key: NodeKey | None = None  # keyed mode: this node's own key (signs its copies too)

    @classmethod
    def tls(cls, cert: str, key: str, ca: str) -> CopySigner:
        pem = Path(cert).read_bytes()
        # the first certificate of the file is the node's own
        own = x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.PEM)
        priv = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
        return cls(
            cert_pem=own,
            private_key=priv,
            ca=x509.load_pem_x509_certificate(Path(ca).read_bytes()),
        )

    @classmethod
    def keyed(cls, key: bytes, node_key: NodeKey | None = None) -> CopySigner:
        return cls(key=key, node_key=node_key)

    def sign(self, node: str, manifest_sha256: bytes, data_sha256: bytes) -> dict[str, str]:
        """The origin record of a copy of `node` (this node's own copy)."""
        msg = message(node, manifest_sha256, data_sha256)
        rec = {"node": node, "data_sha256": data_sha256.hex()}
        if self.private_key is not None:
            if isinstance(self.private_key, ec.EllipticCurvePrivateKey):
                sig = self.private_key.sign(msg, ec.ECDSA(hashes.SHA256()))
            elif isinstance(self.private_key, rsa.RSAPrivateKey):
                sig = self.private_key.sign(msg, padding.PKCS1v15(), hashes.SHA256())
            else:
                raise BadSignature(
                    f"cannot sign replica copies with a {type(self.private_key).__name__} "
                    "key: use an ECDSA or RSA node certificate"
                )
            return {**rec, "sig": sig.hex(), "cert": self.cert_pem.decode()}
        assert self.key is not None
        rec["mac"] = hmac.new(self.key, msg, hashlib.sha256).hexdigest()
        if self.node_key is not None and self.node_key.node == node:
            rec["ed25519"] = self.node_key.sign("copy", msg).hex()
        return rec

    def verify(
        self,
        node: str,
        manifest_sha256: bytes,
        data_sha256: bytes,
        rec: dict[str, Any],
        pubkey: bytes = b"",
    ) -> None:
        """Check that `rec` signs this copy (these hashes) of `node` (without TLS, with
        `node`'s own key when its public half `pubkey` is known, else the job key's MAC).

        Raises:
            BadSignature: it does not, saying why.
        """
        if not isinstance(rec, dict) or rec.get("node") != node:
            raise BadSignature(
                f"the copy carries no origin signature of node {node!r} (its record names "
                f"{rec.get('node') if isinstance(rec, dict) else None!r})"
            )
        if rec.get("data_sha256") != data_sha256.hex():
            raise BadSignature(f"the data of node {node!r}'s copy is not the data it signed")
        msg = message(node, manifest_sha256, data_sha256)
        if self.ca is None and pubkey:
            try:
                sig = bytes.fromhex(str(rec.get("ed25519", "")))
            except ValueError:
                sig = b""
            if not nodekey.verify(pubkey, "copy", msg, sig):
                raise BadSignature(
                    f"node {node!r}'s copy is not signed with node {node!r}'s own key (the "
                    "one it registered with the driver): made by another holder of the job key"
                )
            return
        if self.ca is None:
            assert self.key is not None
            want = hmac.new(self.key, msg, hashlib.sha256).hexdigest()
            if not hmac.compare_digest(want, str(rec.get("mac", ""))):
                raise BadSignature(f"node {node!r}'s copy: its MAC does not verify")
            return
        try:
            cert = x509.load_pem_x509_certificate(str(rec.get("cert", "")).encode())
            sig = bytes.fromhex(str(rec.get("sig", "")))
        except ValueError as e:
            raise BadSignature(f"node {node!r}'s copy: malformed origin record ({e})") from None
        _check_cert(cert, self.ca, node)
        pub = cert.public_key()
        try:
            if isinstance(pub, ec.EllipticCurvePublicKey):
                pub.verify(sig, msg, ec.ECDSA(hashes.SHA256()))
            elif isinstance(pub, rsa.RSAPublicKey):
                pub.verify(sig, msg, padding.PKCS1v15(), hashes.SHA256())
            else:
                raise BadSignature(f"node {node!r}'s copy: unsupported key type")
        except InvalidSignature:
            raise BadSignature(f"node {node!r}'s copy: its signature does not verify") from None


def _check_cert(cert: x509.Certificate, ca: x509.Certificate, node: str) -> None:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise BadSignature(
            f"node {node!r}'s copy is signed by a certificate the CA did not issue"
        ) from None
    now = datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise BadSignature(f"node {node!r}'s copy is signed by an expired certificate")
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    if f"node:{node}" not in uris:
        who = ", ".join(uris) or "a certificate with no principal"
        raise BadSignature(f"node {node!r}'s copy is signed by {who}, not node:{node}")


def record_path(rank_dir: Path, slot: int) -> Path:
    """Where a buddy keeps the origin record of the copy in `slot`."""
    return rank_dir / f"slot-{slot}.origin"


def dump(rec: dict[str, str]) -> bytes:
    return json.dumps(rec, sort_keys=True).encode()


def load(raw: bytes) -> dict[str, Any]:
    """A stored or received record; {} when it is not one (then it verifies for nobody)."""
    if len(raw) > MAX_RECORD:
        return {}
    try:
        rec = json.loads(raw)
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}
