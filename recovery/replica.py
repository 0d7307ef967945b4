"""Buddy replicas: each node's newest flash copies, kept in another node's shared memory.

When a node is lost, its flash copies go with it. Each agent therefore sends its ranks'
newest completed copies to a buddy agent (node i -> node i+1 of a ring, `ring`) in the
background, over an asyncio TCP stream. The buddy verifies the data against the
manifest's checksum while it streams it into a slot of the store `replica-<node>`
(double-buffered, like a local copy), so a replacement node can restore from it. A copy
that fails the checksum is refused and never becomes a valid copy.

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

Bounds: the declared sizes are checked (manifest <= MAX_MANIFEST, data equal to the
manifest's and <= `max_copy_bytes`, and within the tmpfs' free space) before a byte is
written; data is streamed into the slot file chunk by chunk, never pre-allocated; at most
`max_connections` streams at a time; a malformed header is answered with one error line.
A connection holds no stream slot until it has authenticated (TLS handshake and header),
which it must do within `header_timeout_s`; of those not authenticated yet, at most
`max_pending` are kept (the oldest is closed), so idle connections with no credential
cannot hold the buddy from its nodes.

Wire format (v4). The server speaks first: `{"v": 4, "nonce": hex}`. The client sends one
JSON header line (`op`, `node`, `cnonce`, `as` for a get; `rank`, `manifest_len`,
`data_len`, `manifest_sha256` for a put; plus `mac` with a key), then for a put the
manifest and the data, in chunks of `SEND_CHUNK` bytes each followed by its 32-byte MAC
when keyed, then one line `{"origin": record}` (the signature). The buddy answers one
line (`ok`, `error`). A GET is answered by one header line per copy (`rank`,
`manifest_len`, `data_len`, `manifest_sha256`), the manifest, the data chunks, its origin
line, and finally `{"done": true}`; the fetcher verifies every MAC, checksum and origin
signature while streaming a copy into its own slot. (v3 was v2 with 256 KiB chunks
instead of 8 MiB: a copy's chunk went through three buffer copies of its whole size on
each side; a 1.5 MB copy took 3.2 ms of the sender's CPU and 5.3 ms of the buddy's, about
2.1 and 3.5 ms in 256 KiB chunks. v4 is v3 with the origin line. An older peer is refused
with the version it speaks.)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from unbroken.recovery import copysig
from unbroken.recovery.flashcopy import (
    CopyRef,
    CorruptCopyError,
    Manifest,
    data_path,
    list_copies,
    manifest_path,
    new_hasher,
    read_copy,
    read_manifest,
    replica_store,
    seal,
    write_manifest,
)
from unbroken.recovery.flashowner import FlashOwner, secure_dir

log = structlog.get_logger(__name__)

SEND_CHUNK = 256 << 10
MAX_HEADER = 4096
MAX_MANIFEST = 16 << 20  # a manifest lists tensors and small values: far below this
MAC_LEN = 32
PROTOCOL = 4
KEY_ENV = "UNBROKEN_REPLICA_KEY"


class ReplicaRefused(ValueError):
    """A request the buddy refuses (bad header, not authenticated, not allowed)."""


def ring(nodes: Sequence[str]) -> dict[str, str]:
    """Each node's buddy: the next node in `nodes` (wrapping), which receives its copies.

    Args:
        nodes: the job's nodes in a stable order (e.g. by node rank).

    Returns:
        sender -> buddy; empty for a single node (there is nobody to replicate to).

    Raises:
        ValueError: duplicate node names.
    """
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"ring needs distinct node names, got {list(nodes)}")
    if len(nodes) < 2:
        return {}
    return {n: nodes[(i + 1) % len(nodes)] for i, n in enumerate(nodes)}


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


@dataclass(frozen=True, slots=True)
class SendResult:
    """The buddy's verdict on one copy."""

    rank: int
    step: int
    ok: bool
    error: str = ""
    corrupt: bool = False  # the buddy received the copy whole and its checksum did not match


