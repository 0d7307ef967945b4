"""Without TLS, a holder of the job's replica key cannot speak for another node on the buddy
stream: it cannot store copies as another node, pose as a node's buddy, or sign a copy as
the node it claims to be from (recovery/nodekey.py).

Every node holds the same job key, as `unbroken up` deploys it; each also has a key of its
own derived from its bound node token, whose public half the driver hands out. Real
sockets, real replica servers and flash copies in /dev/shm; the attacker is a node of the
job with the job key (and its own token), as a compromised node would be.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator

import pytest

from tests.replicanodes import save_step, shm_owners
from unbroken.recovery import copysig
from unbroken.recovery.flashcopy import list_copies, replica_store
from unbroken.recovery.flashowner import FlashOwner
from unbroken.recovery.nodekey import NodeKey
from unbroken.recovery.replica import ReplicaServer, fetch_replica, send_copy
from unbroken.recovery.replicaauth import ReplicaAuth, ReplicaConfig

pytestmark = pytest.mark.integration
NODES = ("node-a", "node-b", "node-c", "node-a2")
JOB_KEY = b"test-job-replica-key-0123456789"


@pytest.fixture
def owners() -> Iterator[dict[str, FlashOwner]]:
    with shm_owners("ub-nodekey", NODES) as out:
        yield out


def _keys() -> dict[str, NodeKey]:
    return {n: NodeKey.derive(f"token-of-{n}-0123456789", n) for n in NODES}


def _cfg(node: str, keys: dict[str, NodeKey], *, knows: tuple[str, ...] = ()) -> ReplicaConfig:
    """`node`'s replica config: the job key, its own key, and the public keys the driver
    handed it (`knows`)."""
    auth = ReplicaAuth.keyed(JOB_KEY, node_key=keys[node])
    for n in knows:
        auth.learn(n, keys[n].public)
    return ReplicaConfig(timeout_s=10, auth=auth)


def test_a_job_key_holder_cannot_store_copies_as_another_node(
    owners: dict[str, FlashOwner],
) -> None:
    """node-c holds the job key and its own node key; node-b was paired to take node-a's
    copies. Before node keys, node-c's copy named node-a was stored as node-a's."""
    keys = _keys()
    a, b, c = owners["node-a"], owners["node-b"], owners["node-c"]
    save_step(a, step=3)
    save_step(c, step=66)  # the weights node-c would like node-a's replacement to run

    async def go() -> None:
        srv = ReplicaServer(b, _cfg("node-b", keys, knows=("node-a",)))
        srv.senders = {"node-a"}  # the driver's pairing (StartWorkers.replicas_from)
        port = await srv.start()
        try:
            # 1. as node-a, with node-c's own key (the header's and the copy's signatures)
            res = await send_copy(
                c.newest(0), "node-a", "127.0.0.1", port, config=_cfg("node-c", keys)
            )  # type: ignore[arg-type]
            assert not res.ok and "did not prove it is node 'node-a'" in res.error, res
            # 2. as node-a with the job key alone (no node key: only the MAC)
            bare = ReplicaConfig(timeout_s=10, auth=ReplicaAuth.keyed(JOB_KEY))
            res = await send_copy(c.newest(0), "node-a", "127.0.0.1", port, config=bare)  # type: ignore[arg-type]
            assert not res.ok and "did not prove it is node 'node-a'" in res.error, res
            assert b.ranks(replica_store("node-a")) == []
            # 3. as itself: node-b takes only the node the driver paired with it
            res = await send_copy(
                c.newest(0), "node-c", "127.0.0.1", port, config=_cfg("node-c", keys)
            )  # type: ignore[arg-type]
            assert not res.ok and "takes copies only of ['node-a']" in res.error, res
            assert b.ranks(replica_store("node-c")) == []
            # node-a itself is taken
            res = await send_copy(
                a.newest(0),  # type: ignore[arg-type]
                "node-a",
                "127.0.0.1",
                port,
                config=_cfg("node-a", keys, knows=("node-b",)),
                buddy_node="node-b",
            )
            assert res.ok, res.error
        finally:
            await srv.stop()

    asyncio.run(go())
    held = b.newest(0, replica_store("node-a"))
    assert held is not None and held.manifest.step == 3


def test_a_sender_knows_when_the_server_that_stored_its_copy_is_not_its_buddy(
    owners: dict[str, FlashOwner],
) -> None:
    """node-a was paired with node-b; node-c (job key, its own key) listens where node-a
    sends. Before node keys node-a counted the copy as at its buddy."""
    keys = _keys()
    a, c = owners["node-a"], owners["node-c"]
    save_step(a, step=4)

    async def go() -> None:
        impostor = ReplicaServer(c, _cfg("node-c", keys))
        port = await impostor.start()
        try:
            res = await send_copy(
                a.newest(0),  # type: ignore[arg-type]
                "node-a",
                "127.0.0.1",
                port,
                config=_cfg("node-a", keys, knows=("node-b",)),
                buddy_node="node-b",
            )
            assert not res.ok, "the sender counted a copy at an impostor as at its buddy"
            assert "did not prove it is node 'node-b'" in res.error, res
        finally:
            await impostor.stop()

    asyncio.run(go())


def test_a_restorer_refuses_a_copy_not_signed_with_the_lost_nodes_own_key(
    owners: dict[str, FlashOwner],
) -> None:
    """A compromised buddy (node-b, job key) puts weights of its own making in node-a's slot
    and signs them as node-a with what it holds: the job key's MAC, and its own node key.
    The replacement (node-a2, handed node-a's public key) takes neither; before node keys
    the MAC passed."""
    keys = _keys()
    a, b, a2 = owners["node-a"], owners["node-b"], owners["node-a2"]
    save_step(a, step=1)

    async def go() -> None:
        srv = ReplicaServer(b, _cfg("node-b", keys, knows=("node-a",)))
        port = await srv.start()
        restorer = _cfg("node-a2", keys, knows=("node-a",))
        try:
            sent = await send_copy(
                a.newest(0), "node-a", "127.0.0.1", port, config=_cfg("node-a", keys)
            )  # type: ignore[arg-type]
            assert sent.ok, sent.error
            got = await fetch_replica(a2, "node-a", "127.0.0.1", port, config=restorer)
            assert [r.manifest.step for r in got] == [1]  # the genuine copy restores

            rank_dir = b.rank_dir(0, replica_store("node-a"))
            held = list_copies(rank_dir)[0]
            data = bytearray(held.data_path.read_bytes())
            data[100] ^= 0xFF  # the buddy's own weights, resealed below
            held.data_path.write_bytes(bytes(data))
            from unbroken.recovery.flashcopy import seal, write_manifest

            forged = seal(held)
            write_manifest(rank_dir, held.slot, forged)
            msha = hashlib.sha256(forged.to_bytes()).digest()
            dsha = hashlib.sha256(bytes(data[: forged.data_nbytes])).digest()
            for signer in (
                copysig.CopySigner.keyed(JOB_KEY),
                copysig.CopySigner.keyed(JOB_KEY, keys["node-b"]),
            ):
                rec = signer.sign("node-a", msha, dsha)
                copysig.record_path(rank_dir, held.slot).write_bytes(copysig.dump(rec))
                got = await fetch_replica(a2, "node-a", "127.0.0.1", port, config=restorer)
                assert got == [], "the restorer took a copy node-a did not sign"
                with pytest.raises(copysig.BadSignature, match="not signed with node 'node-a'"):
                    signer.verify("node-a", msha, dsha, rec, keys["node-a"].public)
        finally:
            await srv.stop()

    asyncio.run(go())
    steps = [r.manifest.step for r in list_copies(a2.rank_dir(0, replica_store("node-a")))]
    assert steps == [1]  # what the replacement holds is node-a's genuine copy


def test_a_node_key_is_its_tokens_and_its_own() -> None:
    """The same token and node give the same key (a restarted agent's copies at its buddy
    still verify); another node or token another key."""
    k = NodeKey.derive("tok-0123456789", "n1")
    assert k.public == NodeKey.derive("tok-0123456789", "n1").public
    assert len(k.public) == 32
    assert k.public != NodeKey.derive("tok-0123456789", "n2").public
    assert k.public != NodeKey.derive("tok-0123456789x", "n1").public
    with pytest.raises(ValueError, match="token"):
        NodeKey.derive("", "n1")


def test_a_hostile_ident_is_no_proof_and_raises_nothing() -> None:
    """Whatever a peer puts in a header's `ident` (no string, not hex, too long, another
    stream's signature, a signature for another node) proves nothing, quietly: the stream is
    refused with its error line, the server does not fail."""
    from unbroken.recovery import nodekey

    k = NodeKey.derive("tok-0123456789", "n1")
    s, c = b"s" * 16, b"c" * 16
    good = k.sign_stream("client", s, c)
    assert nodekey.proves(good, k.public, "client", s, c, "n1")
    for sig in (None, 7, ["x"], "zz", "ab" * 5000, good[:-2], k.sign_stream("server", s, c)):
        assert not nodekey.proves(sig, k.public, "client", s, c, "n1"), sig
    assert not nodekey.proves(good, k.public, "client", s, b"d" * 16, "n1")  # another stream
    assert not nodekey.proves(good, k.public, "client", s, c, "n2")  # another node
    assert not nodekey.proves(good, b"\x00" * 31, "client", s, c, "n1")  # a malformed key
