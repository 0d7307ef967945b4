"""A node's own replica signing key, for buddy streams without TLS.

Without mutual TLS the replica stream is keyed by the job's replica key, the same on every
node: a MAC under it proves only that some node of the job made a line, so any node could
pose as another's buddy, store copies under another node's name, or sign a copy as another
node. Each node therefore also holds an Ed25519 key of its own:

- derived from the node's credential, its bound node token (HKDF-SHA256, the node id in
  the derivation), so it needs no file of its own and is the same after the agent
  restarts: copies a buddy holds stay verifiable across a restart of their node;
- its public key goes to the driver in the node's own authenticated Register (never
  through a relay), is recorded with the node (NodeRecord.replica_pubkey) and handed out
  in StartWorkers to the nodes that must check it: the sender's buddy, the node whose
  copies a replica server takes, and a replacement that fetches a lost node's copies.

What it signs (each with its own domain, so no signature stands for another):
- `copy`: a copy's origin (recovery/copysig.py), so the buddy that holds it cannot forge it;
- `client`: the stream's two nonces and the node a sender speaks for, so a replica server
  takes copies of node X only from X, in that stream (no replay);
- `server`: the nonces and the server's node, in its answer, so a sender knows that the
  buddy that stored its copy is the node the driver paired it with.

A node with no token (a job with no authentication) has no key: its peers fall back to the
job key's MAC for it, which is all the key can prove. An unbound node token shared by every
node gives every node every key (SECURITY.md: bind node tokens).
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PUBLIC_BYTES = 32  # an Ed25519 public key, raw
SALT = b"unbroken-replica-node-key-v1"
DOMAINS = {
    "copy": b"unbroken-replica-copy-ed25519-v1\0",
    "client": b"unbroken-replica-client-v1\0",
    "server": b"unbroken-replica-server-v1\0",
}


class NodeKey:
    """One node's signing key (its private half) and the node it speaks for."""

    def __init__(self, private: Ed25519PrivateKey, node: str) -> None:
        self._private = private
        self.node = node
        self.public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def derive(cls, secret: str | bytes, node: str) -> NodeKey:
        """The key of `node` from its credential `secret` (its node token)."""
        raw = secret.encode() if isinstance(secret, str) else secret
        if not raw or not node:
            raise ValueError("a node key needs the node's token and its node id")
        seed = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=SALT, info=b"node\0" + node.encode()
        ).derive(raw)
        return cls(Ed25519PrivateKey.from_private_bytes(seed), node)

    def sign(self, domain: str, payload: bytes) -> bytes:
        return self._private.sign(DOMAINS[domain] + payload)

    def sign_stream(self, side: str, snonce: bytes, cnonce: bytes) -> str:
        """This node's `side` ("client" or "server") signature of one stream, in hex."""
        return self.sign(side, stream_payload(snonce, cnonce, self.node)).hex()


def verify(public: bytes, domain: str, payload: bytes, signature: bytes) -> bool:
    """Whether `signature` is `public`'s over `payload` in `domain` (a malformed key or
    signature is simply not valid)."""
    if len(public) != PUBLIC_BYTES or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, DOMAINS[domain] + payload)
    except (InvalidSignature, ValueError):
        return False
    return True


def stream_payload(snonce: bytes, cnonce: bytes, node: str) -> bytes:
    """What a `client` or `server` signature covers: one stream's nonces and a node."""
    parts = (snonce, cnonce, node.encode())
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def proves(sig: object, public: bytes, side: str, snonce: bytes, cnonce: bytes, node: str) -> bool:
    """Whether `sig` (hex, as it came on the wire) is `node`'s `side` signature of this
    stream, by its key `public` (none known: nothing to prove, True)."""
    if not public:
        return True
    try:
        raw = bytes.fromhex(sig) if isinstance(sig, str) else b""
    except ValueError:
        return False
    return verify(public, side, stream_payload(snonce, cnonce, node), raw)
