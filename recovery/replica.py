"""Buddy replicas: each node's newest flash copies, kept in another node's shared memory.

When a node is lost, its flash copies go with it. Each agent therefore sends its ranks'
newest completed copies to a buddy agent (node i -> node i+1 of a ring, `ring`) in the
background, over a plain asyncio TCP stream. The buddy verifies the data against the
manifest's checksum before storing it (double-buffered, like a local copy) under the
store `replica-<node>`, so a replacement node can restore from it. A copy that fails the
checksum is refused and never stored.

Wire format, per copy: one JSON header line (`node`, `rank`, `manifest_len`,
`data_len`), the manifest, the data; the buddy answers one JSON line (`ok`, `error`).
A replacement node gets a lost node's copies back with `fetch_replica`: the header line
`{"op": "get", "node": ...}` makes the buddy stream each rank's newest replica (a header
line, the manifest, the data per copy, then `{"done": true}`); the fetcher verifies every
checksum before storing a copy. Sizes are bounded by `ReplicaConfig.max_copy_bytes`;
every read has a deadline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from unbroken.recovery.flashcopy import (
    CopyRef,
    CorruptCopyError,
    Manifest,
    list_copies,
    new_hasher,
    read_manifest,
    replica_store,
    write_raw_copy,
)
from unbroken.recovery.flashowner import FlashOwner

log = structlog.get_logger(__name__)

SEND_CHUNK = 8 << 20
MAX_HEADER = 4096


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


@dataclass(kw_only=True, slots=True)
class ReplicaConfig:
    """Limits of the replica transfer."""

    timeout_s: float = 60.0  # whole transfer of one copy, either side
    max_copy_bytes: int = 64 << 30

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"ReplicaConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_copy_bytes <= 0:
            raise ValueError(f"ReplicaConfig.max_copy_bytes must be > 0, got {self.max_copy_bytes}")


@dataclass(frozen=True, slots=True)
class SendResult:
    """The buddy's verdict on one copy."""

    rank: int
    step: int
    ok: bool
    error: str = ""