class _Framing:
    """Per-connection MACs (keyed mode): lines and chunks, per direction and sequence."""

    def __init__(self, key: bytes | None, snonce: bytes, cnonce: bytes, *, server: bool) -> None:
        self.reset(key, snonce, cnonce, server=server)

    def reset(self, key: bytes | None, snonce: bytes, cnonce: bytes, *, server: bool) -> None:
        self.key = key
        self.bind = snonce + cnonce
        self.out_dir, self.in_dir = (b"s2c", b"c2s") if server else (b"c2s", b"s2c")
        self.sent = 0
        self.received = 0

    def _mac(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        assert self.key is not None
        msg = direction + self.bind + seq.to_bytes(8, "big") + payload
        return hmac.digest(self.key, msg, "sha256")  # one-shot, in C (no HMAC object)

    def line(self, obj: dict[str, Any]) -> bytes:
        if self.key is not None:
            body = json.dumps(obj, sort_keys=True).encode()
            obj = {**obj, "mac": self._mac(self.out_dir, self.sent, body).hex()}
            self.sent += 1
        return json.dumps(obj).encode() + b"\n"

    def check(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.key is None:
            return obj
        obj = dict(obj)
        mac = obj.pop("mac", "")
        body = json.dumps(obj, sort_keys=True).encode()
        want = self._mac(self.in_dir, self.received, body)
        if not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), want.hex().encode()):
            raise ReplicaRefused(
                "replica message fails its MAC (not sent by a holder of the job's replica key)"
            )
        self.received += 1
        return obj

    def chunk_mac(self, chunk: bytes) -> bytes:
        if self.key is None:
            return b""
        mac = self._mac(self.out_dir, self.sent, chunk)
        self.sent += 1
        return mac

    def check_chunk(self, chunk: bytes, mac: bytes) -> None:
        if self.key is None:
            return
        if not hmac.compare_digest(mac, self._mac(self.in_dir, self.received, chunk)):
            raise ReplicaRefused("replica data fails its MAC (altered or forged in transit)")
        self.received += 1


