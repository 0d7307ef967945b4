"""torchrun's `unbroken` rendezvous backend: torch's own handler over the driver.

`torchrun --rdzv-backend=unbroken --rdzv-endpoint=<driver host:port> --rdzv-id=JOB`
finds this module through the `torchrun.handlers` entry point (installing unbroken is
enough). It builds torch's `DynamicRendezvousHandler` (restarts, scale down and up
between --nnodes=MIN:MAX, hot spares beyond MAX in its redundancy list) over two pieces
that talk to the driver's Rendezvous service (driver/rendezvous.py) instead of etcd v2
or a TCPStore:

- `DriverRendezvousBackend`: get_state/set_state with the state's etcd mod revision as
  the fencing token;
- `DriverStore`: a `torch.distributed.Store` in Python over the driver's key-value
  RPCs, for what the elastic agent exchanges (role infos, the master address, the exit
  barrier). Workers keep using the agent's TCPStore as usual; the driver carries only
  the agents' small control traffic.

Each round gets a fresh worker TCPStore (`UnbrokenRendezvousHandler`; pytorch#135712).
A node the driver evicted is refused with `NodeEvictedError` (a RendezvousClosedError);
an unreachable driver raises RendezvousConnectionError naming the endpoint. Calls are
retried with backoff for `retry_timeout` seconds (a driver failover), following the
`x-unbroken-leader` trailer of a standby or the next of several listed endpoints. grpc
and the stubs are imported when a handler is created: torch loads this entry point in
every process that imports its rendezvous package, whatever the backend.

rdzv conf keys (`--rdzv-conf k=v,...`), besides torch's join_timeout, last_call_timeout,
close_timeout, heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt:
node_id, token_file, key_file, tls_cert, tls_key, tls_ca, rpc_timeout, retry_timeout,
connect_timeout, in_job (1: a failed worker restarts its own node's workers only, see
agent/rdzvinjob.py) and in_job_timeout (seconds, default 30). Environment:
UNBROKEN_NODE_ID, UNBROKEN_TOKEN; optionally UNBROKEN_RDZV_KEY(_FILE).

The state torch pickles is sealed with an HMAC under the job's key and opened with a
restricted unpickler before torch sees it (agent/rdzvauth.py): a state written by anything
but a torchrun agent holding the key is refused with RendezvousStateError, never unpickled.
The key comes from the driver (GetKey, on the node's authenticated channel) unless the
operator configured one, so torchrun needs nothing beyond the node's credential.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


def plugin() -> Callable[[Any], Any]:
    """The `torchrun.handlers` entry point: torch calls it and registers what it returns.

    Defined before the torch imports below: importing torch's rendezvous package loads
    every entry point, this one included, possibly while this module is still loading.
    """
    return _create


def _create(params: Any) -> Any:
    return create_handler(params)


import structlog  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
)

from unbroken.agent.rdzvauth import (  # noqa: E402
    StateAuthError,
    load_state,
    open_sealed,
    rdzv_key,
    seal,
)
from unbroken.agent.rdzvinjob import DEFAULT_TIMEOUT_S as DEFAULT_IN_JOB_TIMEOUT_S  # noqa: E402
from unbroken.agent.rdzvinjob import InJobRounds  # noqa: E402
from unbroken.common.channel import LEADER_KEY, endpoint_is_loopback  # noqa: E402
from unbroken.common.tls import (  # noqa: E402
    TOKEN_ENV,
    TlsConfig,
    channel_credentials,
    read_token,
    token_metadata,
)

log = structlog.get_logger(__name__)

BACKEND_NAME = "unbroken"
DEFAULT_PORT = 50051  # the driver's default --listen port
NODE_ID_ENV = "UNBROKEN_NODE_ID"
LONG_POLL_S = 10.0  # longest a blocking store call waits in one RPC


class NodeEvictedError(RendezvousClosedError):
    """The driver evicted this node (a diagnosis named it, or `unbroken evict`)."""


@dataclass(kw_only=True, slots=True)
class RdzvClientConfig:
    """How a torchrun agent reaches the driver's rendezvous."""

    endpoint: str  # host:port, or several (a leader and its standbys) separated by commas
    run_id: str
    node_id: str
    token: str | None = None
    tls: TlsConfig = field(default_factory=TlsConfig)
    rpc_timeout_s: float = 10.0  # deadline of one call (plus its wait, for store waits)
    retry_timeout_s: float = 60.0  # keep retrying an unreachable driver this long
    connect_timeout_s: float = 15.0  # the first contact, when the handler is created
    key_file: str | None = None  # the rendezvous state's key (else env, else the driver's)
    state_key: bytes = b""  # seals the rendezvous state (default: rdzvauth.rdzv_key)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoint is empty (torchrun --rdzv-endpoint=HOST:PORT)")
        for ep in self.endpoints:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"endpoint {ep!r} must be the driver's host:port "
                    "(torchrun --rdzv-endpoint=HOST:PORT[,HOST:PORT...])"
                )
        if not self.run_id or len(self.run_id) > 128 or "/" in self.run_id:
            raise ValueError(
                f"run_id {self.run_id!r} must be 1-128 characters without '/' (--rdzv-id)"
            )
        if not self.node_id or len(self.node_id) > 256:
            raise ValueError(
                f"node_id {self.node_id!r} must be 1-256 characters "
                f"(rdzv conf node_id=..., or {NODE_ID_ENV})"
            )
        if self.token and not self.tls.enabled:
            remote = [e for e in self.endpoints if not endpoint_is_loopback(e)]
            if remote:
                raise ValueError(
                    f"the token would travel in cleartext to {', '.join(remote)}: give "
                    "tls_cert, tls_key and tls_ca (rdzv conf), or reach the driver on loopback"
                )
        for name in ("rpc_timeout_s", "retry_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.state_key:
            conf = {"key_file": self.key_file} if self.key_file else {}
            self.state_key = rdzv_key(conf, self.run_id)  # b"": the driver's (GetKey)

    @property
    def endpoints(self) -> list[str]:
        """The drivers to try, in order."""
        return [e.strip() for e in self.endpoint.split(",") if e.strip()]


def config_from_params(params: RendezvousParameters) -> RdzvClientConfig:
    """The client config from torchrun's parameters (ValueError naming a bad one)."""
    endpoint = (params.endpoint or "").strip()
    if not endpoint:
        raise ValueError(
            "--rdzv-endpoint is empty: give the unbroken driver's host:port "
            "(`unbroken driver --listen`, default port 50051)"
        )
    endpoint = ",".join(
        e if ":" in e else f"{e}:{DEFAULT_PORT}"
        for e in (x.strip() for x in endpoint.split(","))
        if e
    )
    if params.get("token") is not None:
        raise ValueError(
            "rdzv conf token=... puts the token on torchrun's command line, visible to every "
            f"local user (ps): use --rdzv-conf token_file=PATH or ${TOKEN_ENV}"
        )
    token = read_token(os.environ.get(TOKEN_ENV) or None, params.get("token_file"))

    def seconds(key: str, default: float) -> float:
        raw = params.get(key)
        try:
            return float(raw) if raw is not None else default
        except ValueError:
            raise ValueError(f"rdzv conf {key}={raw!r} must be a number of seconds") from None

    return RdzvClientConfig(
        endpoint=endpoint,
        run_id=params.run_id,
        node_id=params.get("node_id") or os.environ.get(NODE_ID_ENV) or socket.gethostname(),
        token=token,
        tls=TlsConfig(
            cert=params.get("tls_cert"), key=params.get("tls_key"), ca=params.get("tls_ca")
        ),
        key_file=params.get("key_file"),
        rpc_timeout_s=seconds("rpc_timeout", 10.0),
        retry_timeout_s=seconds("retry_timeout", 60.0),
        connect_timeout_s=seconds("connect_timeout", 15.0),
    )


class DriverClient:
    """A thread-safe, retrying client of the driver's Rendezvous service (sync gRPC).

    torch calls the backend and the store from its own threads (the keep-alive timer,
    the agent's monitor loop), so this uses a blocking channel, not asyncio.
    """

    def __init__(self, config: RdzvClientConfig) -> None:
        import grpc

        from unbroken.proto import rendezvous_pb2 as rpb

        self.config = config
        self.endpoints = config.endpoints
        self.endpoint = self.endpoints[0]
        self.node_desc = ""
        self._grpc = grpc
        self._rpb = rpb
        self._lock = threading.Lock()
        self._metadata = token_metadata(config.token)
        self._channel: Any = None
        self._stub: Any = None
        self._open(self.endpoint)

    def _open(self, endpoint: str) -> None:
        from unbroken.common import channel as chan
        from unbroken.proto import rendezvous_pb2_grpc as rgrpc

        grpc, cfg = self._grpc, self.config
        if cfg.tls.enabled:
            creds = channel_credentials(cfg.tls)
            ch = grpc.secure_channel(endpoint, creds, options=chan.CLIENT_OPTIONS)
        else:
            ch = grpc.insecure_channel(endpoint, options=chan.CLIENT_OPTIONS)
        old = self._channel
        self._channel, self._stub, self.endpoint = ch, rgrpc.RendezvousStub(ch), endpoint
        if old is not None:
            old.close()

    def _rotate(self, failed: str) -> None:
        """Move on from `failed` to the next endpoint of the list (unless another thread did)."""
        with self._lock:
            if self.endpoint != failed:
                return
            i = self.endpoints.index(failed) if failed in self.endpoints else -1
            self._open(self.endpoints[(i + 1) % len(self.endpoints)])

    def caller(self) -> Any:
        return self._rpb.Caller(
            run_id=self.config.run_id, node_id=self.config.node_id, node_desc=self.node_desc
        )

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    def call(
        self,
        method: str,
        request: Any,
        *,
        wait_s: float = 0.0,
        idempotent: bool = True,
        budget_s: float | None = None,
    ) -> Any:
        """Call `method`, retrying an unreachable or failing-over driver with backoff.

        Args:
            method: the RPC's name on the Rendezvous service.
            request: its request message (the caller is filled in here).
            wait_s: how long the driver may hold the call (store waits).
            idempotent: False for calls a resend could apply twice (store add): an
                unknown outcome is then an error, not a retry.
            budget_s: retry for this long (default: the config's retry_timeout_s).

        Raises:
            NodeEvictedError: the driver evicted this node.
            RendezvousConnectionError: the driver stayed unreachable, or refused us.
            RendezvousStateError: the driver refused the request as malformed.
        """
        grpc = self._grpc
        request.caller.CopyFrom(self.caller())
        budget = self.config.retry_timeout_s if budget_s is None else budget_s
        give_up = time.monotonic() + budget
        delay, last = 0.05, ""
        while True:
            with self._lock:
                stub, where = self._stub, self.endpoint
            if stub is None:
                raise RendezvousConnectionError("the rendezvous client is closed")
            try:
                return getattr(stub, method)(
                    request, timeout=self.config.rpc_timeout_s + wait_s, metadata=self._metadata
                )
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                fatal = self._refusal(code, details, method, where, idempotent)
                if fatal is not None:
                    raise fatal from None
                last = f"{code.name}: {details}"
                leader = dict(e.trailing_metadata() or ()).get(LEADER_KEY, "")
                if leader and leader != where and leader not in self.endpoints:
                    log.warning("ignoring a redirect to a driver not in --rdzv-endpoint", to=leader)
                    leader = ""
                if leader and leader != where:
                    log.info("following the driver leader", leader=leader, was=where)
                    with self._lock:
                        self._open(leader)
                    continue
                if len(self.endpoints) > 1:  # a dead leader: try the next listed driver
                    self._rotate(where)
            if time.monotonic() + delay > give_up:
                raise RendezvousConnectionError(
                    f"the unbroken driver at {', '.join(self.endpoints)} is unreachable "
                    f"({where}: {last}) after {budget:g} s; check --rdzv-endpoint and that "
                    "`unbroken driver` runs there"
                )
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 2.0)

    def _refusal(
        self, code: Any, details: str, method: str, where: str, idempotent: bool
    ) -> Exception | None:
        """The error a driver's answer `code` ends `call` with, or None to retry it."""
        grpc = self._grpc
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return NodeEvictedError(
                f"node {self.config.node_id!r}: the unbroken driver at {where} refused "
                f"it: {details}"
            )
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return RendezvousConnectionError(
                f"the unbroken driver at {where} refused our credentials ({details}); "
                f"set {TOKEN_ENV} or --rdzv-conf token_file=PATH to the driver's token"
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return RendezvousConnectionError(
                f"the unbroken driver at {where} refused {method}: {details}"
            )
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL):
            return RendezvousStateError(
                f"the unbroken driver at {where} refused {method}: {details}"
            )
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return RendezvousConnectionError(
                f"{where} does not serve the unbroken rendezvous ({details}); is "
                "--rdzv-endpoint the address of `unbroken driver`?"
            )
        if code == grpc.StatusCode.ABORTED and not idempotent:
            return RendezvousConnectionError(
                f"{method} at {where}: {details}; not retried (it may have landed)"
            )
        return None


