"""etcd plumbing shared by the event log and the election: key layout, a TLS-capable client.

`connect()` returns an `aetcd.Client` (subclassed here because aetcd has no TLS parameter)
whose channel never retries a write on its own and notices a dead etcd through grpc
keepalives. `Keys` is the one place that knows the key layout (see driver/etcdlog.py).
The small request builders keep transactions readable where they are composed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aetcd
import grpc
import structlog
from aetcd import rpc
from aetcd import watcher as aetcd_watcher

from unbroken.common.tls import channel_credentials_from
from unbroken.driver.etcd import EtcdConfig
from unbroken.driver.eventlog import (
    EventLogError,
    LogFullError,
    LogUnavailableError,
    SchemaError,
)
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

ROOT = "/unbroken"
CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.enable_retries": 0,  # never resend a write behind our back
    "grpc.max_receive_message_length": 64 << 20,
    "grpc.max_send_message_length": 4 << 20,
    "grpc.keepalive_time_ms": 10_000,  # notice a dead etcd under a silent watch
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.ping_timeout_ms": 5_000,  # else gRPC waits 60 s for a frozen member's ack
    "grpc.keepalive_permit_without_calls": 1,
    # a member that restarts is reachable again in well under a second: do not sit out
    # gRPC's default reconnect backoff (1 s growing 1.6x up to 120 s) while a lease's TTL
    # runs (a restored quorum extends every lease by only its TTL)
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1_000,
}


@dataclass(frozen=True, slots=True)
class Keys:
    """The etcd key layout of one job (see the module docstring)."""

    job_id: str
    root: str = ROOT

    def __post_init__(self) -> None:
        if not self.job_id or "/" in self.job_id or not self.job_id.isprintable():
            raise ValueError(f"job_id {self.job_id!r} must be non-empty, printable, without '/'")

    @property
    def base(self) -> bytes:
        return f"{self.root}/{self.job_id}/".encode()

    @property
    def leader(self) -> bytes:
        return self.base + b"leader"

    @property
    def term(self) -> bytes:
        return self.base + b"term"

    @property
    def head(self) -> bytes:
        return self.base + b"head"

    @property
    def snapshot(self) -> bytes:
        return self.base + b"snapshot"

    @property
    def snapshot_parts(self) -> bytes:
        return self.base + b"snapparts/"

    def snapshot_part(self, seq: int, i: int) -> bytes:
        """Part `i` of the snapshot at `seq` (one too large for one etcd request)."""
        return self.snapshot_parts + b"%020d/%06d" % (seq, i)

    @property
    def archived(self) -> bytes:
        return self.base + b"archived"

    @property
    def ev_prefix(self) -> bytes:
        return self.base + b"ev/"

    @property
    def ev_end(self) -> bytes:
        return self.base + b"ev0"  # '0' follows '/': the end of the ev/ prefix range

    def event(self, seq: int) -> bytes:
        return self.ev_prefix + b"%020d" % seq

    def event_id(self, event_id: str) -> bytes:
        return self.base + b"id/" + event_id.encode()

    @staticmethod
    def seq_of(key: bytes) -> int:
        return int(key.rsplit(b"/", 1)[-1])


class EtcdClient(aetcd.Client):
    """`aetcd.Client` over every endpoint of a cluster, failing over when one dies.

    aetcd builds one insecure channel to one host in `connect()`. This subclass builds the
    channel itself (TLS when a CA or client certificate is configured or the endpoint is
    https) to one member at a time, and a watchdog task moves every stub to another member
    that answers when the current one's channel fails (TRANSIENT_FAILURE) or a caller
    reports it unreachable (`suspect()`). Calls in flight on the dead member fail with
    UNAVAILABLE and their callers retry (the log, the election and its keep-alive all do),
    now on a live member. Every call carries etcd's `hasleader` metadata, so a member cut
    off from its cluster answers at once instead of hanging.
    """

    def __init__(self, endpoints: str | list[str], config: EtcdConfig) -> None:
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        u = urlparse(eps[0])
        assert u.hostname and u.port, eps[0]
        super().__init__(host=u.hostname, port=u.port, options=dict(CHANNEL_OPTIONS))
        self.endpoints = eps
        self.endpoint = eps[0]
        self._config = config
        self._index = 0
        self.failovers = 0  # members given up on so far
        self._watchdog: asyncio.Task[None] | None = None
        self._suspected = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._credentials = (
            _credentials(config)
            if (
                any(urlparse(e).scheme == "https" for e in eps)
                or config.ca_cert
                or config.client_cert
            )
            else None
        )

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        u = urlparse(endpoint)
        target = f"{u.hostname}:{u.port}"
        options = list(self._options.items())
        if self._credentials is not None:
            return grpc.aio.secure_channel(
                target, self._credentials, options=options, interceptors=_LEADER_REQUIRED
            )
        return grpc.aio.insecure_channel(target, options=options, interceptors=_LEADER_REQUIRED)

    def sync_channel(self, endpoint: str) -> grpc.Channel:
        """A synchronous channel to `endpoint` (the lease keeper's own thread uses it)."""
        u = urlparse(endpoint)
        target = f"{u.hostname}:{u.port}"
        options = list(self._options.items())
        if self._credentials is not None:
            return grpc.secure_channel(target, self._credentials, options=options)
        return grpc.insecure_channel(target, options=options)

    def _use(self, index: int, chan: grpc.aio.Channel) -> None:
        u = urlparse(self.endpoints[index])
        self._index, self.endpoint = index, self.endpoints[index]
        self._host, self._port = u.hostname or "", u.port or 0
        self.channel = chan
        self.kvstub = rpc.KVStub(chan)
        self.clusterstub = rpc.ClusterStub(chan)
        self.leasestub = rpc.LeaseStub(chan)
        self.maintenancestub = rpc.MaintenanceStub(chan)
        self._watcher = aetcd_watcher.Watcher(rpc.WatchStub(chan), timeout=self._timeout)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        self._use(self._index, self._channel(self.endpoints[self._index]))
        self._loop = asyncio.get_running_loop()
        self._connected.set()
        if len(self.endpoints) > 1 and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def suspect(self) -> None:
        """A caller found the current member unreachable: look for another one now (safe
        to call from any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._suspected.set()
        else:
            loop.call_soon_threadsafe(self._suspected.set)

    async def _watch(self) -> None:
        """Move to another member when the current one's channel fails."""
        bad = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
        while True:
            chan = self.channel
            state = chan.get_state(try_to_connect=True) if chan is not None else None
            if state in bad or self._suspected.is_set():
                self._suspected.clear()
                if not await self._failover():
                    await asyncio.sleep(FAILOVER_RETRY_S)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WATCHDOG_POLL_S):
                    waiters = [asyncio.ensure_future(self._suspected.wait())]
                    if chan is not None and state is not None:
                        waiters.append(asyncio.ensure_future(chan.wait_for_state_change(state)))
                    try:
                        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for w in waiters:
                            w.cancel()

    async def _failover(self) -> bool:
        """Switch to the next member that answers a Status call; False when none does."""
        n = len(self.endpoints)
        for step in range(1, n + 1):
            i = (self._index + step) % n
            chan = self._channel(self.endpoints[i])
            try:
                await rpc.MaintenanceStub(chan).Status(
                    rpc.StatusRequest(), timeout=FAILOVER_PROBE_S, wait_for_ready=True
                )
            except (grpc.aio.AioRpcError, TimeoutError, OSError):
                await chan.close()
                continue
            old, old_endpoint = self.channel, self.endpoint
            if i == self._index:  # the same member answers again: keep it
                await chan.close()
                return True
            self._use(i, chan)
            self.failovers += 1
            log.warning(
                "etcd member unreachable; moved to another", old=old_endpoint, new=self.endpoint
            )
            if old is not None:
                asyncio.get_running_loop().call_later(1.0, _closer(old))
            return True
        return False

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        await super().close()


