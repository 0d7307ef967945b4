"""The etcd event log's calls: one unary RPC with a deadline, and its writer's fence.

The log's three parts (driver/etcdlog.py reads, driver/etcdcommit.py appends,
driver/etcdsnapshot.py snapshots and trims) share one `LogCalls`: the client, the job's
keys, the leadership the writes are fenced on, the deadline of one call, and whether a
write found this driver fenced off (after which neither appends nor maintenance go on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aetcd
import grpc
from aetcd import rpc

from unbroken.driver.etcdclient import Keys, classify, cmp_op, endpoint_of, is_compacted
from unbroken.driver.eventlog import Leadership, LogUnavailableError, NotLeaderError


class LogCalls:
    """Unary calls of one job's event log to etcd (see the module docstring).

    Args:
        client: a connected client; the log's owner closes it.
        job_id: the job whose keys these are.
        leadership: what writes are fenced on; None: a read-only log.
        timeout_s: the deadline of one call (and of one append transaction).
    """

    def __init__(
        self, client: aetcd.Client, job_id: str, leadership: Leadership | None, timeout_s: float
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.keys = Keys(job_id)
        self.leadership = leadership
        self.timeout_s = timeout_s
        # set when a write found the leader key on another lease: no write goes on after it
        self.fenced: NotLeaderError | None = None

    async def call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        """One unary RPC with a deadline; grpc errors become our typed errors."""
        await self.client.connect()
        try:
            return await method(request, timeout=timeout or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if is_compacted(e):
                raise
            err = classify(e, self.client)
            if err is None:
                err = LogUnavailableError(
                    f"etcd at {endpoint_of(self.client)} did not answer "
                    f"within {timeout or self.timeout_s:g} s"
                )
            raise err from e

    async def txn(
        self,
        compare: Sequence[rpc.Compare],
        success: Sequence[rpc.RequestOp],
        failure: Sequence[rpc.RequestOp] = (),
    ) -> rpc.TxnResponse:
        return await self.call(
            self.client.kvstub.Txn,
            rpc.TxnRequest(compare=compare, success=success, failure=failure),
        )

    async def get(self, key: bytes, revision: int = 0) -> rpc.RangeResponse:
        """The key's range response (at `revision`; 0: the newest)."""
        return await self.call(
            self.client.kvstub.Range, rpc.RangeRequest(key=key, revision=revision)
        )

    def fence(self) -> rpc.Compare:
        """The compare that holds while the leader key is on this driver's lease."""
        assert self.leadership is not None
        return cmp_op(self.keys.leader, "LEASE", self.leadership.lease_id)

    async def last_seq(self) -> int:
        r = await self.get(self.keys.head)
        return int(r.kvs[0].value) if r.kvs else 0

    async def status(self) -> rpc.StatusResponse:
        """etcd's Status of the member we talk to (dbSize, dbSizeInUse, ...)."""
        return await self.call(self.client.maintenancestub.Status, rpc.StatusRequest())