def summarize(state: bytes) -> Any:
    """A RoundSummary of torch's pickled rendezvous state (our own bytes; for events)."""
    from unbroken.proto import rendezvous_pb2 as rpb

    s = load_state(state)  # the bytes this process just pickled, loaded the careful way
    ranked = sorted(s.participants.items(), key=lambda kv: kv[1])
    return rpb.RoundSummary(
        round=int(s.round),
        complete=bool(s.complete),
        closed=bool(s.closed),
        participants=[repr(n) for n, _ in ranked],
        waiting=sorted(repr(n) for n in s.wait_list),
        spares=sorted(repr(n) for n in s.redundancy_list),
    )


class DriverRendezvousBackend(RendezvousBackend):
    """torch's RendezvousBackend on the driver: the token is the state's etcd revision."""

    def __init__(self, client: DriverClient) -> None:
        self.client = client
        self._state_key = client.config.state_key  # b"": asked of the driver at first use

    @property
    def _key(self) -> bytes:
        """The run's state key: configured, else the driver's (`GetKey`, asked once)."""
        if not self._state_key:
            c = self.client
            resp = c.call("GetKey", c._rpb.GetKeyRequest(), budget_s=c.config.connect_timeout_s)
            if len(resp.key) < 16:
                raise RendezvousStateError(f"the driver at {c.endpoint} sent no rendezvous key")
            self._state_key = bytes(resp.key)
        return self._state_key

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def _open(self, blob: bytes) -> bytes:
        """torch's pickle inside a stored state, authenticated (RendezvousStateError if not)."""
        try:
            return open_sealed(self._key, self.client.config.run_id, blob)
        except StateAuthError as e:
            log.error("rendezvous state refused", run=self.client.config.run_id, error=str(e))
            raise RendezvousStateError(
                f"the unbroken driver at {self.client.endpoint} holds a rendezvous state this "
                f"node refuses: {e}"
            ) from e

    def get_state(self) -> tuple[bytes, Any] | None:
        rpb = self.client._rpb
        resp = self.client.call("GetState", rpb.GetStateRequest())
        return (self._open(bytes(resp.state)), int(resp.token)) if resp.found else None

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        rpb = self.client._rpb
        try:
            summary = summarize(state)
        except Exception:  # a state torch changed the shape of: record no summary
            summary = rpb.RoundSummary()
        sealed = seal(self._key, self.client.config.run_id, state)
        resp = self.client.call(
            "SetState",
            rpb.SetStateRequest(state=sealed, token=int(token or 0), summary=summary),
        )
        if not resp.ok and not resp.token:
            return None  # no state stored at all (it was expected to exist)
        stored = state if resp.ok else self._open(bytes(resp.state))
        return stored, int(resp.token), bool(resp.ok)