def _parse_line(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_HEADER or not line.endswith(b"\n"):
        raise ReplicaRefused(f"replica header too long (> {MAX_HEADER} bytes) or missing")
    try:
        obj = json.loads(line)
    except ValueError:
        raise ReplicaRefused("replica header is not JSON") from None
    if not isinstance(obj, dict):
        raise ReplicaRefused("replica header is not a JSON object")
    return obj


def _int(head: dict[str, Any], name: str) -> int:
    v = head.get(name)
    if type(v) is not int or v < 0:
        raise ReplicaRefused(f"replica header field {name!r} must be an integer >= 0, got {v!r}")
    return v


def _str(head: dict[str, Any], name: str) -> str:
    v = head.get(name)
    if not isinstance(v, str) or not v or len(v) > 256 or "/" in v or not v.isprintable():
        raise ReplicaRefused(f"replica header field {name!r} must be a plain name, got {v!r}")
    return v


def _check_sizes(mlen: int, dlen: int, cfg: ReplicaConfig) -> None:
    if not 0 < mlen <= MAX_MANIFEST:
        raise ReplicaRefused(f"manifest of {mlen} bytes (at most {MAX_MANIFEST})")
    if dlen > cfg.max_copy_bytes:
        raise ReplicaRefused(f"copy of {dlen} bytes exceeds the limit {cfg.max_copy_bytes}")


async def _read_manifest(
    reader: asyncio.StreamReader, mlen: int, dlen: int, rank: int, sha: object
) -> tuple[Manifest, bytes]:
    """The manifest of `mlen` bytes that follows a header, and the SHA-256 of its bytes."""
    raw = await reader.readexactly(mlen)
    digest = hashlib.sha256(raw)
    if sha != digest.hexdigest():
        raise ReplicaRefused("manifest does not match the header's manifest_sha256")
    try:
        manifest = Manifest.from_bytes(raw)
    except (CorruptCopyError, ValueError, KeyError, TypeError) as e:
        raise ReplicaRefused(f"malformed manifest: {e}") from None
    if manifest.rank != rank or manifest.data_nbytes != dlen:
        raise ReplicaRefused("header does not match the manifest")
    return manifest, digest.digest()


@dataclass(frozen=True, slots=True)
class _Origin:
    """Whose copy is streamed in, and how its origin signature is checked."""

    node: str
    manifest_sha256: bytes
    signer: copysig.CopySigner | None


async def _stream_into_slot(
    reader: asyncio.StreamReader,
    framing: _Framing,
    rank_dir: Path,
    manifest: Manifest,
    headroom: int,
    origin: _Origin,
) -> CopyRef | None:
    """Stream a copy's data into the free slot of `rank_dir`, chunk by chunk, then its
    origin record (a line after the data, `{"origin": ...}`).

    The slot not holding the newest copy is invalidated first; its manifest is written
    only when every byte arrived, the checksum matched and the origin node's signature
    verified (`copysig`; the record is kept beside the slot). Returns None on a checksum
    mismatch (the slot stays invalid; the newest copy is untouched).

    Raises:
        ReplicaRefused: not enough room on the tmpfs, or a chunk fails its MAC.
        copysig.BadSignature: the copy is not signed by `origin.node`.
    """
    secure_dir(rank_dir)
    nbytes = manifest.data_nbytes
    st = os.statvfs(rank_dir)
    free = st.f_bavail * st.f_frsize
    refs = list_copies(rank_dir)
    slot = 1 - refs[0].slot if refs else 0
    path = data_path(rank_dir, slot)
    have = path.stat().st_size if path.exists() else 0
    if nbytes - have + headroom > free:
        raise ReplicaRefused(
            f"copy of {nbytes} bytes does not fit: {free} bytes free on the buddy's tmpfs"
        )
    manifest_path(rank_dir, slot).unlink(missing_ok=True)
    copysig.record_path(rank_dir, slot).unlink(missing_ok=True)
    hasher, got, sha = new_hasher(), 0, hashlib.sha256()
    # written over in place, not truncated first: on the tmpfs a truncation frees the slot's
    # pages and the write allocates and zeroes them again, once a second per copy
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    if have != nbytes:
        os.ftruncate(fd, nbytes)
    with os.fdopen(fd, "wb") as f:
        while got < nbytes:
            chunk = await reader.readexactly(min(SEND_CHUNK, nbytes - got))
            if framing.key is not None:
                framing.check_chunk(chunk, await reader.readexactly(MAC_LEN))
            hasher.update(chunk)
            sha.update(chunk)
            f.write(chunk)
            got += len(chunk)
    rec = framing.check(_parse_line(await reader.readline())).get("origin") or {}
    if hasher.intdigest() != manifest.checksum:
        return None
    if origin.signer is None:
        raise copysig.BadSignature("no replica credential here to check a copy's origin")
    if not isinstance(rec, dict):
        raise copysig.BadSignature(f"node {origin.node!r}'s copy: malformed origin record")
    origin.signer.verify(origin.node, origin.manifest_sha256, sha.digest(), rec)
    tmp = rank_dir / f".slot-{slot}.origin.tmp"
    tmp.write_bytes(copysig.dump(rec))
    os.replace(tmp, copysig.record_path(rank_dir, slot))
    write_manifest(rank_dir, slot, manifest)
    return CopyRef(rank_dir, slot, manifest)


async def _send_data(
    path: Path, nbytes: int, writer: asyncio.StreamWriter, framing: _Framing, flip: int | None
) -> bytes:
    """Write a slot's data (and, keyed, each chunk's MAC) to `writer`; returns the
    SHA-256 of the data read (before any injected flip). Each chunk is a new object: a
    transport may hold on to what it could not send yet (TLS always does)."""
    sent, sha = 0, hashlib.sha256()
    with open(path, "rb") as f:
        while sent < nbytes:
            want = min(SEND_CHUNK, nbytes - sent)
            chunk = f.read(want)
            if len(chunk) != want:
                raise CorruptCopyError(f"{path} is shorter than its manifest")
            sha.update(chunk)
            if flip is not None and sent <= flip < sent + want:
                b = bytearray(chunk)
                b[flip - sent] ^= 0x01
                chunk = bytes(b)
            mac = framing.chunk_mac(chunk)  # of what is sent: a flipped bit fails the checksum
            writer.write(chunk)
            if mac:
                writer.write(mac)
            await writer.drain()
            sent += want
    return sha.digest()


class ReplicaServer:
    """The buddy side: receives copies over TCP, verifies, stores them in its shm."""

    def __init__(self, owner: FlashOwner, config: ReplicaConfig | None = None) -> None:
        self.owner = owner
        self.config = config or ReplicaConfig()
        self._server: asyncio.Server | None = None
        self._active = 0
        # connections not authenticated yet, oldest first (the oldest is closed when full)
        self._pending: dict[asyncio.StreamWriter, None] = {}
        self._locks: dict[Path, asyncio.Lock] = {}
        # the nodes whose copies this buddy takes (the driver's ring: the node it pairs
        # with this one); None until it has paired one, then with TLS a PUT of any other
        # node is refused
        self.senders: set[str] | None = None
        self.received = 0
        self.refused = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; returns the bound port (pass 0 for a free one)."""
        self._server = await asyncio.start_server(
            self._handle,
            host,
            port,
            ssl=self.config.auth.server_ssl,
            limit=MAX_HEADER + 2,
            ssl_handshake_timeout=(
                min(self.config.header_timeout_s, self.config.timeout_s)
                if self.config.auth.server_ssl
                else None
            ),
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and wait for the server to close."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        framing = _Framing(None, b"", b"", server=True)
        reply: dict[str, object] | None
        try:
            req = await self._authenticated(reader, writer, framing)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            req, reply = None, {"ok": False, "error": f"{type(e).__name__}: {e}"}
        except (ReplicaRefused, ValueError, ssl.SSLError, OSError) as e:
            req, reply = None, {"ok": False, "error": str(e)}
        if req is None:
            pass
        elif self._active >= self.config.max_connections:
            reply = {
                "ok": False,
                "error": f"busy: {self._active} replica streams already open; retry later",
            }
        else:
            self._active += 1
            try:
                reply = await asyncio.wait_for(
                    self._serve(reader, writer, framing, *req), self.config.timeout_s
                )
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            except (ReplicaRefused, ValueError, ssl.SSLError, OSError) as e:
                reply = {"ok": False, "error": str(e)}
            finally:
                self._active -= 1
        if reply is None:  # a fetch: the copies are sent already
            writer.close()
            return
        if not reply["ok"]:
            self.refused += 1
            log.warning("replica.refused", error=reply["error"], peer=_peer(writer))
        try:
            writer.write(framing.line(reply))
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _authenticated(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, framing: _Framing
    ) -> tuple[dict[str, Any], str | None]:
        """The header and peer of a connection that authenticated within
        `header_timeout_s`; meanwhile it is one of at most `max_pending` (the oldest goes)."""
        while len(self._pending) >= self.config.max_pending:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            oldest.close()  # its header read ends with an error; it never held a slot
        self._pending[writer] = None
        deadline = min(self.config.header_timeout_s, self.config.timeout_s)
        try:
            return await asyncio.wait_for(self._header(reader, writer, framing), deadline)
        except TimeoutError:
            raise ReplicaRefused(f"no authenticated header within {deadline} s") from None
        finally:
            self._pending.pop(writer, None)

    async def _header(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, framing: _Framing
    ) -> tuple[dict[str, Any], str | None]:
        auth = self.config.auth
        snonce = os.urandom(16)
        writer.write(json.dumps({"v": PROTOCOL, "nonce": snonce.hex()}).encode() + b"\n")
        await writer.drain()
        try:
            line = await reader.readline()
        except ValueError:  # longer than the stream's limit
            raise ReplicaRefused(f"replica header too long (> {MAX_HEADER} bytes)") from None
        head = _parse_line(line)
        if not auth.enabled:
            raise ReplicaRefused(
                "this buddy has no replica credential (TLS or a job key) and serves nobody"
            )
        try:
            cnonce = bytes.fromhex(str(head.get("cnonce", "")))
        except ValueError:
            raise ReplicaRefused("replica header: cnonce must be hex") from None
        framing.reset(auth.key if auth.server_ssl is None else None, snonce, cnonce, server=True)
        head = framing.check(head)
        peer = node_of_peercert(_peercert(writer)) if auth.server_ssl is not None else None
        return head, peer

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        framing: _Framing,
        head: dict[str, Any],
        peer: str | None,
    ) -> dict[str, object] | None:
        auth = self.config.auth
        node = _str(head, "node")
        if head.get("op", "put") == "get":
            self._authorize_get(peer, node, head)
            await self._serve_get(node, writer, framing)
            return None
        if head.get("op", "put") != "put":
            raise ReplicaRefused(f"unknown replica op {head.get('op')!r}")
        if auth.server_ssl is not None and peer != node:
            raise ReplicaRefused(
                f"a copy of node {node!r} may only come from node:{node} (the peer is "
                f"{'node:' + peer if peer else 'no node'})"
            )
        # (with TLS, where the peer proved it is `node`; a job key proves no node's name)
        if auth.server_ssl is not None and self.senders is not None and node not in self.senders:
            raise ReplicaRefused(
                f"this buddy takes copies only of {sorted(self.senders) or 'no node'} (the "
                f"nodes the driver paired with it), not of node {node!r}"
            )
        return await self._receive(reader, head, framing)

    def _authorize_get(self, peer: str | None, node: str, head: dict[str, Any]) -> None:
        auth = self.config.auth
        if auth.server_ssl is None:
            return  # keyed: the MAC proved job membership, all the key can prove
        if peer == node or (peer is not None and f"node:{peer}" in auth.grants(node)):
            return
        raise ReplicaRefused(
            f"node {node!r}'s copies are served only to node:{node} or a replacement named "
            f"in this buddy's grants file; the peer is {'node:' + peer if peer else 'no node'}"
        )

    async def _serve_get(self, node: str, writer: asyncio.StreamWriter, fr: _Framing) -> None:
        store = replica_store(node)
        sent = 0
        for rank in self.owner.ranks(store):
            # both copies, the older first (the fetcher's double buffer keeps both): the
            # newest may be a step the survivors never saved (the lost node finished its
            # save, a survivor was stopped in the middle of its own), while the older one
            # was sent from inside every rank's ring (ReplicaSender); with the newest alone
            # a takeover found no common step in memory and restored from storage, 314
            # steps back in the recovery bench
            for ref in reversed(list_copies(self.owner.rank_dir(rank, store))):
                m = ref.manifest  # a replica: sealed when it arrived
                if not m.sealed:  # (a copy written here some other way: hash it now)
                    try:
                        m = await asyncio.to_thread(seal, ref)
                    except CorruptCopyError as e:
                        log.warning("replica.serve_skipped", node=node, rank=rank, error=str(e))
                        continue
                head = m.to_bytes()
                hdr = {
                    "rank": rank,
                    "manifest_len": len(head),
                    "data_len": m.data_nbytes,
                    "manifest_sha256": hashlib.sha256(head).hexdigest(),
                }
                writer.write(fr.line(hdr) + head)
                await _send_data(ref.data_path, m.data_nbytes, writer, fr, None)
                try:  # the sender's signature, as it came (none: the fetcher refuses it)
                    rec = copysig.load(copysig.record_path(ref.rank_dir, ref.slot).read_bytes())
                except OSError:
                    rec = {}
                writer.write(fr.line({"origin": rec}))
                sent += 1
        writer.write(fr.line({"done": True, "count": sent}))
        await writer.drain()
        log.info("replica.served", node=node, copies=sent, peer=_peer(writer))

    async def _receive(
        self, reader: asyncio.StreamReader, head: dict[str, Any], fr: _Framing
    ) -> dict[str, object]:
        node, rank = _str(head, "node"), _int(head, "rank")
        mlen, dlen = _int(head, "manifest_len"), _int(head, "data_len")
        _check_sizes(mlen, dlen, self.config)
        manifest, msha = await _read_manifest(reader, mlen, dlen, rank, head.get("manifest_sha256"))
        rank_dir = self.owner.rank_dir(rank, replica_store(node))
        lock = self._locks.setdefault(rank_dir, asyncio.Lock())
        origin = _Origin(node, msha, self.config.auth.signer)
        async with lock:
            ref = await _stream_into_slot(
                reader, fr, rank_dir, manifest, self.config.headroom_bytes, origin
            )
        if ref is None:
            return {
                "ok": False,
                "corrupt": True,
                "error": f"checksum mismatch for rank {rank} step {manifest.step}",
            }
        self.received += 1
        log.info("replica.stored", node=node, rank=rank, step=manifest.step, bytes=dlen)
        return {"ok": True, "error": ""}


def _peercert(writer: asyncio.StreamWriter) -> dict[str, Any] | None:
    obj = writer.get_extra_info("ssl_object")
    return obj.getpeercert() if obj is not None else None  # type: ignore[no-any-return]


def _peer(writer: asyncio.StreamWriter) -> str:
    return str(writer.get_extra_info("peername"))


async def _connect(
    host: str, port: int, cfg: ReplicaConfig, expect: str = ""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """Open a stream to a buddy and read its greeting; returns its nonce. With TLS and
    `expect` (a node id), the server must be that node.

    Raises:
        ReplicaRefused: no credential here, or the peer is not a node of our CA, or not
            the expected one.
    """
    auth = cfg.auth
    if not auth.enabled:
        raise ReplicaRefused("no replica credential (TLS or a job key) configured")
    reader, writer = await asyncio.open_connection(
        host, port, ssl=auth.client_ssl, limit=MAX_HEADER + 2
    )
    try:
        peer = node_of_peercert(_peercert(writer)) if auth.client_ssl is not None else None
        if auth.client_ssl is not None and peer is None:
            raise ReplicaRefused(f"the buddy at {host}:{port} has no node:<id> certificate")
        if auth.client_ssl is not None and expect and peer != expect:
            raise ReplicaRefused(
                f"the replica server at {host}:{port} is node:{peer}, not node:{expect}, the "
                "buddy the driver paired this node with: nothing sent"
            )
        hello = _parse_line(await reader.readline())
        if hello.get("ok") is False:  # busy, or refused before the greeting
            raise ReplicaRefused(f"the buddy at {host}:{port} refused: {hello.get('error')}")
        if hello.get("v") != PROTOCOL:
            raise ReplicaRefused(f"the buddy at {host}:{port} speaks replica protocol "
                                 f"{hello.get('v')!r}, not {PROTOCOL}")  # fmt: skip
        return reader, writer, bytes.fromhex(str(hello.get("nonce", "")))
    except BaseException:
        writer.close()
        raise


def _client_framing(cfg: ReplicaConfig, snonce: bytes) -> tuple[_Framing, str]:
    cnonce = os.urandom(16)
    key = cfg.auth.key if cfg.auth.client_ssl is None else None
    return _Framing(key, snonce, cnonce, server=False), cnonce.hex()


async def _reply(reader: asyncio.StreamReader, fr: _Framing) -> dict[str, Any]:
    obj = _parse_line(await reader.readline())
    if "mac" not in obj and obj.get("ok") is False:  # refused before it could authenticate us
        raise ReplicaRefused(f"the buddy refused: {obj.get('error')} (an unauthenticated answer)")
    return fr.check(obj)


async def fetch_replica(
    owner: FlashOwner,
    node: str,
    host: str,
    port: int,
    *,
    config: ReplicaConfig | None = None,
    requester: str = "",
) -> list[CopyRef]:
    """Get `node`'s replicated copies back from its buddy into `owner`'s `replica-<node>`.

    Used by a node that replaces `node`: its workers then restore from these copies.
    Every copy is verified against its MACs and checksum while it is streamed into a slot;
    a bad one is skipped (and logged), never a valid copy.

    Args:
        owner: this node's flash store.
        node: the lost node whose copies the buddy holds.
        host: the buddy's replica server.
        port: its port.
        config: limits and credentials (`timeout_s` bounds the whole fetch).
        requester: this node's id (for the buddy's log; with TLS its certificate says it).

    Returns:
        The copies stored.

    Raises:
        ConnectionError, OSError, TimeoutError: the buddy is unreachable or too slow.
        ValueError: the buddy refused us or sent a malformed or unauthenticated stream.
    """
    cfg = config or ReplicaConfig()
    store = replica_store(node)

    async def go() -> list[CopyRef]:
        reader, writer, snonce = await _connect(host, port, cfg)
        fr, cnonce = _client_framing(cfg, snonce)
        stored: list[CopyRef] = []
        try:
            writer.write(fr.line({"op": "get", "node": node, "as": requester, "cnonce": cnonce}))
            await writer.drain()
            while True:
                head = await _reply(reader, fr)
                if head.get("done"):
                    return stored
                if "ok" in head and not head["ok"]:
                    raise ReplicaRefused(f"the buddy refused the fetch: {head.get('error')}")
                rank, mlen, dlen = (_int(head, k) for k in ("rank", "manifest_len", "data_len"))
                _check_sizes(mlen, dlen, cfg)
                manifest, msha = await _read_manifest(
                    reader, mlen, dlen, rank, head.get("manifest_sha256")
                )
                origin = _Origin(node, msha, cfg.auth.signer)
                try:
                    ref = await _stream_into_slot(
                        reader, fr, owner.rank_dir(rank, store), manifest, cfg.headroom_bytes,
                        origin,
                    )  # fmt: skip
                except copysig.BadSignature as e:  # the buddy's own making, or damaged
                    log.warning("replica.fetch_unsigned", node=node, rank=rank, error=str(e))
                    continue
                if ref is None:
                    log.warning("replica.fetch_refused", node=node, rank=rank, step=manifest.step)
                    continue
                stored.append(ref)
                log.info("replica.fetched", node=node, rank=rank, step=manifest.step, bytes=dlen)
        finally:
            writer.close()

    return await asyncio.wait_for(go(), cfg.timeout_s)


async def send_copy(
    ref: CopyRef,
    node: str,
    host: str,
    port: int,
    *,
    config: ReplicaConfig | None = None,
    flip_bit_at: int | None = None,
    buddy_node: str = "",
) -> SendResult:
    """Stream one flash copy to the buddy at `host:port` and return its verdict.

    The slot is read while the worker may overwrite it: if it changed during the send the
    buddy's checksum check refuses it, and the result says so.

    Args:
        ref: the copy (typically `FlashOwner.newest(rank)`).
        node: this node's name (the buddy stores under `replica-<node>`).
        host: the buddy's replica server.
        port: its port.
        config: limits and credentials.
        flip_bit_at: fault injection: flip one bit at this data offset in transit.
        buddy_node: the node id the buddy must be (checked with TLS; "": any node).
    """
    cfg = config or ReplicaConfig()
    m = ref.manifest

    async def go() -> SendResult:
        # a writer's copy is hashed here, about once a second, not at every save; the
        # buddy compares the bytes it receives with this checksum
        sealed = await asyncio.to_thread(seal, ref) if not m.sealed else m
        signer = cfg.auth.signer
        if signer is None:
            raise ReplicaRefused("no replica credential (TLS or a job key) configured")
        reader, writer, snonce = await _connect(host, port, cfg, buddy_node)
        fr, cnonce = _client_framing(cfg, snonce)
        try:
            head = sealed.to_bytes()
            hdr = {
                "op": "put",
                "node": node,
                "rank": m.rank,
                "manifest_len": len(head),
                "data_len": m.data_nbytes,
                "manifest_sha256": hashlib.sha256(head).hexdigest(),
                "cnonce": cnonce,
            }
            writer.write(fr.line(hdr) + head)
            data_sha = await _send_data(ref.data_path, m.data_nbytes, writer, fr, flip_bit_at)
            rec = signer.sign(node, hashlib.sha256(head).digest(), data_sha)
            writer.write(fr.line({"origin": rec}))
            reply = await _reply(reader, fr)
        finally:
            writer.close()
        ok = bool(reply.get("ok"))
        if read_manifest(ref.rank_dir, ref.slot) != m:
            return SendResult(m.rank, m.step, False, "slot overwritten during the send")
        return SendResult(
            m.rank, m.step, ok, str(reply.get("error", "")), not ok and bool(reply.get("corrupt"))
        )

    try:
        return await asyncio.wait_for(go(), cfg.timeout_s)
    except (TimeoutError, ConnectionError, OSError, CorruptCopyError, ValueError) as e:
        return SendResult(m.rank, m.step, False, f"{type(e).__name__}: {e}")


# How far inside the ring a replicated step is kept when sends are spaced out (copies).
REPLICA_MARGIN = 3
# A newest copy no newer save has followed for this long is sent whatever the spacing.
IDLE_FLUSH_S = 1.0
# A replica is never older than about this when saves are slower than the ring's spacing.
REPLICA_EVERY_S = 1.0
# After a failed send a rank's next try waits this long, doubling per failure up to the cap.
RETRY_FIRST_S = 0.1
RETRY_CAP_S = 5.0


class ReplicaSender:
    """The sending agent's side: ships each local rank's newest copy to the buddy (the
    newest step all local ranks hold, the same for every rank: `same_step`).

    Not every copy: with a ring of k copies a copy goes every `k - REPLICA_MARGIN` saves
    (every save when k <= 4), or once `REPLICA_EVERY_S` has passed since the last one
    when that comes first (slow steps), so the replicated step stays inside every rank's ring (a
    restore after this node is lost needs one step that all ranks hold in memory, and the
    survivors' rings turn at the same pace as this one), while the agent spends a fraction
    of the CPU it would copying every step. A copy no newer save has followed for
    `IDLE_FLUSH_S` goes at once: when training pauses or stops, the last copy is the one
    worth having. The agent calls `tick()` on its poll timer.

    A failed send is retried after `RETRY_FIRST_S`, doubling up to `RETRY_CAP_S` while the
    buddy stays unreachable (not 10 tries a second, each logged). A copy the buddy received
    whole but found corrupt is read back here: if it fails its checksum here too it is never
    sent again (the next newer copy is); if not, it was damaged in transit and is retried.
    """

    def __init__(
        self,
        owner: FlashOwner,
        node: str,
        buddy: tuple[str, int],
        config: ReplicaConfig | None = None,
        *,
        idle_flush_s: float = IDLE_FLUSH_S,
        every_s: float = REPLICA_EVERY_S,
        buddy_node: str = "",
    ) -> None:
        self.owner = owner
        self.node = node
        self.buddy = buddy
        self.buddy_node = buddy_node  # who the buddy must be (TLS); "": any node of the CA
        self.config = config or ReplicaConfig()
        self.idle_flush_s = idle_flush_s
        self.every_s = every_s
        self._sent: dict[int, int] = {}  # rank -> generation acknowledged by the buddy
        self._sent_at: dict[int, float] = {}  # rank -> when the buddy acknowledged it
        self._newest_seen: dict[int, tuple[int, float]] = {}  # rank -> (generation, first seen)
        self._retry: dict[int, tuple[int, float]] = {}  # rank -> (failures in a row, next try)
        self._corrupt: dict[int, int] = {}  # rank -> generation the buddy found corrupt
        self.sent_copies = 0  # copies the buddy accepted (metrics)
        self.sent_bytes = 0
        self.spaced_out = 0  # ticks that left a newer copy for a later send (metrics)
        self.failed = 0  # sends that failed (metrics)

    def due(self, rank: int, refs: list[CopyRef], now: float) -> CopyRef | None:
        """The copy of `rank` to send now (its newest), or None; `refs` newest first."""
        if not refs:
            return None
        newest = refs[0]
        gen = newest.manifest.generation
        acked = self._sent.get(rank)
        if self._held_back(rank, gen, now):
            return None
        seen = self._newest_seen.get(rank)
        if seen is None or seen[0] != gen:
            seen = self._newest_seen[rank] = (gen, now)
        gens = [r.manifest.generation for r in refs]
        if acked is None or acked not in gens:
            return newest
        newer = sum(1 for g in gens if g > acked)
        if (
            newer >= max(1, len(refs) - REPLICA_MARGIN)
            or now - seen[1] >= self.idle_flush_s
            or now - self._sent_at.get(rank, now) >= self.every_s
        ):
            return newest
        self.spaced_out += 1
        return None

    async def tick(self, listed: dict[int, list[CopyRef]] | None = None) -> list[SendResult]:
        """Send every rank's newest copy that is due (see the class docstring); `listed`:
        each rank's copies as the caller just listed them (else they are listed here)."""
        results = []
        by_rank: dict[int, list[CopyRef]] = {}
        for rank in self.owner.ranks():
            refs = listed.get(rank) if listed is not None else None
            by_rank[rank] = refs if refs is not None else list_copies(self.owner.rank_dir(rank))
        for rank, ref in self.picks(by_rank, time.monotonic()).items():
            host, port = self.buddy
            res = await send_copy(
                ref, self.node, host, port, config=self.config, buddy_node=self.buddy_node
            )
            local_ok = True
            if res.corrupt:  # in transit, or here? Read it back (rare: once per refusal).
                local_ok = await asyncio.to_thread(_verifies, ref)
            self._settle(rank, ref, res, time.monotonic(), local_ok=local_ok)
            results.append(res)
        return results

    def picks(self, by_rank: dict[int, list[CopyRef]], now: float) -> dict[int, CopyRef]:
        """The copies to send now: when any rank's copy is due, every rank's copy of the
        same step (`same_step`) not acknowledged yet. Decided per rank, the ranks' counts
        since their last replica drifted apart (one rank due a tick before the other): a
        drill's buddy held ranks 2 and 3 at steps 265 and 264, no step in common, and the
        evicted node's ranks restored from the first commit, 264 steps back."""
        trimmed = same_step(by_rank)
        due = {rank: self.due(rank, refs, now) for rank, refs in trimmed.items()}
        if not any(ref is not None for ref in due.values()):
            return {}
        out = {}
        for rank, refs in trimmed.items():
            ref = due[rank] or (refs[0] if refs else None)
            if ref is None:
                continue
            if not self._held_back(rank, ref.manifest.generation, now):
                out[rank] = ref
        return out

    def _held_back(self, rank: int, gen: int, now: float) -> bool:
        """Whether `rank`'s copy `gen` is not to be sent now: acknowledged already, found
        corrupt, or the rank waits for its retry time."""
        if self._sent.get(rank) == gen or self._corrupt.get(rank) == gen:
            return True
        retry = self._retry.get(rank)
        return retry is not None and now < retry[1]

    def _settle(
        self, rank: int, ref: CopyRef, res: SendResult, now: float, *, local_ok: bool = False
    ) -> None:
        """Book one send's outcome: acknowledged, corrupt here (the buddy found it corrupt
        and `local_ok` is false: it fails its checksum here too), or retried later."""
        if res.ok:
            self._sent[rank] = ref.manifest.generation
            self._sent_at[rank] = now
            self._retry.pop(rank, None)
            self.sent_copies += 1
            self.sent_bytes += ref.manifest.data_nbytes
            return
        self.failed += 1
        if res.corrupt and not local_ok:
            self._corrupt[rank] = ref.manifest.generation
            self._retry.pop(rank, None)
            log.error(
                "replica.local_copy_corrupt",
                rank=rank,
                step=res.step,
                slot=ref.slot,
                error=res.error,
                hint="this node's memory copy failed its checksum at the buddy; it is not "
                "sent again, the next copy is",
            )
            return
        n = self._retry.get(rank, (0, 0.0))[0] + 1
        self._retry[rank] = (n, now + min(RETRY_CAP_S, RETRY_FIRST_S * 2 ** (n - 1)))
        log.warning("replica.send_failed", rank=rank, step=res.step, error=res.error, tries=n)


