"""Buddy replicas: each node's newest flash copies, kept in another node's shared memory.

When a node is lost, its flash copies go with it. Each agent therefore sends its ranks'
newest completed copies to a buddy agent (node i -> node i+1 of a ring, `ring`) in the
background, over an asyncio TCP stream. The buddy verifies the data against the
manifest's checksum while it streams it into a slot of the store `replica-<node>`
(double-buffered, like a local copy), so a replacement node can restore from it. A copy
that fails the checksum is refused and never becomes a valid copy.

Bounds: the declared sizes are checked (manifest <= MAX_MANIFEST, data equal to the
manifest's and <= `max_copy_bytes`, and within the tmpfs' free space) before a byte is
written; data is streamed into the slot file chunk by chunk, never pre-allocated; at most
`max_connections` streams at a time; a malformed header is answered with one error line.
A connection holds no stream slot until it has authenticated (TLS handshake and header),
which it must do within `header_timeout_s`; of those not authenticated yet, at most
`max_pending` are kept (the oldest is closed), so idle connections with no credential
cannot hold the buddy from its nodes.

Who may talk to the buddy, and how a copy's origin is proven, is recovery/replicaauth.py;
which copy is sent when, recovery/replicasend.py (`ReplicaSender`).

Wire format (v6). The server speaks first: `{"v": 6, "nonce": hex}`. The client sends one
JSON header line (`op`, `node`, `cnonce`, `as` for a get; `rank`, `manifest_len`,
`data_len`, `manifest_sha256` for a put; plus `mac` with a key, and `ident` with a node
key), then for a put the manifest, the data in chunks of `SEND_CHUNK` bytes, then one line
`{"origin": record}` (the signature). The buddy answers one line (`ok`, `error`; `ident`
with a node key). A GET is answered by one
header line per copy (`rank`, `manifest_len`, `data_len`, `manifest_sha256`), the
manifest, the data chunks, its origin line, and finally `{"done": true}`; the fetcher
verifies every line's MAC, the checksum and the origin signature while streaming a copy
into its own slot. Every line is MAC'd (with a key; TLS protects the whole stream without
one); the data is not, chunk by chunk: the origin line (MAC'd) carries the SHA-256 of the
data its node signed, and the receiver hashes what it received before the copy is valid, so
a byte altered in transit is refused as surely, at the end of the copy rather than at its
chunk. (v4 MAC'd each chunk as well: a second SHA-256 pass over the data on each side, a
third of the sender's CPU per copy, which spaced the replicas out and cost a lost node's
ranks a step or two more. v3 was v2 with 256 KiB chunks instead of 8 MiB: a copy's chunk
went through three buffer copies of its whole size on each side; a 1.5 MB copy took 3.2 ms
of the sender's CPU and 5.3 ms of the buddy's, about 2.1 and 3.5 ms in 256 KiB chunks. v4
was v3 with the origin line; v5 had no node keys. An older peer is refused with the
version it speaks.)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from unbroken.common import aio
from unbroken.recovery import copysig, nodekey
from unbroken.recovery.flashcopy import (
    CopyRef,
    CorruptCopyError,
    Manifest,
    data_path,
    list_copies,
    manifest_path,
    new_hasher,
    read_manifest,
    replica_store,
    seal,
    write_manifest,
)
from unbroken.recovery.flashowner import FlashOwner, secure_dir
from unbroken.recovery.replicaauth import ReplicaConfig, node_of_peercert

log = structlog.get_logger(__name__)

SEND_CHUNK = 256 << 10
MAX_HEADER = 4096
MAX_MANIFEST = 16 << 20  # a manifest lists tensors and small values: far below this
PROTOCOL = 6


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


@dataclass(frozen=True, slots=True)
class SendResult:
    """The buddy's verdict on one copy."""

    rank: int
    step: int
    ok: bool
    error: str = ""
    corrupt: bool = False  # the buddy received the copy whole and its checksum did not match


