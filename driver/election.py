"""Leader election among drivers through an etcd lease: one writer per job, fenced.

A candidate grants itself a lease (`ttl_s`), keeps it alive every ttl/3 (at most every
`RENEW_MAX_S`), and wins by a transaction that creates `/unbroken/<job>/leader` on that
lease only if the key does not exist, bumping `/unbroken/<job>/term` in the same
transaction. The leader key disappears when the lease expires (the leader was killed,
stopped or cut off) or is revoked (`resign`); standbys watch for that deletion and try
again at once, so a successor leads within the TTL plus etcd's expiry tick (~0.5 s).

The election only decides who may write; the event log enforces it: every append compares
the leader key's lease with the writer's (driver/etcdlog.py), so a leader that was paused
past its TTL and wakes up cannot write one event, whatever it believes. `lost` is set as
soon as this process knows its lease is gone (keep-alive refused) or may be gone (the TTL
elapsed without a confirmed keep-alive), telling the driver to stop serving.

A lease in doubt is not given up: etcd may only be electing a leader of its own or be short
of a quorum, and then the lease lives (etcd's new leader extends every lease; measured here,
a raft election after its leader's SIGKILL took 1.0-1.8 s, a quorum can be gone for as long
as an operator takes). The keeper goes on trying; the driver steps down and campaigns again
with the same `Election`, which finds the leader key still on its lease and takes the
leadership back in the same term, with no wait for the old lease to expire and no leader
change. If etcd says the lease is gone, a new one is granted and the campaign is a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from typing import Any

import aetcd
import grpc
import structlog
from aetcd import rpc

from unbroken.common import aio
from unbroken.driver.etcd import LEASE_TTL_S
from unbroken.driver.etcdclient import (
    EtcdClient,
    Keys,
    cmp_op,
    endpoint_of,
    first_kv,
    get_op,
    put_op,
    read_stream,
)
from unbroken.driver.eventlog import Leadership, LogUnavailableError

log = structlog.get_logger(__name__)

# The longest wait between two keep-alives. What is left of the TTL after the last one is
# the time an etcd leader election may take (the member the driver uses dies, and it was
# etcd's raft leader): a new leader renews every lease, but until then no keep-alive is
# confirmed. Measured here, killing the raft leader of a 3-member loopback cluster: 1.0-1.5 s
# to the first confirmed keep-alive idle, up to 1.8 s under stress-ng; ttl/3 = 1 s of a 3 s
# TTL left 2 s, and CI once took longer.
RENEW_MAX_S = 0.5
# A lease in doubt (its TTL passed unconfirmed) is tried again after this, doubling up to
# the cap: etcd may be short of a quorum for long, and the lease lives until it says not.
DOUBT_RETRY_FIRST_S = 0.1
DOUBT_RETRY_CAP_S = 1.0
# A standby that finds the leader's address refusing connections this many times in a row,
# `PROBE_EVERY_S` apart, revokes the leader's lease instead of waiting out its TTL: the
# leader's process is gone (its host answered with a reset), and the TTL was all of a
# failover's time (1.5-2.4 s in bench-recovery). A host that does not answer at all, or a
# port some other process took, proves nothing: then the TTL decides, as before. Fenced
# appends keep a revoked leader that was alive after all from writing (it steps down).
PROBE_REFUSALS = 3
PROBE_EVERY_S = 0.05


def renew_every(ttl: float) -> float:
    """Seconds between keep-alives of a lease of `ttl` seconds."""
    return min(ttl / 3, RENEW_MAX_S)


def term_scope(cluster_id: int, incarnation: int) -> str:
    """What a leader term counts in: the etcd cluster and the job's incarnation in it."""
    return f"{cluster_id:x}.{incarnation}"


