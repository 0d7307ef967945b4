"""Who may talk to a node's buddy, and the limits of the replica transfer.

**Who may talk to the buddy** (`ReplicaAuth`; once anyone could GET a node's weights,
PUT a forged replica, or make the agent allocate 64 GiB with one header):

- With TLS (the agent's --tls-cert/--tls-key/--tls-ca) the stream is mutual TLS and the
  peer's principal is the `node:<id>` URI of its certificate. A PUT for node X is accepted
  only from `node:X`. A GET of X's copies is served only to `node:X` (the node restarted)
  or to a principal the buddy's grants file names for X (`{"X": ["node:X2"]}`, re-read on
  every GET): whoever can write that file on the buddy (the operator, `unbroken up`) names
  the replacement. The grant proves the operator's decision, nothing about the replacement.
- Without TLS, every line and every data chunk carries an HMAC-SHA256 under the job's
  replica key, bound to both sides' nonces and a per-direction sequence number (no replay,
  no reordering, no tampering). That proves only that the peer holds the job's key: any
  agent of the job may then PUT or GET any node's copies. Per-node rules need TLS.
- A server with neither answers every request with an error (`ReplicaAuth.none()`).
- Every copy carries its origin node's signature (`copysig`: its certificate key with TLS,
  the job key without), made by the sender, checked by the buddy on receipt, kept beside
  the copy and checked again by whoever fetches it: a buddy cannot serve a copy of its
  own making as another node's. A sender given its buddy's node id sends only to a
  server whose certificate is that node, and a buddy the driver paired takes copies only
  of the node paired with it (`ReplicaServer.senders`).
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from unbroken.recovery import copysig

log = structlog.get_logger(__name__)

KEY_ENV = "UNBROKEN_REPLICA_KEY"


def node_of_peercert(cert: dict[str, Any] | None) -> str | None:
    """The node id of a `node:<id>` SAN URI in a peer certificate (`ssl` getpeercert()).

    The same URI `unbroken certs issue node:<id>` writes (driver/certs.py); recovery/ does
    not import driver/, so the one rule is restated here.
    """
    for kind, value in (cert or {}).get("subjectAltName", ()):
        if kind == "URI" and isinstance(value, str) and value.startswith("node:"):
            return value[len("node:") :] or None
    return None


@dataclass(kw_only=True, slots=True)
class ReplicaAuth:
    """How the replica stream is authenticated: mTLS contexts, or a job key, or nothing.

    Build with `tls(cert, key, ca)`, `keyed(key)` or `none()`; `grants_file` names, per
    lost node, the principals that may GET its copies besides the node itself (TLS only).
    """

    server_ssl: ssl.SSLContext | None = None
    client_ssl: ssl.SSLContext | None = None
    key: bytes | None = None
    grants_file: str | None = None
    # signs this node's copies and checks the origin of others' (recovery/copysig.py)
    signer: copysig.CopySigner | None = None

    def __post_init__(self) -> None:
        if self.signer is None and self.key is not None:
            self.signer = copysig.CopySigner.keyed(self.key)

    @classmethod
    def tls(cls, cert: str, key: str, ca: str, *, grants_file: str | None = None) -> ReplicaAuth:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
        server.load_cert_chain(cert, key)
        server.verify_mode = ssl.CERT_REQUIRED
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        client.load_cert_chain(cert, key)
        client.check_hostname = False  # the peer is checked by its node principal instead
        client.verify_mode = ssl.CERT_REQUIRED
        return cls(
            server_ssl=server,
            client_ssl=client,
            grants_file=grants_file,
            signer=copysig.CopySigner.tls(cert, key, ca),
        )

    @classmethod
    def keyed(cls, key: bytes) -> ReplicaAuth:
        if len(key) < 16:
            raise ValueError("the replica key must be at least 16 bytes")
        return cls(key=key)

    @classmethod
    def none(cls) -> ReplicaAuth:
        return cls()

    @property
    def enabled(self) -> bool:
        return self.server_ssl is not None or self.key is not None

    def grants(self, node: str) -> set[str]:
        """Principals the grants file allows to GET `node`'s copies (re-read each time)."""
        if not self.grants_file:
            return set()
        try:
            data = json.loads(Path(self.grants_file).read_text())
        except (OSError, ValueError) as e:
            log.warning("replica.grants_unreadable", file=self.grants_file, error=str(e))
            return set()
        got = data.get(node, []) if isinstance(data, dict) else []
        return {g for g in got if isinstance(g, str)}


@dataclass(kw_only=True, slots=True)
class ReplicaConfig:
    """Limits and credentials of the replica transfer."""

    timeout_s: float = 60.0  # whole transfer of one copy, either side
    max_copy_bytes: int = 64 << 30
    max_connections: int = 8  # concurrent streams a server serves; more are refused
    # A connection must authenticate (TLS handshake and header) within this: until then it
    # holds no stream slot, and past `max_pending` such connections the oldest is closed
    header_timeout_s: float = 5.0
    max_pending: int = 64
    headroom_bytes: int = 64 << 20  # left free on the tmpfs by a received copy
    auth: ReplicaAuth = field(default_factory=ReplicaAuth.none)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"ReplicaConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_copy_bytes <= 0:
            raise ValueError(f"ReplicaConfig.max_copy_bytes must be > 0, got {self.max_copy_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not self.header_timeout_s > 0:
            raise ValueError(
                f"ReplicaConfig.header_timeout_s must be > 0, got {self.header_timeout_s}"
            )
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
