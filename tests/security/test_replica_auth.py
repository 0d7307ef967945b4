"""Attacks on the buddy replica port: read a node's weights, plant a forged replica, make
the agent allocate gigabytes with one header, crash it with a bad header, exhaust it.

Real sockets, real TLS, a real replica server (for the memory test, in its own process so
its RSS can be read); each attack is answered with one error line and changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from unbroken.driver.certs import issue, make_ca
from unbroken.recovery import replica as replica_mod
from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import read_copy, read_manifest, replica_store, seal, slots
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.replica import PROTOCOL, ReplicaServer, fetch_replica, send_copy
from unbroken.recovery.replicaauth import ReplicaAuth, ReplicaConfig

pytestmark = pytest.mark.integration
KEY = b"the-jobs-replica-key-0123456789"
KEYED = ReplicaConfig(timeout_s=10, auth=ReplicaAuth.keyed(KEY))


@pytest.fixture
def owners(tmp_path: Path) -> Iterator[dict[str, FlashOwner]]:
    roots = {n: Path(f"/dev/shm/ub-sec-{os.getpid()}-{n}") for n in ("a", "b", "c")}
    try:
        yield {n: FlashOwner(FlashConfig(root=str(r), job="j")) for n, r in roots.items()}
    finally:
        for r in roots.values():
            subprocess.run(["rm", "-rf", str(r)], check=False)


def _copy(owner: FlashOwner, step: int = 1) -> None:
    w = FlashWriter(0, owner)
    try:
        w.save({"w": torch.full((4096,), float(step))}, step).wait()  # type: ignore[union-attr]
    finally:
        w.close()


def _raw(port: int, *lines: bytes, read_s: float = 5.0) -> list[dict[str, object]]:
    """Send raw lines as an attacker would (no credential); the answers, parsed."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        for line in lines:
            s.sendall(line)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return [json.loads(x) for x in data.splitlines() if x.strip()]


def test_unauthenticated_get_and_bad_headers_get_an_error_line(
    owners: dict[str, FlashOwner],
) -> None:
    a, b = owners["a"], owners["b"]
    _copy(a)

    async def go() -> None:
        server = ReplicaServer(b, KEYED)
        port = await server.start()
        try:
            assert (await send_copy(a.newest(0), "node-a", "127.0.0.1", port, config=KEYED)).ok  # type: ignore[arg-type]
            attacks = [
                b'{"op": "get", "node": "node-a"}\n',  # the issue's one-liner
                b'{"op": "get", "node": "node-a", "cnonce": "00", "mac": "00"}\n',
                b"not json at all\n",
                b'{"node": 7, "rank": "x"}\n',
                b"[1, 2]\n",
                b"x" * 10_000 + b"\n",
            ]
            for line in attacks:
                answers = await asyncio.to_thread(_raw, port, line)
                assert answers[0]["v"] == PROTOCOL  # the greeting
                assert answers[1:] and answers[-1]["ok"] is False, (line[:40], answers)
                assert "rank" not in json.dumps(answers[1:])  # no copy header, no data
            assert server.refused == len(attacks)
        finally:
            await server.stop()

    asyncio.run(go())


def test_forged_put_with_a_valid_checksum_is_not_stored(owners: dict[str, FlashOwner]) -> None:
    """The attacker has a real copy (valid checksum) but not the job's key."""
    evil, b = owners["c"], owners["b"]
    _copy(evil, step=99)

    async def go() -> None:
        server = ReplicaServer(b, KEYED)
        port = await server.start()
        try:
            wrong = ReplicaConfig(auth=ReplicaAuth.keyed(b"a-guessed-key-0123456789"))
            res = await send_copy(evil.newest(0), "node-a", "127.0.0.1", port, config=wrong)  # type: ignore[arg-type]
            assert not res.ok and "MAC" in res.error
        finally:
            await server.stop()

    asyncio.run(go())
    assert b.ranks(replica_store("node-a")) == [] or b.newest(0, replica_store("node-a")) is None


def _pki(tmp: Path) -> dict[str, ReplicaConfig]:
    make_ca(tmp)
    out = {}
    for n in ("node-a", "node-b", "node-c", "node-a2"):
        crt, key = issue(tmp, f"node:{n}")
        auth = ReplicaAuth.tls(str(crt), str(key), str(tmp / "ca.pem"), grants_file=str(tmp / "g"))
        out[n] = ReplicaConfig(timeout_s=10, auth=auth)
    return out