class DriverStore(dist.Store):
    """A c10d Store kept by the driver (etcd), for the elastic agents of one run.

    Blocking calls (get, wait) honour the store's timeout (`set_timeout`, default 5 min)
    and raise `DistStoreError` when it passes, as TCPStore does.
    """

    def __init__(self, client: DriverClient) -> None:
        super().__init__()
        self.client = client

    def _timeout(self) -> timedelta:
        return self.timeout  # type: ignore[attr-defined,no-any-return]  # c10d Store's property

    def _deadline(self, timeout: timedelta | None) -> float:
        t = self._timeout() if timeout is None else timeout
        return time.monotonic() + max(t.total_seconds(), 0.0)

    def _poll(self, method: str, make: Callable[[int], Any], deadline: float) -> Any:
        """Long-poll `method` until its answer is positive or `deadline` passes."""
        while True:
            wait_s = max(0.0, min(LONG_POLL_S, deadline - time.monotonic()))
            resp = self._call(method, make(int(wait_s * 1000)), wait_s=wait_s)
            if getattr(resp, "found", False) or getattr(resp, "ready", False):
                return resp
            if time.monotonic() >= deadline:
                return resp

    def _call(self, method: str, request: Any, **kw: Any) -> Any:
        try:
            return self.client.call(method, request, **kw)
        except RendezvousConnectionError as e:
            raise dist.DistNetworkError(str(e)) from e
        except RendezvousStateError as e:
            raise dist.DistStoreError(str(e)) from e

    @staticmethod
    def _bytes(value: Any) -> bytes:
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        if isinstance(value, list):  # torch passes std::vector<uint8_t> as a list of ints
            return bytes(value)
        return str(value).encode()

    def set(self, key: str, value: Any) -> None:
        rpb = self.client._rpb
        self._call("StoreSet", rpb.StoreSetRequest(key=key, value=self._bytes(value)))

    def get(self, key: str) -> bytes:
        rpb = self.client._rpb
        deadline = self._deadline(None)
        resp = self._poll("StoreGet", lambda ms: rpb.StoreGetRequest(key=key, wait_ms=ms), deadline)
        if not resp.found:
            raise dist.DistStoreError(
                f"timed out after {self._timeout()} waiting for key {key!r} in the unbroken "
                f"rendezvous store (run {self.client.config.run_id})"
            )
        return bytes(resp.value)

    def try_get(self, key: str) -> bytes | None:
        """The value of `key` now, or None where it is not set (no waiting)."""
        resp = self._call("StoreGet", self.client._rpb.StoreGetRequest(key=key, wait_ms=0))
        return bytes(resp.value) if resp.found else None

    def add(self, key: str, value: int) -> int:
        rpb = self.client._rpb
        resp = self._call("StoreAdd", rpb.StoreAddRequest(key=key, delta=value), idempotent=False)
        return int(resp.value)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        rpb = self.client._rpb
        resp = self._call(
            "StoreCompareSet",
            rpb.StoreCompareSetRequest(
                key=key, expected=self._bytes(expected_value), desired=self._bytes(desired_value)
            ),
        )
        return bytes(resp.value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        rpb = self.client._rpb
        deadline = self._deadline(timeout)
        resp = self._poll(
            "StoreWait", lambda ms: rpb.StoreWaitRequest(keys=keys, wait_ms=ms), deadline
        )
        if not resp.ready:
            raise dist.DistStoreError(
                f"timed out waiting for keys {list(resp.missing)} in the unbroken rendezvous "
                f"store (run {self.client.config.run_id})"
            )

    def check(self, keys: list[str]) -> bool:
        rpb = self.client._rpb
        return bool(self._call("StoreCheck", rpb.StoreCheckRequest(keys=keys)).ready)

    def delete_key(self, key: str) -> bool:
        rpb = self.client._rpb
        return bool(self._call("StoreDelete", rpb.StoreDeleteRequest(key=key)).deleted)

    def num_keys(self) -> int:
        rpb = self.client._rpb
        return int(self._call("StoreNumKeys", rpb.StoreNumKeysRequest()).count)


class UnbrokenRendezvousHandler(DynamicRendezvousHandler):
    """torch's DynamicRendezvousHandler with a fresh worker TCPStore in every round.

    torch 2.13 keeps the TCPStore that rank 0's agent serves to its workers for all
    rounds, so after a restart the workers of the new round can read the keys the dead
    ones wrote (gloo/NCCL addresses) and fail to connect, restart after restart
    (pytorch#135712; we saw it here: a killed worker used up every restart). Each round
    therefore gets its own server, announced through the round's prefix in the driver's
    store; that also follows rank 0 when it moves to another node.

    With `in_job` (rdzv conf in_job=1) a failed worker replaces its own node's workers
    only, and the other nodes' keep their processes (agent/rdzvinjob.py).
    """

    in_job: InJobRounds | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        if self.in_job is not None:
            info = self.in_job.replace_me()
            if info is not None:
                return info
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None  # the last round's workers are stopped by now
        info = super().next_rendezvous()
        if self.in_job is not None:
            self.in_job.after_round(info)
        return info

    def participants(self) -> int:
        """How many nodes torch's rendezvous state lists now (dead ones dropped)."""
        with self._heartbeat_lock:
            self._state_holder.sync()
            return len(self._state_holder.state.participants)

    def num_nodes_waiting(self) -> int:
        waiting = super().num_nodes_waiting()
        if self.in_job is not None and not waiting and self.in_job.poll():
            return 1  # the local workers did not hold: restart them into the new world
        return waiting

    @property
    def use_agent_store(self) -> bool:
        # an in-job world's store is its rank 0 worker's (the agents' stays for their exit)
        shared = super().use_agent_store
        return shared and not (self.in_job is not None and self.in_job.active)


def _flag(raw: Any) -> bool:
    """An rdzv conf switch: 1/true/yes/on, 0/false/no/off or absent (ValueError otherwise)."""
    if raw is None or str(raw).strip().lower() in ("", "0", "false", "no", "off"):
        return False
    if str(raw).strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"rdzv conf in_job={raw!r} must be 1 or 0 (true/false)")