async def refuses(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to `address` (host:port) is refused: the host answered and
    nothing listens on the port. A timeout, an unknown host or any other error: False."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return False
    try:
        _, writer = await aio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    return False


class Election:
    """Campaign for, hold and resign the leadership of one job.

    Args:
        client: a connected client (`etcdlog.connect()`).
        job_id: the job to lead.
        driver_id: this driver's unique id (stored in the leader key).
        ttl_s: lease time-to-live; etcd rounds it up to whole seconds (and to its minimum,
            1.5 x its election timeout). A dead leader is replaced after about this long.
        address: where agents reach this driver; readers get it from `current_leader`.
        op_timeout_s: deadline of each etcd call the election makes.
        young_s, defer_s: a candidate that began less than `young_s` ago (a driver just
            restarted) tries `defer_s` after the leader key's deletion, so a standby that
            has been waiting wins: it heard the agents ask for the leader during the
            election (a node that asked and is not back is lost sooner, after
            `--failover-grace-ms`) and followed the leader's live view. In bench-recovery a
            killed leader respawned at once won half the races, and a node lost during that
            failover waited out the whole 10 s grace.
        probe_leader: while another leads, probe its address and revoke its lease once
            nothing listens there (`PROBE_REFUSALS`): a standby leads a fraction of a second
            after the leader's process dies, not a TTL after.
    """

    def __init__(
        self,
        client: aetcd.Client,
        job_id: str,
        driver_id: str,
        *,
        ttl_s: float = LEASE_TTL_S,
        address: str = "",
        op_timeout_s: float = 2.0,
        young_s: float = 10.0,
        defer_s: float = 0.3,
        probe_leader: bool = False,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1 (etcd leases have whole seconds), got {ttl_s}")
        if not driver_id:
            raise ValueError("driver_id must be non-empty")
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        if young_s < 0 or defer_s < 0:
            raise ValueError(f"young_s and defer_s must be >= 0, got {young_s}, {defer_s}")
        self.client = client
        self.keys = Keys(job_id)
        self.job_id = job_id
        self.driver_id = driver_id
        self.ttl_s = ttl_s
        self.address = address
        self.op_timeout_s = op_timeout_s
        self.born = time.monotonic()
        self.young_s = young_s
        self.defer_s = defer_s
        self.probe_leader = probe_leader
        self.revoked_dead = 0  # leases of leaders found dead (their address refused) revoked
        self.lost = asyncio.Event()
        self.leadership: Leadership | None = None
        self._lease: int = 0
        self._lease_dead = asyncio.Event()
        self._keepalive: asyncio.Task[None] | None = None
        self._guard: asyncio.Task[None] | None = None
        self.doubts = 0  # times the lease's TTL passed unconfirmed
        self.kept_terms = 0  # campaigns that took back the same term after a doubt
        # set unless the lease is in doubt (its TTL passed unconfirmed, not confirmed since)
        self._confirmed = asyncio.Event()
        self._confirmed.set()
        self._keeper: LeaseKeeper | None = None
        self._log = log.bind(job=job_id, driver=driver_id)

    async def _call(self, method: Any, request: Any) -> Any:
        await self.client.connect()
        try:
            return await method(request, timeout=self.op_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise LogUnavailableError(
                f"election for job {self.job_id}: etcd at {endpoint_of(self.client)} failed: "
                f"{e.code().name}: {e.details()}"
            ) from e

    async def campaign(self, timeout_s: float | None = None) -> Leadership:
        """Block until this driver leads the job; keep its lease alive from then on.

        Args:
            timeout_s: give up after this long (None: wait as long as another leads).

        Returns:
            The `Leadership` to open the event log with.

        Raises:
            TimeoutError: `timeout_s` passed while another driver led.
            LogUnavailableError: etcd did not answer.
        """
        try:
            won = await self._campaign(timeout_s)
        except LogUnavailableError:
            # etcd is away: keep the lease (a leader key may hang on it, after a doubt);
            # the next campaign of this Election uses it again if etcd says it lives
            raise
        except BaseException:  # gave up or cancelled: stop refreshing the unused lease
            if self._keepalive is not None:
                self._keepalive.cancel()
                self._keepalive = None
            self._lease = 0
            raise
        again = self.leadership is not None and self.leadership == won
        self.leadership = won
        self.lost.clear()
        if self._guard is not None:  # an earlier term's (this lease's, after a doubt)
            self._guard.cancel()
        self._guard = asyncio.create_task(self._guard_key(won.lease_id), name="leader-guard")
        if again:
            self.kept_terms += 1
        self._log.info("leading", term=won.term, lease=f"{won.lease_id:x}", same_term=again)
        return won

    async def _campaign(self, timeout_s: float | None) -> Leadership:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if not self._lease or self._lease_dead.is_set():
                await self._grant()
            try:
                won, rev = await self._try_acquire()
            except LogUnavailableError as e:
                if "lease not found" not in str(e):
                    raise
                self._lease_dead.set()  # it expired while we were away: take a new one
                continue
            if won is not None:
                if not self._confirmed.is_set() and not await self._confirm_doubted():
                    continue  # the lease ended after all: a new one, a new campaign
                return won
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"{self.driver_id} did not win job {self.job_id} within "
                    f"{timeout_s:g} s; the leader is {await self._holder()}"
                )
            # Re-check at least every TTL, in case a watch event was missed.
            step = self.ttl_s if remaining is None else min(self.ttl_s, remaining)
            await self._wait_leader_gone(rev + 1, step)
            if time.monotonic() - self.born < self.young_s:
                await asyncio.sleep(self.defer_s)  # a waiting standby first (see the class)

    async def _confirm_doubted(self) -> bool:
        """The leader key is still on our doubted lease: lead only once the keeper has a
        keep-alive confirmed (leading on a lease nobody renews could outlive it). True when
        confirmed, False when etcd says the lease is gone.

        Raises:
            LogUnavailableError: neither within the op timeout (etcd still settling).
        """
        if self._keeper is not None:
            self._keeper.poke()
        confirmed = asyncio.ensure_future(self._confirmed.wait())
        dead = asyncio.ensure_future(self._lease_dead.wait())
        try:
            await asyncio.wait(
                {confirmed, dead}, timeout=2 * self.op_timeout_s, return_when="FIRST_COMPLETED"
            )
        finally:
            confirmed.cancel()
            dead.cancel()
        if self._lease_dead.is_set():
            return False
        if not self._confirmed.is_set():
            raise LogUnavailableError(
                f"election for job {self.job_id}: the leader key is on this driver's lease, "
                "but etcd has not confirmed a keep-alive of it yet"
            )
        return True

    async def _grant(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        ttl = max(1, math.ceil(self.ttl_s))
        granted = await self._call(self.client.leasestub.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
        self._lease = granted.ID
        self._lease_dead = asyncio.Event()
        self._confirmed.set()
        self._keepalive = asyncio.create_task(
            self._keep_alive(self._lease, granted.TTL, self._lease_dead),
            name=f"lease-{self._lease:x}",
        )

    async def _holder(self) -> str:
        r = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=self.keys.leader))
        kvs = r.kvs
        return json.loads(kvs[0].value)["driver_id"] if kvs else "nobody"

    async def _try_acquire(self) -> tuple[Leadership | None, int]:
        """One attempt: (leadership, _) when won, else (None, revision to watch after)."""
        k = self.keys
        for _ in range(8):  # a lost race on the term key only: try again at once
            r = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=k.term))
            kvs = r.kvs
            term = int(kvs[0].value) if kvs else 0
            term_cmp = (
                cmp_op(k.term, "MOD", kvs[0].mod_revision) if kvs else cmp_op(k.term, "CREATE", 0)
            )
            value = json.dumps(
                {
                    "driver_id": self.driver_id,
                    "address": self.address,
                    "lease_id": self._lease,
                    "term": term + 1,
                }
            ).encode()
            resp = await self._call(
                self.client.kvstub.Txn,
                rpc.TxnRequest(
                    compare=[cmp_op(k.leader, "CREATE", 0), term_cmp],
                    success=[
                        put_op(k.leader, value, self._lease),
                        put_op(k.term, b"%d" % (term + 1)),
                    ],
                    failure=[get_op(k.leader)],
                ),
            )
            if resp.succeeded:
                # the job's incarnation: when its term key was created (a new one if the
                # job's keys were deleted, or etcd was replaced by an empty one)
                born = kvs[0].create_revision if kvs else resp.header.revision
                scope = term_scope(resp.header.cluster_id, born)
                return Leadership(self.driver_id, self._lease, term + 1, scope), 0
            leader = first_kv(resp.responses[0])
            if leader is not None and leader.lease == self._lease:  # our earlier try landed
                doc = json.loads(leader.value)
                r = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=k.term))
                born = r.kvs[0].create_revision if r.kvs else 0
                scope = term_scope(r.header.cluster_id, born)
                return Leadership(self.driver_id, self._lease, int(doc["term"]), scope), 0
            if leader is not None:
                return None, resp.header.revision
        raise LogUnavailableError(f"election for job {self.job_id} kept losing term races")

    async def _guard_key(self, lease_id: int) -> None:
        """While leading, set `lost` if the leader key is deleted or taken (e.g. by hand)."""
        rev = 0
        while not self.lost.is_set():
            if rev:
                await self._wait_deleted(rev + 1, 5 * self.ttl_s)
            try:
                r = await self._call(
                    self.client.kvstub.Range, rpc.RangeRequest(key=self.keys.leader)
                )
            except LogUnavailableError:
                await asyncio.sleep(self.ttl_s / 3)  # unreachable: the keep-alive decides
                continue
            if not r.kvs or r.kvs[0].lease != lease_id:
                self._log.warning("leadership lost: the leader key is gone or not ours")
                self.lost.set()
                return
            rev = r.header.revision

    async def _wait_leader_gone(self, start_revision: int, timeout_s: float) -> None:
        """`_wait_deleted`, and meanwhile (with `probe_leader`) revoke the leader's lease
        once its address refuses connections `PROBE_REFUSALS` times in a row."""
        if not self.probe_leader:
            await self._wait_deleted(start_revision, timeout_s)
            return
        tasks = [
            asyncio.create_task(self._wait_deleted(start_revision, timeout_s)),
            asyncio.create_task(self._revoke_if_dead()),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            # bounded: a task that did not take its cancel must not hold the campaign
            ended, stuck = await asyncio.wait(tasks, timeout=self.op_timeout_s)
            for t in ended:  # retrieved, so none is reported as never retrieved
                _ = t.cancelled() or t.exception()
            if stuck:
                self._log.warning(
                    "a leader watch task ignored its cancel; left behind",
                    tasks=[t.get_coro().__qualname__ for t in stuck],  # type: ignore[union-attr]
                )

    async def _revoke_if_dead(self) -> None:
        """Return once the current leader's lease is revoked because nothing listens at its
        address any more; wait (until cancelled) while it may be alive."""
        r = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=self.keys.leader))
        if not r.kvs:
            return
        try:
            doc = json.loads(r.kvs[0].value)
            address, lease = str(doc.get("address", "")), int(doc.get("lease_id", 0))
        except (ValueError, TypeError, AttributeError):
            await asyncio.Event().wait()  # not ours to judge: the TTL decides
            return
        if not address or address == self.address or not lease:
            await asyncio.Event().wait()
        refusals = 0
        while refusals < PROBE_REFUSALS:
            await asyncio.sleep(PROBE_EVERY_S)
            refusals = refusals + 1 if await refuses(address, self.op_timeout_s) else 0
        # counted and said first: the watch sees the key go (and this task is cancelled)
        # before the revoke's own answer comes back
        self.revoked_dead += 1
        self._log.warning(
            "the leader's address refuses connections: revoking its lease",
            leader=doc.get("driver_id"),
            address=address,
            lease=f"{lease:x}",
        )
        with contextlib.suppress(LogUnavailableError):  # gone already: the watch says so
            await self._call(self.client.leasestub.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease))

    async def _wait_deleted(self, start_revision: int, timeout_s: float) -> None:
        """Return when the leader key is deleted after `start_revision`, or after timeout_s."""
        await self.client.connect()
        call = rpc.WatchStub(self.client.channel).Watch()
        try:
            async with asyncio.timeout(timeout_s):
                await call.write(
                    rpc.WatchRequest(
                        create_request=rpc.WatchCreateRequest(
                            key=self.keys.leader,
                            start_revision=start_revision,
                            filters=[rpc.WatchCreateRequest.NOPUT],
                        )
                    )
                )
                while True:
                    resp = await read_stream(call)
                    if (
                        resp is grpc.aio.EOF
                        or resp.canceled
                        or resp.compact_revision
                        or resp.events
                    ):
                        return
        except (TimeoutError, grpc.aio.AioRpcError):
            return
        finally:
            call.cancel()

    async def _keep_alive(self, lease_id: int, ttl: int, dead: asyncio.Event) -> None:
        """Refresh the lease every `renew_every(ttl)` until it is refused or its TTL passes
        unconfirmed.

        The refreshes run in their own thread over a synchronous channel (`LeaseKeeper`),
        so a driver whose event loop is busy (a registration storm, heartbeats of thousands
        of nodes, a long fold) does not lose its lease by itself: only a process that cannot
        run at all, or an etcd that refuses, ends the lease. A client that is not ours (no
        endpoint list) is refreshed from the event loop instead.
        """
        if isinstance(self.client, EtcdClient):
            keeper = LeaseKeeper(self.client, lease_id, ttl, self.op_timeout_s)
            ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def finish() -> None:
                if not ended.done():
                    ended.set_result(None)

            loop = asyncio.get_running_loop()
            keeper.on_end = lambda: loop.call_soon_threadsafe(finish)
            keeper.on_doubt = lambda: loop.call_soon_threadsafe(self._lease_doubt, lease_id)
            keeper.on_confirm = lambda: loop.call_soon_threadsafe(self._lease_confirmed, lease_id)
            self._keeper = keeper
            keeper.start()
            try:
                await ended
            finally:
                keeper.stop()
                if self._keeper is keeper:
                    self._keeper = None
            if keeper.error:
                self._log.warning("lease keep-alive ended", reason=keeper.error)
            self._lease_ended(lease_id, dead)
            return
        await self._keep_alive_in_loop(lease_id, ttl, dead)

    def _lease_doubt(self, lease_id: int) -> None:
        """The TTL passed unconfirmed: stop leading; the lease is kept while etcd may say
        it lives (`campaign` takes the leadership back then)."""
        self.doubts += 1
        if lease_id == self._lease:
            self._confirmed.clear()
        if self.leadership is not None and self.leadership.lease_id == lease_id:
            self._log.warning(
                "leadership suspended: no keep-alive confirmed within the TTL; the lease is "
                "kept while etcd may confirm it",
                lease=f"{lease_id:x}",
            )
            self.lost.set()

    def _lease_confirmed(self, lease_id: int) -> None:
        if lease_id == self._lease:
            self._confirmed.set()
        self._log.info("lease confirmed again after a doubt", lease=f"{lease_id:x}")

    def _lease_ended(self, lease_id: int, dead: asyncio.Event) -> None:
        dead.set()
        if self.leadership is not None and self.leadership.lease_id == lease_id:
            self._log.warning("leadership lost: lease expired or refused", lease=f"{lease_id:x}")
            self.lost.set()

    async def _keep_alive_in_loop(self, lease_id: int, ttl: int, dead: asyncio.Event) -> None:
        expires = time.monotonic() + ttl
        while time.monotonic() < expires:
            call = None
            try:
                call = self.client.leasestub.LeaseKeepAlive()
                while True:
                    sent = time.monotonic()
                    async with asyncio.timeout(max(0.01, expires - sent)):
                        await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                        resp = await read_stream(call)
                    if resp is grpc.aio.EOF:
                        break
                    if resp.TTL <= 0:
                        expires = 0.0  # etcd says the lease is gone
                        break
                    expires = sent + resp.TTL
                    await asyncio.sleep(renew_every(ttl))
            except TimeoutError:
                break
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:  # stream broke
                self._log.warning(
                    "lease keep-alive failed; retrying until the TTL passes", error=repr(e)
                )
                await asyncio.sleep(min(0.2, max(0.0, expires - time.monotonic())))
            finally:
                if call is not None:
                    call.cancel()
        self._lease_ended(lease_id, dead)

    async def resign(self) -> None:
        """Give up leadership (or candidacy) now: revoke the lease, which deletes the key."""
        tasks = (self._keepalive, self._guard)
        self._keepalive = self._guard = None
        for task in tasks:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._lease:
            with contextlib.suppress(LogUnavailableError):
                await self._call(
                    self.client.leasestub.LeaseRevoke, rpc.LeaseRevokeRequest(ID=self._lease)
                )
        held = self._lease != 0 or any(t is not None for t in tasks)
        if self.leadership is not None and held:
            self.lost.set()
            self._log.info("resigned", term=self.leadership.term)
        self._lease = 0

    @property
    def in_doubt(self) -> bool:
        """The lease's TTL passed unconfirmed and etcd has not said it is gone."""
        return not self._confirmed.is_set() and bool(self._lease) and not self._lease_dead.is_set()