def test_mtls_put_only_as_yourself_get_only_by_the_node_or_a_granted_replacement(
    owners: dict[str, FlashOwner], tmp_path: Path
) -> None:
    a, b, c = owners["a"], owners["b"], owners["c"]
    cfg = _pki(tmp_path)
    _copy(a, step=1)
    _copy(c, step=66)

    async def go() -> None:
        server = ReplicaServer(b, cfg["node-b"])
        port = await server.start()
        try:
            ok = await send_copy(a.newest(0), "node-a", "127.0.0.1", port, config=cfg["node-a"])  # type: ignore[arg-type]
            assert ok.ok, ok.error
            # node-c (a valid certificate of the same CA) claims to be node-a
            forged = await send_copy(c.newest(0), "node-a", "127.0.0.1", port, config=cfg["node-c"])  # type: ignore[arg-type]
            assert not forged.ok and "may only come from node:node-a" in forged.error
            # the issue's GET, from a node with a valid certificate that is not node-a
            with pytest.raises(ValueError, match="served only to node:node-a"):
                await fetch_replica(c, "node-a", "127.0.0.1", port, config=cfg["node-c"])
            with pytest.raises(ValueError, match="served only to node:node-a"):
                await fetch_replica(c, "node-a", "127.0.0.1", port, config=cfg["node-a2"])
            # the operator names node-a2 as node-a's replacement on the buddy
            (tmp_path / "g").write_text(json.dumps({"node-a": ["node:node-a2"]}))
            got = await fetch_replica(c, "node-a", "127.0.0.1", port, config=cfg["node-a2"])
            assert [r.manifest.step for r in got] == [1]
            # no certificate at all: the TLS handshake fails; nothing is served
            plain = ReplicaConfig(timeout_s=2, auth=ReplicaAuth.keyed(KEY))
            with pytest.raises((OSError, ValueError, TimeoutError)):
                await fetch_replica(c, "node-a", "127.0.0.1", port, config=plain)
        finally:
            await server.stop()

    asyncio.run(go())
    stored = b.newest(0, replica_store("node-a"))
    assert stored is not None and stored.manifest.step == 1  # never the forged step 66


SERVER = """
import asyncio, sys
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.replicaauth import ReplicaAuth, ReplicaConfig
from unbroken.recovery.replica import ReplicaServer
async def main():
    auth = ReplicaAuth.keyed(sys.argv[2].encode())
    cfg = ReplicaConfig(timeout_s=5, max_connections=3, auth=auth)
    s = ReplicaServer(FlashOwner(FlashConfig(root=sys.argv[1], job="j")), cfg)
    print(await s.start(), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _signed_header(fields: dict[str, object], greeting: dict[str, object]) -> bytes:
    """A header with a valid MAC: this attacker holds the job's key."""
    import hmac

    cnonce = os.urandom(16)
    obj = {**fields, "cnonce": cnonce.hex()}
    body = json.dumps(obj, sort_keys=True).encode()
    bind = bytes.fromhex(str(greeting["nonce"])) + cnonce
    mac = hmac.new(KEY, b"c2s" + bind + (0).to_bytes(8, "big") + body, hashlib.sha256)
    return json.dumps({**obj, "mac": mac.hexdigest()}).encode() + b"\n"