def same_step(by_rank: dict[int, list[CopyRef]]) -> dict[int, list[CopyRef]]:
    """Each rank's copies (newest first) up to the newest step every rank holds, so the
    node's ranks replicate the same step: the buddy keeps two copies a rank, and ranks
    whose newest copies were a step apart when sent (17 and 18, 23 and 24) left the buddy
    no step in common, and a lost node's restore fell back to the newest commit (a drill
    lost 25 steps). Unchanged when the ranks hold no step in common."""
    if len(by_rank) < 2:
        return by_rank
    steps = [{r.manifest.step for r in refs} for refs in by_rank.values()]
    common = set.intersection(*steps)
    if not common:
        return by_rank
    top = max(common)
    return {rank: [r for r in refs if r.manifest.step <= top] for rank, refs in by_rank.items()}


def _verifies(ref: CopyRef) -> bool:
    """Whether the copy still matches its checksum (False: corrupt, truncated, or gone)."""
    try:
        read_copy(ref).close()
    except CorruptCopyError:
        return False
    return True


def replica_dirs(owner: FlashOwner, node: str) -> dict[int, Path]:
    """rank -> directory of `node`'s replicated copies held by this owner."""
    store = replica_store(node)
    return {r: owner.rank_dir(r, store) for r in owner.ranks(store)}