async def read_stream(call: Any) -> Any:
    """`call.read()` of a streaming call, with a call cancelled under us read as EOF.

    The old member's channel is closed a second after a failover, and grpc cancels the
    calls still open on it: their `read()` raises `asyncio.CancelledError` although nobody
    cancelled the reader. Reported as the stream's end, the callers' "stream ended" path
    (re-read, retry) handles it; a cancellation of the reader's own task still raises.
    """
    try:
        return await call.read()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        return grpc.aio.EOF


def _closer(chan: grpc.aio.Channel) -> Callable[[], None]:
    """A callback that closes `chan` (the old member's, once calls on it have ended)."""

    def close() -> None:
        task = asyncio.ensure_future(chan.close())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    return close


_CLOSING: set[asyncio.Future[None]] = set()  # old channels being closed (kept referenced)


class _LeaderRequired(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Adds etcd's `hasleader: true` to every call: a member without a raft leader (cut off
    from the others) refuses at once instead of hanging until the deadline."""

    @staticmethod
    def _details(d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(d.metadata or ()))
        md.add("hasleader", "true")
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation: Any, details: Any, it: Any) -> Any:
        return await continuation(self._details(details), it)

    async def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        return await continuation(self._details(details), it)


_LEADER_REQUIRED = [_LeaderRequired()]
WATCHDOG_POLL_S = 1.0
FAILOVER_PROBE_S = 1.0
FAILOVER_RETRY_S = 0.2


def _credentials(config: EtcdConfig) -> grpc.ChannelCredentials:
    return channel_credentials_from(
        ca=config.ca_cert,
        key=config.client_key,
        cert=config.client_cert,
        names=("ca_cert", "client_key", "client_cert"),
    )


async def connect(config: EtcdConfig) -> aetcd.Client:
    """A connected client over every endpoint of `config` (see `EtcdClient`).

    Starting from the first endpoint, each gets `config.connect_timeout_s` to answer a
    Status call (TLS when configured); the client starts on the first that answers and
    fails over to the others later. Its channel never retries writes by itself.

    Raises:
        ValueError: no endpoints, or a TLS file cannot be read.
        LogUnavailableError: no endpoint answered in time; the message names each one.
    """
    if not config.endpoints:
        raise ValueError(
            "EtcdConfig.endpoints is empty: start an EmbeddedEtcd "
            "(unbroken.driver.etcd) and pass its .config, or give --etcd URLs"
        )
    problems = []
    for i, endpoint in enumerate(config.endpoints):
        eps = list(config.endpoints[i:]) + list(config.endpoints[:i])
        client = EtcdClient(eps, config)
        try:
            await client.connect()
            await client.maintenancestub.Status(
                rpc.StatusRequest(), timeout=config.connect_timeout_s, wait_for_ready=True
            )
            return client
        except grpc.aio.AioRpcError as e:
            problems.append(f"{endpoint} ({e.code().name}: {e.details()})")
        except (TimeoutError, OSError) as e:
            problems.append(f"{endpoint} ({e!r})")
        await client.close()
    raise LogUnavailableError(
        f"etcd unreachable at {', '.join(problems)} after {config.connect_timeout_s:g} s each; "
        "check the --etcd endpoints and that etcd runs there (TLS: --etcd-ca/-cert/-key)"
    )


def endpoint_of(client: aetcd.Client) -> str:
    """The endpoint a client talks to, for error messages."""
    return getattr(client, "endpoint", f"{client._host}:{client._port}")


# etcd's own words for "maybe applied, maybe not" (the server side saw our deadline, or
# raft did not confirm in time); the caller must look before it resends.
_UNKNOWN_OUTCOME = (
    "context deadline exceeded",
    "context canceled",
    "request timed out",
    "leader changed",
    "too many requests",
)


def classify(e: grpc.aio.AioRpcError, client: aetcd.Client) -> EventLogError | None:
    """Our error for a grpc failure, or None when the outcome is unknown (e.g. a timeout)."""
    code, details = e.code(), e.details() or ""
    where = endpoint_of(client)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "space exceeded" in details:
        return LogFullError(
            f"etcd at {where} is full (NOSPACE alarm: {details}); no event was written and "
            "every acknowledged one is still readable. Free space (archive with a smaller "
            "snapshot_every, `etcdctl compact`/`defrag`), raise --quota-backend-bytes, then "
            "`etcdctl alarm disarm`"
        )
    if code == grpc.StatusCode.UNAVAILABLE or "no leader" in details:
        if isinstance(client, EtcdClient):
            client.suspect()  # look for another member now
        return LogUnavailableError(f"etcd at {where} is unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or any(m in details for m in _UNKNOWN_OUTCOME):
        return None
    return EventLogError(f"etcd at {where} refused the request: {code.name}: {details}")


def is_compacted(e: grpc.aio.AioRpcError) -> bool:
    return e.code() == grpc.StatusCode.OUT_OF_RANGE or "compacted" in (e.details() or "")


#: The newest schema version this code reads (evaluated once: decode runs per event).
_MAX_SCHEMA = max(ev.SchemaVersion.values())


def decode(data: bytes) -> ev.Event:
    """An `Event` from stored bytes, refusing schema versions this code does not know."""
    e = ev.Event.FromString(data)
    if e.schema_version > _MAX_SCHEMA:
        raise SchemaError(
            f"event {e.seq} has schema version {e.schema_version}; this unbroken "
            f"knows up to {_MAX_SCHEMA}: upgrade it"
        )
    return e


def decode_all(values: Iterable[bytes]) -> list[ev.Event]:
    """`decode` of each value (one loop, no call per event: a replay decodes 100k)."""
    parse = ev.Event.FromString
    out = [parse(v) for v in values]
    newest = max((e.schema_version for e in out), default=0)
    if newest > _MAX_SCHEMA:
        e = next(e for e in out if e.schema_version == newest)
        raise SchemaError(
            f"event {e.seq} has schema version {e.schema_version}; this unbroken "
            f"knows up to {_MAX_SCHEMA}: upgrade it"
        )
    return out


def cmp_op(key: bytes, target: str, value: int | bytes) -> rpc.Compare:
    c = rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=getattr(rpc.Compare, target))
    setattr(
        c,
        {
            "VALUE": "value",
            "CREATE": "create_revision",
            "MOD": "mod_revision",
            "LEASE": "lease",
            "VERSION": "version",
        }[target],
        value,
    )
    return c


def put_op(key: bytes, value: bytes, lease: int = 0) -> rpc.RequestOp:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def get_op(key: bytes) -> rpc.RequestOp:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


def delete_op(key: bytes, range_end: bytes = b"") -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, range_end=range_end))


def first_kv(resp: rpc.ResponseOp) -> rpc.KeyValue | None:
    kvs = resp.response_range.kvs
    return kvs[0] if kvs else None