def test_huge_declared_copy_allocates_nothing_and_connections_are_capped(
    tmp_path: Path, owners: dict[str, FlashOwner]
) -> None:
    _copy(owners["a"])
    real = owners["a"].newest(0)
    assert real is not None
    root = f"/dev/shm/ub-sec-{os.getpid()}-srv"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, root, KEY.decode()],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "server.log", "wb"),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        rss0 = psutil.Process(proc.pid).memory_info().rss
        free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
        # a manifest that is valid but for its size; the issue's 64 GiB first
        for dlen, expect in ((64 << 30, "does not fit"), (1 << 40, "exceeds the limit")):
            if dlen < free:
                continue
            manifest = dataclasses.replace(real.manifest, data_nbytes=dlen).to_bytes()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                f = s.makefile("rwb")
                greeting = json.loads(f.readline())
                head = {"op": "put", "node": "node-a", "rank": 0, "data_len": dlen}
                head |= {"manifest_len": len(manifest)}
                head |= {"manifest_sha256": hashlib.sha256(manifest).hexdigest()}
                f.write(_signed_header(head, greeting) + manifest)
                f.flush()
                answer = json.loads(f.readline())
                f.close()
            assert answer["ok"] is False and expect in str(answer["error"]), answer
        # 1 GiB that would fit, of which 1 MiB arrives: streamed, nothing is pre-allocated
        dlen = 1 << 30
        manifest = dataclasses.replace(real.manifest, data_nbytes=dlen).to_bytes()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            f = s.makefile("rwb")
            greeting = json.loads(f.readline())
            head = {"op": "put", "node": "node-a", "rank": 0, "data_len": dlen}
            head |= {"manifest_len": len(manifest)}
            head |= {"manifest_sha256": hashlib.sha256(manifest).hexdigest()}
            f.write(_signed_header(head, greeting) + manifest + b"z" * (1 << 20))
            f.flush()
            time.sleep(0.5)
            rss = psutil.Process(proc.pid).memory_info().rss
            used = sum(p.stat().st_blocks * 512 for p in Path(root).rglob("*.data"))
            assert used < 64 << 20, f"{used >> 20} MiB of shm taken before the data arrived"
            f.close()
        assert rss - rss0 < 64 << 20, f"RSS grew {(rss - rss0) >> 20} MiB on a declared size"
        time.sleep(0.2)
        grown = psutil.Process(proc.pid).memory_info().rss - rss0
        assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB on declared sizes alone"
        # streams beyond the cap (3 authenticated ones, stalled in their data) are answered
        # "busy" at once
        idle = []
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            f = s.makefile("rwb")
            greeting = json.loads(f.readline())
            head = {"op": "put", "node": "node-a", "rank": 0, "data_len": dlen}
            head |= {"manifest_len": len(manifest)}
            head |= {"manifest_sha256": hashlib.sha256(manifest).hexdigest()}
            f.write(_signed_header(head, greeting) + manifest)
            f.flush()
            idle.append(s)
        time.sleep(0.3)
        fetch = ReplicaConfig(timeout_s=5, auth=ReplicaAuth.keyed(KEY))
        owner = FlashOwner(FlashConfig(root=f"{root}-fetcher", job="j"))
        try:
            with pytest.raises(ValueError, match="refused the fetch: busy"):
                asyncio.run(fetch_replica(owner, "node-a", "127.0.0.1", port, config=fetch))
        finally:
            shutil.rmtree(f"{root}-fetcher", ignore_errors=True)
        for s in idle:
            s.close()
        assert proc.poll() is None
        assert "Traceback" not in (tmp_path / "server.log").read_text()
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["rm", "-rf", root], check=False)