class _Framing:
    """Per-connection MACs (keyed mode) of the JSON lines, per direction and sequence."""

    def __init__(self, key: bytes | None, snonce: bytes, cnonce: bytes, *, server: bool) -> None:
        self.reset(key, snonce, cnonce, server=server)

    def reset(self, key: bytes | None, snonce: bytes, cnonce: bytes, *, server: bool) -> None:
        self.key = key
        self.snonce, self.cnonce = snonce, cnonce  # what the node keys' signatures bind to
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
    pubkey: bytes = b""  # `node`'s own key, when the driver handed it out (keyed mode)


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
        ReplicaRefused: not enough room on the tmpfs.
        copysig.BadSignature: the copy is not signed by `origin.node`, or its data is not
            the data signed (altered in transit: the chunks carry no MAC of their own).
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
    origin.signer.verify(origin.node, origin.manifest_sha256, sha.digest(), rec, origin.pubkey)
    tmp = rank_dir / f".slot-{slot}.origin.tmp"
    tmp.write_bytes(copysig.dump(rec))
    os.replace(tmp, copysig.record_path(rank_dir, slot))
    write_manifest(rank_dir, slot, manifest)
    return CopyRef(rank_dir, slot, manifest)


async def _send_data(
    path: Path, nbytes: int, writer: asyncio.StreamWriter, flip: int | None
) -> bytes:
    """Write a slot's data to `writer`; returns the SHA-256 of the data read (before any
    injected flip: what the origin record signs). Each chunk is a new object: a
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
            writer.write(chunk)
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
        # called with (node, copy) after a stored copy, on a thread: the SDC buddy check. One
        # check at a time per rank, and never in the stream's way: a copy stored while its
        # rank's check runs waits for it (only the newest such copy), and the next copies
        # are received meanwhile, so the check must see for itself that its copy's slot was
        # not written over (the ring of two slots reuses it two copies later). Held under
        # the rank's receive lock, a check whose helper imported torch or got no CPU for
        # seconds held back every copy of that rank, the sender's flash thread waited on
        # its send as long, and a bad node evicted then restored 57 steps back
        # (bench-recovery ETTR run, MTBF 20 s, 2026-12-02).
        self.on_stored: Callable[[str, CopyRef], object] | None = None
        self._after: set[asyncio.Task[None]] = set()
        # rank dir -> the copy waiting for that rank's running check (None: none waits)
        self._checking: dict[Path, tuple[str, CopyRef] | None] = {}

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
        for task in list(self._after):  # a check of a copy not begun is not wanted now
            task.cancel()

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
                serving = self._serve(reader, writer, framing, *req)
                reply = await aio.wait_for(serving, self.config.timeout_s)
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
            return await aio.wait_for(self._header(reader, writer, framing), deadline)
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
        if auth.server_ssl is None:
            if why := _ident_error(head.get("ident"), auth.pubkey(node), "client", framing, node):
                raise ReplicaRefused(why)
        # (where the peer proved it is `node`: with TLS, or with node keys; a job key alone
        # proves no node's name)
        proven = auth.server_ssl is not None or auth.node_key is not None
        if proven and self.senders is not None and node not in self.senders:
            raise ReplicaRefused(
                f"this buddy takes copies only of {sorted(self.senders) or 'no node'} (the "
                f"nodes the driver paired with it), not of node {node!r}"
            )
        reply = await self._receive(reader, head, framing)
        if auth.node_key is not None and auth.server_ssl is None:  # who stored it
            reply["ident"] = auth.node_key.sign_stream("server", framing.snonce, framing.cnonce)
        return reply

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
                await _send_data(ref.data_path, m.data_nbytes, writer, None)
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
        origin = _Origin(node, msha, self.config.auth.signer, self.config.auth.pubkey(node))
        async with lock:
            ref = await _stream_into_slot(
                reader, fr, rank_dir, manifest, self.config.headroom_bytes, origin
            )
            if ref is not None and self.on_stored is not None:
                self._check(rank_dir, node, ref)
        if ref is None:
            return {
                "ok": False,
                "corrupt": True,
                "error": f"checksum mismatch for rank {rank} step {manifest.step}",
            }
        self.received += 1
        log.info("replica.stored", node=node, rank=rank, step=manifest.step, bytes=dlen)
        return {"ok": True, "error": ""}

    def _check(self, rank_dir: Path, node: str, ref: CopyRef) -> None:
        """Have `on_stored` check `ref` once the rank's running check, if any, is done."""
        if rank_dir in self._checking:  # one runs: this copy waits, in place of an older one
            self._checking[rank_dir] = (node, ref)
            return
        self._checking[rank_dir] = None
        task = asyncio.create_task(self._checks(rank_dir, (node, ref)))
        self._after.add(task)
        task.add_done_callback(self._after.discard)

    async def _checks(self, rank_dir: Path, first: tuple[str, CopyRef]) -> None:
        item: tuple[str, CopyRef] | None = first
        try:
            while item is not None and (fn := self.on_stored) is not None:
                node, ref = item
                try:
                    await asyncio.to_thread(fn, node, ref)
                except Exception:
                    log.exception("replica.on_stored_failed", node=node, rank=ref.manifest.rank)
                item, self._checking[rank_dir] = self._checking.get(rank_dir), None
        finally:
            self._checking.pop(rank_dir, None)