def _timeouts(params: RendezvousParameters) -> RendezvousTimeout:
    def seconds(key: str) -> timedelta | None:
        v = params.get_as_int(f"{key}_timeout")
        return None if v is None else timedelta(seconds=v)

    return RendezvousTimeout(
        seconds("join"), seconds("last_call"), seconds("close"), seconds("heartbeat")
    )


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's handler for `--rdzv-backend=unbroken` (see the module docstring).

    Raises:
        ValueError: a bad --rdzv-endpoint, --rdzv-id or rdzv conf value.
        RendezvousConnectionError: the driver did not answer within connect_timeout.
        NodeEvictedError: the driver evicted this node.
    """
    config = config_from_params(params)
    client = DriverClient(config)
    # first contact: a clear error now rather than a rendezvous timeout later
    client.call("GetState", client._rpb.GetStateRequest(), budget_s=config.connect_timeout_s)
    backend = DriverRendezvousBackend(client)
    handler = UnbrokenRendezvousHandler.from_backend(
        params.run_id,
        DriverStore(client),
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        _timeouts(params),
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3,
    )
    if _flag(params.get("in_job")):
        timeout = params.get("in_job_timeout")
        try:
            timeout_s = float(timeout) if timeout is not None else DEFAULT_IN_JOB_TIMEOUT_S
        except ValueError:
            raise ValueError(
                f"rdzv conf in_job_timeout={timeout!r} must be a number of seconds"
            ) from None
        handler.in_job = InJobRounds(handler._store, timeout_s, participants=handler.participants)
    client.node_desc = repr(handler._this_node)
    log.info(
        "unbroken rendezvous",
        driver=client.endpoint,
        run=config.run_id,
        node=config.node_id,
        desc=client.node_desc,
    )
    return handler