class ReplicaServer:
    """The buddy side: receives copies over TCP, verifies, stores them in its shm."""

    def __init__(self, owner: FlashOwner, config: ReplicaConfig | None = None) -> None:
        self.owner = owner
        self.config = config or ReplicaConfig()
        self._server: asyncio.Server | None = None
        self.received = 0
        self.refused = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; returns the bound port (pass 0 for a free one)."""
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and wait for the server to close."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reply = await asyncio.wait_for(self._dispatch(reader, writer), self.config.timeout_s)
            if reply is None:  # a fetch: the copies are sent already
                return
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if not reply["ok"]:
            self.refused += 1
            log.warning("replica.refused", error=reply["error"])
        try:
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _dispatch(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict[str, object] | None:
        line = await reader.readline()
        if len(line) > MAX_HEADER or not line.endswith(b"\n"):
            raise ValueError("replica header too long or missing")
        head = json.loads(line)
        if head.get("op", "put") == "get":
            await self._serve_get(str(head["node"]), writer)
            writer.close()
            return None
        return await self._receive(reader, head)

    async def _serve_get(self, node: str, writer: asyncio.StreamWriter) -> None:
        store = replica_store(node)
        sent = 0
        for rank in self.owner.ranks(store):
            refs = list_copies(self.owner.rank_dir(rank, store))
            if not refs:
                continue
            ref = refs[0]
            m = ref.manifest
            head = m.to_bytes()
            hdr = {"rank": rank, "manifest_len": len(head), "data_len": m.data_nbytes}
            writer.write(json.dumps(hdr).encode() + b"\n" + head)
            await _stream_file(ref, writer)
            sent += 1
        writer.write(json.dumps({"done": True, "count": sent}).encode() + b"\n")
        await writer.drain()
        log.info("replica.served", node=node, copies=sent)

    async def _receive(
        self, reader: asyncio.StreamReader, head: dict[str, object]
    ) -> dict[str, object]:
        node, rank = str(head["node"]), int(head["rank"])  # type: ignore[call-overload]
        mlen, dlen = int(head["manifest_len"]), int(head["data_len"])  # type: ignore[call-overload]
        if (
            not 0 < mlen <= self.config.max_copy_bytes
            or not 0 <= dlen <= self.config.max_copy_bytes
        ):
            raise ValueError(f"copy of {dlen} bytes exceeds the limit {self.config.max_copy_bytes}")
        manifest = Manifest.from_bytes(await reader.readexactly(mlen))
        view, crc = await _read_data(reader, dlen)
        if manifest.rank != rank or manifest.data_nbytes != dlen:
            return {"ok": False, "error": "header does not match the manifest"}
        if crc != manifest.checksum:
            return {"ok": False, "error": f"checksum mismatch for rank {rank} step {manifest.step}"}
        rank_dir = self.owner.rank_dir(rank, replica_store(node))
        await asyncio.to_thread(write_raw_copy, rank_dir, manifest, view)
        self.received += 1
        log.info("replica.stored", node=node, rank=rank, step=manifest.step, bytes=dlen)
        return {"ok": True, "error": ""}


async def _read_data(reader: asyncio.StreamReader, nbytes: int) -> tuple[memoryview, int]:
    """Read `nbytes` of copy data; returns them and their checksum."""
    data = bytearray(nbytes)
    view = memoryview(data)
    got, hasher = 0, new_hasher()
    while got < nbytes:
        chunk = await reader.read(min(SEND_CHUNK, nbytes - got))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", nbytes - got)
        view[got : got + len(chunk)] = chunk
        hasher.update(chunk)
        got += len(chunk)
    return view, hasher.intdigest()


async def _stream_file(ref: CopyRef, writer: asyncio.StreamWriter) -> None:
    """Write a copy's data bytes to `writer`."""
    left = ref.manifest.data_nbytes
    with open(ref.data_path, "rb") as f:
        while left:
            chunk = f.read(min(SEND_CHUNK, left))
            if not chunk:
                raise CorruptCopyError(f"{ref.data_path} is shorter than its manifest")
            writer.write(chunk)
            await writer.drain()
            left -= len(chunk)