def _ident_error(sig: object, pubkey: bytes, side: str, fr: _Framing, node: str) -> str:
    """Why `sig` does not prove this stream's `side` is `node` ("": it does, or no key of
    `node` is known to check it by; keyed mode, recovery/nodekey.py)."""
    if nodekey.proves(sig, pubkey, side, fr.snonce, fr.cnonce, node):
        return ""
    who = "the sender" if side == "client" else "the replica server"
    return (
        f"{who} did not prove it is node {node!r} (no valid signature with the key node "
        f"{node!r} registered with the driver): another holder of the job's replica key"
    )


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
                origin = _Origin(node, msha, cfg.auth.signer, cfg.auth.pubkey(node))
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

    return await aio.wait_for(go(), cfg.timeout_s)


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
            nk = cfg.auth.node_key if cfg.auth.client_ssl is None else None
            if nk is not None and nk.node == node:  # this stream speaks for `node`: proven
                hdr["ident"] = nk.sign_stream("client", fr.snonce, fr.cnonce)
            writer.write(fr.line(hdr) + head)
            data_sha = await _send_data(ref.data_path, m.data_nbytes, writer, flip_bit_at)
            rec = signer.sign(node, hashlib.sha256(head).digest(), data_sha)
            writer.write(fr.line({"origin": rec}))
            reply = await _reply(reader, fr)
        finally:
            writer.close()
        ok = bool(reply.get("ok"))
        pub = cfg.auth.pubkey(buddy_node) if buddy_node else b""
        if ok and (why := _ident_error(reply.get("ident"), pub, "server", fr, buddy_node)):
            return SendResult(m.rank, m.step, False, f"{host}:{port}: {why}")  # not its buddy
        if read_manifest(ref.rank_dir, ref.slot) != m:
            return SendResult(m.rank, m.step, False, "slot overwritten during the send")
        return SendResult(
            m.rank, m.step, ok, str(reply.get("error", "")), not ok and bool(reply.get("corrupt"))
        )

    try:
        return await aio.wait_for(go(), cfg.timeout_s)
    except (TimeoutError, ConnectionError, OSError, CorruptCopyError, ValueError) as e:
        return SendResult(m.rank, m.step, False, f"{type(e).__name__}: {e}")


def replica_dirs(owner: FlashOwner, node: str) -> dict[int, Path]:
    """rank -> directory of `node`'s replicated copies held by this owner."""
    store = replica_store(node)
    return {r: owner.rank_dir(r, store) for r in owner.ranks(store)}
