"""Attacks through the buddy itself: a compromised buddy serves a lost node's replacement
weights of its own making, and a sender or buddy other than the ones the driver paired
takes part in replication.

Real sockets, real mutual TLS (certificates of one CA), real replica servers and flash
copies in /dev/shm; the forgery is done as a compromised buddy would, on its own disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.replicanodes import save_step, shm_owners
from unbroken.driver.certs import issue, make_ca
from unbroken.recovery.flashcopy import (
    data_path,
    list_copies,
    replica_store,
    seal,
    write_manifest,
)
from unbroken.recovery.flashowner import FlashOwner
from unbroken.recovery.replica import ReplicaServer, fetch_replica, send_copy
from unbroken.recovery.replicaauth import ReplicaAuth, ReplicaConfig

pytestmark = pytest.mark.integration
NODES = ("node-a", "node-b", "node-c", "node-a2")


@pytest.fixture
def owners() -> Iterator[dict[str, FlashOwner]]:
    with shm_owners("ub-origin", NODES) as out:
        yield out


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, ReplicaConfig]:
    make_ca(tmp_path)
    (tmp_path / "grants").write_text(json.dumps({"node-a": ["node:node-a2"]}))
    out = {}
    for n in NODES:
        crt, key = issue(tmp_path, f"node:{n}")
        auth = ReplicaAuth.tls(
            str(crt), str(key), str(tmp_path / "ca.pem"), grants_file=str(tmp_path / "grants")
        )
        out[n] = ReplicaConfig(timeout_s=10, auth=auth)
    return out


def _forge(buddy: FlashOwner, source: FlashOwner) -> None:
    """What a compromised buddy does on its own disk: put a copy of its own making (sealed,
    with a valid checksum) in the slot of node-a's newest replica, keeping whatever else
    lies beside it."""
    rank_dir = buddy.rank_dir(0, replica_store("node-a"))
    genuine = list_copies(rank_dir)[0]
    ref = source.newest(0)
    assert ref is not None
    forged = seal(ref)
    shutil.copyfile(ref.data_path, data_path(rank_dir, genuine.slot))
    write_manifest(rank_dir, genuine.slot, forged)


def test_a_buddy_cannot_serve_a_copy_the_lost_node_did_not_sign(
    owners: dict[str, FlashOwner], pki: dict[str, ReplicaConfig]
) -> None:
    a, b, c, a2 = (owners[n] for n in NODES)
    save_step(a, step=1)
    save_step(c, step=66)  # the buddy's own weights, as it would like node-a's replacement to run

    async def go() -> None:
        server = ReplicaServer(b, pki["node-b"])
        port = await server.start()
        try:
            sent = await send_copy(a.newest(0), "node-a", "127.0.0.1", port, config=pki["node-a"])  # type: ignore[arg-type]
            assert sent.ok, sent.error
            got = await fetch_replica(a2, "node-a", "127.0.0.1", port, config=pki["node-a2"])
            assert [r.manifest.step for r in got] == [1]  # the genuine copy restores
            rank_dir = b.rank_dir(0, replica_store("node-a"))
            origin = sorted(p.name for p in rank_dir.iterdir() if p.name.endswith(".origin"))

            # 1. its own copy in node-a's slot, node-a's signature of the old data beside it
            _forge(b, c)
            got = await fetch_replica(a2, "node-a", "127.0.0.1", port, config=pki["node-a2"])
            assert [r.manifest.step for r in got] == [], "the restorer took a forged copy"
            # 2. with no signature at all
            for name in origin:
                (rank_dir / name).unlink()
            got = await fetch_replica(a2, "node-a", "127.0.0.1", port, config=pki["node-a2"])
            assert got == []

            # 3. signed by the buddy's own (valid, same-CA) certificate, claiming node-a
            from unbroken.recovery import copysig

            forged = list_copies(rank_dir)[0]
            msha = hashlib.sha256(forged.manifest.to_bytes()).digest()
            dsha = hashlib.sha256(
                forged.data_path.read_bytes()[: forged.manifest.data_nbytes]
            ).digest()
            signer = pki["node-b"].auth.signer
            assert signer is not None
            rec = signer.sign("node-a", msha, dsha)
            copysig.record_path(rank_dir, forged.slot).write_bytes(copysig.dump(rec))
            got = await fetch_replica(a2, "node-a", "127.0.0.1", port, config=pki["node-a2"])
            assert got == []
            with pytest.raises(copysig.BadSignature, match="signed by node:node-b"):
                signer.verify("node-a", msha, dsha, rec)
        finally:
            await server.stop()

    asyncio.run(go())
    # what the replacement holds of node-a is the genuine step 1, never the forged 66
    assert [r.manifest.step for r in list_copies(a2.rank_dir(0, replica_store("node-a")))] == [1]


def test_copies_go_only_to_the_paired_buddy_and_it_takes_only_its_pair(
    owners: dict[str, FlashOwner], pki: dict[str, ReplicaConfig]
) -> None:
    a, b, c = owners["node-a"], owners["node-b"], owners["node-c"]
    save_step(a, step=3)
    save_step(c, step=5)

    async def go() -> None:
        srv_b, srv_c = ReplicaServer(b, pki["node-b"]), ReplicaServer(c, pki["node-c"])
        port_b, port_c = await srv_b.start(), await srv_c.start()
        try:
            # the driver paired node-a with node-b; something at another address (node-c,
            # a valid node of the CA) is not its buddy: node-a sends it nothing
            res = await send_copy(
                a.newest(0),  # type: ignore[arg-type]
                "node-a",
                "127.0.0.1",
                port_c,
                config=pki["node-a"],
                buddy_node="node-b",
            )
            assert not res.ok and "not node:node-b" in res.error, res
            assert c.ranks(replica_store("node-a")) == []
            # node-b, paired to take node-a's copies, refuses node-c's (sent as itself)
            srv_b.senders = {"node-a"}
            res = await send_copy(c.newest(0), "node-c", "127.0.0.1", port_b, config=pki["node-c"])  # type: ignore[arg-type]
            assert not res.ok and "takes copies only of ['node-a']" in res.error, res
            assert b.ranks(replica_store("node-c")) == []
            res = await send_copy(
                a.newest(0),  # type: ignore[arg-type]
                "node-a",
                "127.0.0.1",
                port_b,
                config=pki["node-a"],
                buddy_node="node-b",
            )
            assert res.ok, res.error
        finally:
            await srv_b.stop()
            await srv_c.stop()

    asyncio.run(go())
    held = b.newest(0, replica_store("node-a"))
    assert held is not None and held.manifest.step == 3
