"""Key-value stores of the torchrun rendezvous: compare-and-set on mod revisions.

`KV` is the narrow interface driver/rendezvous.py needs (get, put, compare-and-set on a
key's mod revision, delete, count). `EtcdKV` keeps the keys in the job's etcd v3 and
fences every write on the leader key's lease, as the event log does, so a deposed
driver can never change the rendezvous; `MemoryKV` is the in-memory reference, used by
the driver's `--event-log memory` mode and the unit tests.
"""

from __future__ import annotations

import abc
from typing import Any

import grpc
from aetcd import rpc

from unbroken.driver.etcdclient import Keys, classify, cmp_op, delete_op, first_kv, get_op, put_op
from unbroken.driver.eventlog import EventLog, EventLogError, NotLeaderError


class UnknownOutcomeError(EventLogError):
    """etcd did not say whether a write landed (a timeout); the caller must look first."""


class KV(abc.ABC):
    """The narrow store the service needs: get, put and compare-and-set on mod revisions.

    Revisions are positive and grow with every write; a missing key has revision 0.
    """

    @abc.abstractmethod
    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        """(value, mod revision), or None when the key is missing."""

    @abc.abstractmethod
    async def put(self, key: bytes, value: bytes) -> int:
        """Write unconditionally; return the new revision."""

    @abc.abstractmethod
    async def cas(
        self, key: bytes, value: bytes, expect_rev: int
    ) -> tuple[bool, bytes | None, int]:
        """Write when the key's revision is `expect_rev` (0: when it is missing).

        Returns:
            (landed, the value stored now, its revision); (False, None, 0) for a key that
            is missing when a revision was expected.
        """

    @abc.abstractmethod
    async def delete(self, key: bytes) -> bool:
        """Remove a key; True when it existed."""

    @abc.abstractmethod
    async def count(self, prefix: bytes) -> int:
        """How many keys start with `prefix`."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: bytes) -> int:
        """Remove every key that starts with `prefix`; return how many there were."""

    @abc.abstractmethod
    async def scan(self, prefix: bytes) -> dict[bytes, int]:
        """Every key that starts with `prefix` -> the size of its value in bytes."""


class MemoryKV(KV):
    """The in-memory reference `KV` (the driver's `--event-log memory` mode, tests)."""

    def __init__(self) -> None:
        self._data: dict[bytes, tuple[bytes, int]] = {}
        self._rev = 0

    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        return self._data.get(key)

    async def put(self, key: bytes, value: bytes) -> int:
        self._rev += 1
        self._data[key] = (value, self._rev)
        return self._rev

    async def cas(
        self, key: bytes, value: bytes, expect_rev: int
    ) -> tuple[bool, bytes | None, int]:
        cur = self._data.get(key)
        if (cur[1] if cur else 0) != expect_rev:
            return (False, cur[0], cur[1]) if cur else (False, None, 0)
        return True, value, await self.put(key, value)

    async def delete(self, key: bytes) -> bool:
        return self._data.pop(key, None) is not None

    async def count(self, prefix: bytes) -> int:
        return sum(k.startswith(prefix) for k in self._data)

    async def delete_prefix(self, prefix: bytes) -> int:
        gone = [k for k in self._data if k.startswith(prefix)]
        for k in gone:
            del self._data[k]
        return len(gone)

    async def scan(self, prefix: bytes) -> dict[bytes, int]:
        return {k: len(v[0]) for k, v in self._data.items() if k.startswith(prefix)}


class EtcdKV(KV):
    """`KV` on etcd v3; every write is fenced on the leader key's lease.

    Args:
        client: the driver's connected aetcd client (the event log's).
        job_id: the job (its leader key is the fence).
        lease_id: this driver's leadership lease.
        timeout_s: deadline of one etcd call.
    """

    def __init__(self, client: Any, job_id: str, lease_id: int, timeout_s: float) -> None:
        self.client = client
        self.keys = Keys(job_id)
        self.lease_id = lease_id
        self.timeout_s = timeout_s

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            err = classify(e, self.client)
            if err is None:
                raise UnknownOutcomeError(
                    f"etcd did not answer within {self.timeout_s:g} s; the write may or may "
                    "not have landed"
                ) from e
            raise err from e

    def _fence(self) -> rpc.Compare:
        return cmp_op(self.keys.leader, "LEASE", self.lease_id)

    def _fenced_off(self, leader: Any) -> NotLeaderError | None:
        if leader is None or leader.lease != self.lease_id:
            return NotLeaderError(
                f"this driver lost the leadership of job {self.keys.job_id} (its lease "
                f"{self.lease_id:x} no longer holds the leader key)"
            )
        return None

    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        resp = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=key))
        if not resp.kvs:
            return None
        return bytes(resp.kvs[0].value), int(resp.kvs[0].mod_revision)

    async def put(self, key: bytes, value: bytes) -> int:
        resp = await self._call(
            self.client.kvstub.Txn,
            rpc.TxnRequest(
                compare=[self._fence()],
                success=[put_op(key, value)],
                failure=[get_op(self.keys.leader)],
            ),
        )
        if not resp.succeeded:
            raise self._fenced_off(first_kv(resp.responses[0])) or NotLeaderError(
                "the leader fence failed"
            )
        return int(resp.header.revision)

    async def cas(
        self, key: bytes, value: bytes, expect_rev: int
    ) -> tuple[bool, bytes | None, int]:
        cond = cmp_op(key, "MOD", expect_rev) if expect_rev else cmp_op(key, "CREATE", 0)
        resp = await self._call(
            self.client.kvstub.Txn,
            rpc.TxnRequest(
                compare=[self._fence(), cond],
                success=[put_op(key, value)],
                failure=[get_op(key), get_op(self.keys.leader)],
            ),
        )
        if resp.succeeded:
            return True, value, int(resp.header.revision)
        fenced = self._fenced_off(first_kv(resp.responses[1]))
        if fenced is not None:
            raise fenced
        cur = first_kv(resp.responses[0])
        if cur is None:
            return False, None, 0
        return False, bytes(cur.value), int(cur.mod_revision)

    async def delete(self, key: bytes) -> bool:
        resp = await self._call(
            self.client.kvstub.Txn,
            rpc.TxnRequest(
                compare=[self._fence()],
                success=[delete_op(key)],
                failure=[get_op(self.keys.leader)],
            ),
        )
        if not resp.succeeded:
            raise self._fenced_off(first_kv(resp.responses[0])) or NotLeaderError(
                "the leader fence failed"
            )
        return int(resp.responses[0].response_delete_range.deleted) > 0

    async def count(self, prefix: bytes) -> int:
        resp = await self._call(
            self.client.kvstub.Range,
            rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), count_only=True),
        )
        return int(resp.count)

    async def delete_prefix(self, prefix: bytes) -> int:
        resp = await self._call(
            self.client.kvstub.Txn,
            rpc.TxnRequest(
                compare=[self._fence()],
                success=[delete_op(prefix, prefix_end(prefix))],
                failure=[get_op(self.keys.leader)],
            ),
        )
        if not resp.succeeded:
            raise self._fenced_off(first_kv(resp.responses[0])) or NotLeaderError(
                "the leader fence failed"
            )
        return int(resp.responses[0].response_delete_range.deleted)

    async def scan(self, prefix: bytes) -> dict[bytes, int]:
        # the values are read to size them: bounded by the rendezvous' job quota
        resp = await self._call(
            self.client.kvstub.Range,
            rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix)),
        )
        return {bytes(kv.key): len(kv.value) for kv in resp.kvs}


def prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's key range of `prefix` (its last byte plus one)."""
    assert prefix and prefix[-1] < 0xFF, prefix
    return prefix[:-1] + bytes([prefix[-1] + 1])


def kv_for(elog: EventLog, memory: MemoryKV, timeout_s: float) -> KV:
    """The `KV` that belongs with the leader's event log (etcd's, or the in-memory one)."""
    client = getattr(elog, "client", None)
    leadership = getattr(elog, "leadership", None)
    if client is not None and leadership is not None:
        return EtcdKV(client, elog.job_id, leadership.lease_id, timeout_s)  # type: ignore[attr-defined]
    return memory