async def fetch_replica(
    owner: FlashOwner,
    node: str,
    host: str,
    port: int,
    *,
    config: ReplicaConfig | None = None,
) -> list[CopyRef]:
    """Get `node`'s replicated copies back from its buddy into `owner`'s `replica-<node>`.

    Used by a node that replaces `node`: its workers then restore from these copies.
    Every copy is verified against its checksum before it is stored; a bad one is skipped
    (and logged), never stored.

    Args:
        owner: this node's flash store.
        node: the lost node whose copies the buddy holds.
        host: the buddy's replica server.
        port: its port.
        config: limits (`timeout_s` bounds the whole fetch).

    Returns:
        The copies stored.

    Raises:
        ConnectionError, OSError, TimeoutError: the buddy is unreachable or too slow.
        ValueError: the buddy sent a malformed header.
    """
    cfg = config or ReplicaConfig()
    store = replica_store(node)

    async def go() -> list[CopyRef]:
        reader, writer = await asyncio.open_connection(host, port)
        stored: list[CopyRef] = []
        try:
            writer.write(json.dumps({"op": "get", "node": node}).encode() + b"\n")
            await writer.drain()
            while True:
                line = await reader.readline()
                if len(line) > MAX_HEADER or not line.endswith(b"\n"):
                    raise ValueError("replica fetch: header too long or missing")
                head = json.loads(line)
                if head.get("done"):
                    return stored
                rank, mlen, dlen = (
                    int(head["rank"]),
                    int(head["manifest_len"]),
                    int(head["data_len"]),
                )
                if not 0 < mlen <= cfg.max_copy_bytes or not 0 <= dlen <= cfg.max_copy_bytes:
                    raise ValueError(f"replica fetch: copy of {dlen} bytes exceeds the limit")
                manifest = Manifest.from_bytes(await reader.readexactly(mlen))
                view, crc = await _read_data(reader, dlen)
                if crc != manifest.checksum or manifest.rank != rank:
                    log.warning("replica.fetch_refused", node=node, rank=rank, step=manifest.step)
                    continue
                rank_dir = owner.rank_dir(rank, store)
                stored.append(await asyncio.to_thread(write_raw_copy, rank_dir, manifest, view))
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
) -> SendResult:
    """Stream one flash copy to the buddy at `host:port` and return its verdict.

    The slot is read while the worker may overwrite it: if it changed during the send the
    buddy's checksum check refuses it, and the result says so.

    Args:
        ref: the copy (typically `FlashOwner.newest(rank)`).
        node: this node's name (the buddy stores under `replica-<node>`).
        host: the buddy's replica server.
        port: its port.
        config: limits.
        flip_bit_at: fault injection: flip one bit at this data offset in transit.
    """
    cfg = config or ReplicaConfig()
    m = ref.manifest

    async def go() -> SendResult:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            head = m.to_bytes()
            hdr = {
                "node": node,
                "rank": m.rank,
                "manifest_len": len(head),
                "data_len": m.data_nbytes,
            }
            writer.write(json.dumps(hdr).encode() + b"\n" + head)
            with open(ref.data_path, "rb") as f:
                sent = 0
                while sent < m.data_nbytes:
                    chunk = f.read(min(SEND_CHUNK, m.data_nbytes - sent))
                    if not chunk:
                        raise CorruptCopyError(f"{ref.data_path} is shorter than its manifest")
                    if flip_bit_at is not None and sent <= flip_bit_at < sent + len(chunk):
                        b = bytearray(chunk)
                        b[flip_bit_at - sent] ^= 0x01
                        chunk = bytes(b)
                    writer.write(chunk)
                    await writer.drain()
                    sent += len(chunk)
            reply = json.loads(await reader.readline())
        finally:
            writer.close()
        ok = bool(reply.get("ok"))
        if ok and read_manifest(ref.rank_dir, ref.slot) != m:
            return SendResult(m.rank, m.step, False, "slot overwritten during the send")
        return SendResult(m.rank, m.step, ok, str(reply.get("error", "")))

    try:
        return await asyncio.wait_for(go(), cfg.timeout_s)
    except (TimeoutError, ConnectionError, OSError, CorruptCopyError) as e:
        return SendResult(m.rank, m.step, False, f"{type(e).__name__}: {e}")


class ReplicaSender:
    """The sending agent's side: ships each local rank's newest copy once, when it changes.

    The agent calls `tick()` from a background task after saves complete (or on a timer).
    """

    def __init__(
        self,
        owner: FlashOwner,
        node: str,
        buddy: tuple[str, int],
        config: ReplicaConfig | None = None,
    ) -> None:
        self.owner = owner
        self.node = node
        self.buddy = buddy
        self.config = config or ReplicaConfig()
        self._sent: dict[int, int] = {}  # rank -> generation acknowledged by the buddy

    async def tick(self) -> list[SendResult]:
        """Send every rank's newest copy the buddy does not have yet."""
        results = []
        for rank in self.owner.ranks():
            ref = self.owner.newest(rank)
            if ref is None or self._sent.get(rank) == ref.manifest.generation:
                continue
            host, port = self.buddy
            res = await send_copy(ref, self.node, host, port, config=self.config)
            if res.ok:
                self._sent[rank] = ref.manifest.generation
            else:
                log.warning("replica.send_failed", rank=rank, step=res.step, error=res.error)
            results.append(res)
        return results


def replica_dirs(owner: FlashOwner, node: str) -> dict[int, Path]:
    """rank -> directory of `node`'s replicated copies held by this owner."""
    store = replica_store(node)
    return {r: owner.rank_dir(r, store) for r in owner.ranks(store)}
