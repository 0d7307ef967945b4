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
  no reordering, no tampering). That proves only that the peer holds the job's key. So
  each node also signs with a key of its own (recovery/nodekey.py, from its node token;
  the driver hands its peers the public half): a sender's header carries its signature of
  the stream's nonces (a buddy takes X's copies only from X, and only from the node the
  driver paired with it), and the buddy's answer its own (a sender knows that the server
  that stored its copy is the buddy it was given). A GET is still served to any holder of
  the job key (the fetcher checks each copy's origin; without TLS nothing on the wire is
  secret anyway), and a node with no token has no key (its peers fall back to the MAC).
- A server with neither answers every request with an error (`ReplicaAuth.none()`).
- Every copy carries its origin node's signature (`copysig`: its certificate key with TLS,
  its node key without, else the job key), made by the sender, checked by the buddy on
  receipt, kept beside the copy and checked again by whoever fetches it: a buddy cannot
  serve a copy of its own making as another node's. A sender given its buddy's node id
  sends only to a server that proves it is that node (its certificate, or its node key's
  signature), and a buddy the driver paired takes copies only of the node paired with it
  (`ReplicaServer.senders`).
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from unbroken.recovery import copysig
from unbroken.recovery.nodekey import PUBLIC_BYTES, NodeKey

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
    # keyed mode: this node's own signing key, and its peers' public keys as the driver
    # handed them out (node id -> raw Ed25519 key; a node not here is checked by the MAC)
    node_key: NodeKey | None = None
    peers: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.signer is None and self.key is not None:
            self.signer = copysig.CopySigner.keyed(self.key, self.node_key)
        if self.node_key is not None:
            self.peers[self.node_key.node] = self.node_key.public  # its own copies come back

    def pubkey(self, node: str) -> bytes:
        """`node`'s replica key as the driver handed it out (keyed mode; b"": none)."""
        return self.peers.get(node, b"") if self.server_ssl is None else b""

    def learn(self, node: str, public: bytes) -> None:
        """Remember `node`'s public key (from StartWorkers); an empty one changes nothing:
        a node keeps its key across restarts, and the driver sends none when it knows none."""
        if node and len(public) == PUBLIC_BYTES:
            self.peers[node] = bytes(public)

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
    def keyed(cls, key: bytes, node_key: NodeKey | None = None) -> ReplicaAuth:
        if len(key) < 16:
            raise ValueError("the replica key must be at least 16 bytes")
        return cls(key=key, node_key=node_key)

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