def test_made_up_manifest_entries_do_not_pile_up_in_the_parse_cache() -> None:
    """A peer's manifests, each with a different (large) entries line, parse, but what the
    reader keeps of them stays under its byte bound; a huge line is not kept at all."""
    import zlib

    from unbroken.recovery import flashcopy
    from unbroken.recovery.flashcopy import ENTRIES_CACHE_BYTES, Manifest

    def forged(i: int, n: int) -> bytes:
        head = json.dumps(
            {"version": 2, "rank": 0, "step": i, "generation": i, "data_nbytes": 0,
             "checksum": 0, "checksum_algo": "xxh3_64", "objects": {}, "blobs": [],
             "meta": {}, "created_unix": 0.0},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        rows = [[f"w{i}_{j}" + "x" * 200, "float32", [1], 0, 4, [1], [0]] for j in range(n)]
        body = head + b"\n" + json.dumps(rows, separators=(",", ":")).encode()
        return body + b"\n" + f"{zlib.crc32(body):08x}".encode()

    for i in range(60):  # ~250 KB each: 15 MB of distinct lines in all
        assert Manifest.from_bytes(forged(i, 1000)).step == i
        assert sum(map(len, flashcopy._ENTRIES.parsed)) <= ENTRIES_CACHE_BYTES
    huge = Manifest.from_bytes(forged(99, 12000))  # ~2.8 MB: over a quarter of the bound
    assert len(huge.entries) == 12000
    assert all(len(k) < ENTRIES_CACHE_BYTES // 4 for k in flashcopy._ENTRIES.parsed)


def test_made_up_small_value_keys_do_not_pile_up_and_a_bad_index_is_corrupt() -> None:
    """Version 3 manifests from a peer: distinct (large) keys lines stay under the parse
    cache's byte bound; an index that is not hex, or names a blob that is not there, makes
    the copy corrupt, never an exception of another kind."""
    import zlib

    from unbroken.recovery import flashcopy
    from unbroken.recovery.flashcopy import ENTRIES_CACHE_BYTES, CorruptCopyError, Manifest

    def forged(i: int, n: int, index: str) -> bytes:
        head = json.dumps(
            {"version": 3, "rank": 0, "step": i, "generation": i, "data_nbytes": 0,
             "checksum": 0, "checksum_algo": "xxh3_64", "object_index": index,
             "blobs": ["AA=="], "meta": {}, "created_unix": 0.0},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        keys = json.dumps([f"k{i}_{j}" + "x" * 200 for j in range(n)]).encode()
        body = head + b"\n[]\n" + keys
        return body + b"\n" + f"{zlib.crc32(body):08x}".encode()

    for i in range(60):  # ~200 KB of keys each: 12 MB of distinct lines in all
        assert Manifest.from_bytes(forged(i, 1000, "00" * 1000)).step == i
        assert sum(map(len, flashcopy._KEYS.parsed)) <= ENTRIES_CACHE_BYTES
    for index in ("zz", "01", "00"):  # not hex; no blob 1; too short for 2 keys
        with pytest.raises(CorruptCopyError):
            Manifest.from_bytes(forged(99, 2, index))


def test_a_buddys_made_up_plans_do_not_pile_up_and_a_plan_id_stays_in_its_directory(
    tmp_path: Path,
) -> None:
    """Slot manifests name their plan lines by hash (`plan-{id}.lines`, written from what a
    buddy sent): distinct plans the agent reads stay under the cache's byte bound, a huge
    one is not kept, and an id that is not 16 hex digits is a corrupt copy, never a path."""
    import xxhash

    from unbroken.recovery import flashcopy
    from unbroken.recovery.flashcopy import (
        ENTRIES_CACHE_BYTES,
        CorruptCopyError,
        plan_path,
        read_plan,
    )

    flashcopy._plans.clear()
    for i in range(60):  # ~300 KB each: 18 MB of distinct plans in all
        lines = b"[]\n" + json.dumps([f"k{i}_{j}" + "x" * 300 for j in range(1000)]).encode()
        plan_id = xxhash.xxh3_64_hexdigest(lines)
        plan_path(tmp_path, plan_id).write_bytes(lines)
        assert read_plan(tmp_path, plan_id) == lines
        assert sum(map(len, flashcopy._plans.values())) <= ENTRIES_CACHE_BYTES
    huge = b"[]\n" + json.dumps(["x" * 1000] * 3000).encode()  # ~3 MB
    huge_id = xxhash.xxh3_64_hexdigest(huge)
    plan_path(tmp_path, huge_id).write_bytes(huge)
    assert read_plan(tmp_path, huge_id) == huge and huge_id not in flashcopy._plans
    from unbroken.recovery.flashcopy import Manifest

    head = json.dumps(
        {"version": 4, "rank": 0, "step": 1, "generation": 1, "data_nbytes": 0,
         "checksum": 0, "checksum_algo": "xxh3_64", "object_index": "", "blobs": [],
         "meta": {}, "created_unix": 0.0, "plan": "../../etc/passwd"},
        separators=(",", ":"),
    ).encode()  # fmt: skip
    import zlib

    raw = head + b"\n" + f"{zlib.crc32(head):08x}".encode()
    with pytest.raises(CorruptCopyError):
        Manifest.from_bytes(raw, lambda pid: read_plan(tmp_path, pid))
    with pytest.raises(CorruptCopyError):  # off the wire: no plan resolved at all
        Manifest.from_bytes(raw)


def test_a_copy_sent_unsealed_is_refused_as_corrupt(owners: dict[str, FlashOwner]) -> None:
    """A writer's copy carries no checksum (`UNSEALED`) until the sender seals it; a peer
    that streams one without (a buggy or hostile agent holding the job's key) gets it
    refused as corrupt, and the buddy keeps nothing."""
    from unbroken.recovery.flashcopy import UNSEALED
    from unbroken.recovery.replica import _Framing, _Origin, _stream_into_slot

    a, b = owners["a"], owners["b"]
    _copy(a, step=7)
    ref = a.newest(0)
    assert ref is not None and ref.manifest.checksum == UNSEALED
    data = ref.data_path.read_bytes()[: ref.manifest.data_nbytes]

    async def go() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(data + b'{"origin": {}}\n')
        reader.feed_eof()
        rank_dir = b.rank_dir(0, replica_store("node-a"))
        framing = _Framing(None, b"", b"", server=True)
        origin = _Origin("node-a", b"", KEYED.auth.signer)
        assert await _stream_into_slot(reader, framing, rank_dir, ref.manifest, 0, origin) is None

    asyncio.run(go())
    assert b.newest(0, replica_store("node-a")) is None


def test_a_copy_refused_after_its_bytes_landed_leaves_no_valid_slot(
    owners: dict[str, FlashOwner],
) -> None:
    """The buddy writes a received copy over its free slot in place (no truncation first).
    A copy whose bytes fail the checksum after they were written (one bit flipped in
    transit) must leave that slot without a manifest, so the older bytes under it never
    pass for a copy, and the newest copy intact and verified."""
    a, b = owners["a"], owners["b"]
    store = replica_store("node-a")

    async def go() -> None:
        server = ReplicaServer(b, KEYED)
        port = await server.start()
        try:
            for step in (1, 2):
                _copy(a, step)
                assert (await send_copy(a.newest(0), "node-a", "127.0.0.1", port, config=KEYED)).ok  # type: ignore[arg-type]
            _copy(a, 3)
            bad = await send_copy(
                a.newest(0),  # type: ignore[arg-type]
                "node-a",
                "127.0.0.1",
                port,
                config=KEYED,
                flip_bit_at=100,
            )
            assert not bad.ok and bad.corrupt, bad
        finally:
            await server.stop()

    asyncio.run(go())
    refs = b.copies(store)[0]
    assert [r.manifest.step for r in refs] == [2], refs
    rank_dir = b.rank_dir(0, store)
    assert slots(rank_dir) == [0, 1]  # the refused copy's slot: bytes, no manifest
    assert read_manifest(rank_dir, 1 - refs[0].slot) is None
    read_copy(refs[0]).close()  # the newest copy still verifies against its checksum


def test_idle_connections_without_a_credential_do_not_hold_the_buddy(
    owners: dict[str, FlashOwner],
) -> None:
    """Eight idle TCP connections used to take every stream slot for the whole transfer
    timeout (60 s): no buddy replication meanwhile. Now a connection takes a slot only
    once authenticated, must authenticate within the header deadline, and 200 of them
    leave the node's own copy going through at once."""
    a, b = owners["a"], owners["b"]
    _copy(a)
    ref = a.newest(0)
    assert ref is not None

    async def go() -> None:
        cfg = dataclasses.replace(KEYED, timeout_s=60, header_timeout_s=2, max_pending=32)
        server = ReplicaServer(b, cfg)
        port = await server.start()
        idle = []
        try:
            for _ in range(200):
                idle.append(await asyncio.open_connection("127.0.0.1", port))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            result = await send_copy(ref, "node-a", "127.0.0.1", port, config=KEYED)
            assert result.ok, result
            assert time.monotonic() - t0 < 5  # not after the idle ones' 60 s
            assert len(server._pending) <= 32
            # one that never authenticates is answered and closed after the header deadline
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await reader.readline()  # the greeting
            answer = json.loads(await asyncio.wait_for(reader.readline(), 10))
            assert answer["ok"] is False and "no authenticated header" in answer["error"]
            writer.close()
        finally:
            for _, w in idle:
                w.close()
            await server.stop()

    asyncio.run(go())


def test_data_altered_in_transit_is_refused_even_when_its_checksum_still_matches(
    owners: dict[str, FlashOwner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data chunks carry no MAC of their own (v5): what binds them is the SHA-256 the
    origin node signed, in the MAC'd origin line. xxh3 is no defence against a forger, so
    here the buddy's checksum is made to pass whatever arrives (an attacker who found a
    collision): a byte altered in transit is still refused, by the signature, and the
    buddy's earlier replica stays the newest."""
    a, b = owners["a"], owners["b"]
    store = replica_store("node-a")

    async def go() -> None:
        server = ReplicaServer(b, KEYED)
        port = await server.start()
        try:
            _copy(a, 1)
            assert (await send_copy(a.newest(0), "node-a", "127.0.0.1", port, config=KEYED)).ok  # type: ignore[arg-type]
            _copy(a, 2)
            want = seal(a.newest(0)).checksum  # type: ignore[arg-type]

            class Colliding:  # every stream hashes to the manifest's checksum
                def update(self, _chunk: bytes) -> None:
                    pass

                def intdigest(self) -> int:
                    return want

            monkeypatch.setattr(replica_mod, "new_hasher", Colliding)
            bad = await send_copy(
                a.newest(0),  # type: ignore[arg-type]
                "node-a",
                "127.0.0.1",
                port,
                config=KEYED,
                flip_bit_at=5000,
            )
            assert not bad.ok and not bad.corrupt, bad
            assert "not the data it signed" in bad.error, bad.error
        finally:
            await server.stop()

    asyncio.run(go())
    assert [r.manifest.step for r in b.copies(store)[0]] == [1]