class LeaseKeeper(threading.Thread):
    """Refreshes one lease every `renew_every(ttl)` from its own thread, over a synchronous
    gRPC channel to the member the client currently uses (it follows the client's
    failovers), until etcd refuses the lease or `stop()`.

    When the TTL passes with no keep-alive confirmed, the lease is in doubt: it may have
    expired, or etcd may be electing a leader or short of a quorum (then the lease lives:
    a new etcd leader extends every lease). `on_doubt` is called (from this thread) and the
    holder must act as if it were gone; the keeper goes on trying, with backoff. If etcd
    confirms the lease (TTL > 0) it never expired, nobody else can hold what it guards, and
    `on_confirm` is called. `on_end` is called when it ends by itself (etcd says the lease
    is gone); `error` says why."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int, op_timeout_s: float) -> None:
        super().__init__(name=f"lease-{lease_id:x}", daemon=True)
        self.client = client
        self.lease_id = lease_id
        self.ttl = ttl
        self.op_timeout_s = op_timeout_s
        self.on_end: Any = None
        self.on_doubt: Any = None
        self.on_confirm: Any = None
        self.error = ""
        self._stopped = False
        self._wake = threading.Event()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def poke(self) -> None:
        """Try a keep-alive now (a lease in doubt waits up to `DOUBT_RETRY_CAP_S`)."""
        self._wake.set()

    def run(self) -> None:
        expires = time.monotonic() + self.ttl
        doubt = False
        backoff = DOUBT_RETRY_FIRST_S
        channels: dict[str, grpc.Channel] = {}
        try:
            while not self._stopped:
                now = time.monotonic()
                if not doubt and now >= expires:
                    doubt = True
                    self.error = f"no keep-alive confirmed for {self.ttl} s (the TTL)"
                    if self.on_doubt is not None:
                        self.on_doubt()
                endpoint = self.client.endpoint
                chan = channels.get(endpoint)
                if chan is None:
                    chan = channels[endpoint] = self.client.sync_channel(endpoint)
                req = rpc.LeaseKeepAliveRequest(ID=self.lease_id)
                # in doubt there is no TTL left to keep: each try may take the whole timeout
                timeout = self.op_timeout_s if doubt else min(self.op_timeout_s, expires - now)
                try:
                    call = rpc.LeaseStub(chan).LeaseKeepAlive(
                        iter([req]),
                        timeout=max(0.05, timeout),
                        metadata=(("hasleader", "true"),),
                    )
                    resp = next(iter(call))
                    if resp.TTL <= 0:
                        self.error = "etcd says the lease is gone"
                        break
                    expires = now + resp.TTL
                    wait = renew_every(self.ttl)
                    if doubt:
                        doubt, backoff = False, DOUBT_RETRY_FIRST_S
                        self.error = ""
                        if self.on_confirm is not None:
                            self.on_confirm()
                except (grpc.RpcError, StopIteration) as e:
                    self.client.suspect()  # the async watchdog looks for a live member
                    channels.pop(endpoint).close()  # the next try dials afresh
                    code = e.code().name if isinstance(e, grpc.RpcError) else "no reply"
                    if doubt:
                        self.error = f"keep-alive failed ({code}); the lease is in doubt"
                        wait, backoff = backoff, min(DOUBT_RETRY_CAP_S, backoff * 2)
                    else:
                        self.error = f"keep-alive failed ({code}); retrying until the TTL passes"
                        wait = 0.1
                self._wake.wait(wait)
                self._wake.clear()
        finally:
            for c in channels.values():
                c.close()
        if not self._stopped and self.on_end is not None:
            self.on_end()


async def current_leader(client: aetcd.Client, job_id: str) -> tuple[str, str] | None:
    """The job's leader as (driver_id, address), or None when nobody leads.

    Raises:
        LogUnavailableError: etcd did not answer within 5 s.
    """
    try:
        await client.connect()
        r = await client.kvstub.Range(rpc.RangeRequest(key=Keys(job_id).leader), timeout=5.0)
    except grpc.aio.AioRpcError as e:
        raise LogUnavailableError(f"etcd at {endpoint_of(client)}: {e.details()}") from e
    if not r.kvs:
        return None
    doc = json.loads(r.kvs[0].value)
    return str(doc["driver_id"]), str(doc["address"])
