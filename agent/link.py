"""The agent's link to the driver: find the leader, register, hold the session, back off.

Driver endpoints are a list: a driver that is not the leader answers UNAVAILABLE with the
leader's address, which the link tries next when it is one of its configured endpoints (a
redirect elsewhere is ignored: it could carry the token to anyone); other failures move to the
next endpoint after a jittered exponential backoff. While a standby answers that the leader is
unknown or one of ours (an election under way), retries stay `election_retry_s` apart. Without
a successful registration for `max_disconnected_s` the link gives up (`AgentExit`, code 3):
every retry has a limit.

With `--relay`, the session goes through the relay; a relay that is unreachable, refuses, or
is silent for `SILENT_S` sends the link to the driver directly at once (and the next
registration tries the relay again). What a session does once held (heartbeats, commands) is
the agent's: the link is given it as a coroutine.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
import structlog

from unbroken.agent.config import AgentConfig
from unbroken.agent.peerid import PeerIdentityError, check_peer
from unbroken.agent.relay import SILENT_S, parse_relay
from unbroken.common import channel
from unbroken.common.tls import channel_credentials, token_metadata
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

log = structlog.get_logger(__name__)

# After a standby driver said the leader is unknown or one of ours (an election under way),
# retries stay `election_retry_s` apart for this long, whichever endpoint refuses meanwhile
# (the dead leader refuses the connection: that says nothing about the election).
ELECTION_WINDOW_S = 10.0


class AgentExit(Exception):
    """The agent must stop; `code` is the process exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


#: Called with each successful registration's answer, the driver and the relay's id ("" direct).
OnRegistered = Callable[[dpb.RegisterResponse, str, str], None]


class DriverLink:
    """Registers with the leader among `config.drivers` and holds sessions until `stop`.

    Args:
        config: the agent's configuration (endpoints, credentials, backoff, relay).
        stop: set to end the link after the current attempt.
        on_registered: told each registration's answer before its session starts.
        session: holds one session on a driver's (or relay's) stub until it ends.
        fence: run when the driver declared this node lost, before registering again.
    """

    def __init__(
        self,
        config: AgentConfig,
        stop: asyncio.Event,
        *,
        on_registered: OnRegistered,
        session: Callable[[dgrpc.DriverStub], Coroutine[Any, Any, None]],
        fence: Callable[[], Awaitable[None]],
    ) -> None:
        self.config = config
        self.stop = stop
        self._on_registered = on_registered
        self._session = session
        self._fence = fence
        self.endpoints = list(config.drivers)
        self.current = 0
        self._electing_until = 0.0  # until then, retries are `election_retry_s` apart
        self.metadata = token_metadata(config.token)
        self.via: tuple[str, str] | None = parse_relay(config.relay) if config.relay else None
        self._relay_down = False  # the relay failed us: go to the driver directly
        self.heard = 0.0  # monotonic time of the last message down the session (the agent's)

    def channel(self, target: str) -> grpc.aio.Channel:
        """A channel to a driver or relay, with TLS when configured."""
        if self.config.tls.enabled:
            creds = channel_credentials(self.config.tls)
            return grpc.aio.secure_channel(target, creds, options=channel.CLIENT_OPTIONS)
        return grpc.aio.insecure_channel(target, options=channel.CLIENT_OPTIONS)

    async def run(self, request: dpb.RegisterRequest) -> None:
        """Register and hold sessions until `stop` is set.

        Raises:
            AgentExit: credentials or the node refused, or no driver for `max_disconnected_s`.
        """
        backoff = self.config.backoff_base_s
        last_ok = time.monotonic()
        while not self.stop.is_set():
            target = self.endpoints[self.current % len(self.endpoints)]
            ch = self.channel(target)
            try:
                stub = dgrpc.DriverStub(ch)
                via = self.via if self.via is not None and not self._relay_down else None
                resp = await self._register(stub, target, request, via)
                last_ok = time.monotonic()
                backoff = self.config.backoff_base_s
                self._electing_until = 0.0
                self._on_registered(resp, target, via[0] if via else "")
                if await self._hold(stub, via):
                    continue  # the relay failed us: straight to the driver, no backoff
            except grpc.aio.AioRpcError as e:
                self._on_rpc_error(e, target)
                if "declared lost" in (e.details() or ""):
                    await self._fence()
            except PeerIdentityError as e:
                log.error("not our driver", error=str(e))
                self.current += 1
            except (OSError, ssl.SSLError) as e:
                log.warning("driver unreachable", driver=target, error=str(e))
                self.current += 1
            finally:
                await ch.close(grace=None)
            if self.stop.is_set():
                return
            if time.monotonic() - last_ok > self.config.max_disconnected_s:
                raise AgentExit(
                    3,
                    f"no driver reachable for {self.config.max_disconnected_s} s "
                    f"(tried {', '.join(self.endpoints)})",
                )
            wait = backoff
            if time.monotonic() < self._electing_until:
                # a live standby answered: the control plane is up and electing; a short
                # jittered retry finds the winner (at most every agent's few calls a
                # second, each refused cheaply, for the lease's TTL)
                wait = min(backoff, self.config.election_retry_s)
            await asyncio.sleep(wait * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, self.config.backoff_max_s)

    async def _register(
        self,
        stub: dgrpc.DriverStub,
        target: str,
        request: dpb.RegisterRequest,
        via: tuple[str, str] | None,
    ) -> dpb.RegisterResponse:
        md = self.metadata
        if via is not None:
            md = (*md, (channel.RELAY_KEY, via[0]))
        if self.config.tls.enabled:  # the driver's principal, not any of its CA's
            await asyncio.to_thread(check_peer, target, self.config.tls, role="driver")
        resp: dpb.RegisterResponse = await stub.Register(
            request,
            timeout=self.config.register_timeout_s,
            metadata=md,
            wait_for_ready=False,
        )
        return resp

    async def _hold(self, stub: dgrpc.DriverStub, via: tuple[str, str] | None) -> bool:
        """Hold the session, directly or through the relay; True when the relay failed us
        (the caller goes to the driver directly at once)."""
        if via is None:
            await self._session(stub)
            self._relay_down = False  # next time, try the relay again
            return False
        if self.config.tls.enabled:  # the relay is the node it was named as
            try:
                await asyncio.to_thread(
                    check_peer, via[1], self.config.tls, role="node", name=via[0]
                )
            except (PeerIdentityError, OSError, ssl.SSLError) as e:
                log.error("relay refused; going to the driver directly", error=str(e))
                self._relay_down = True
                return True
        return await self._relayed_session(via)

    async def _relayed_session(self, via: tuple[str, str]) -> bool:
        """Hold the session through the relay; True when the relay failed (unreachable,
        refused, died): the caller goes to the driver directly at once."""
        ch = self.channel(via[1])
        session = asyncio.create_task(self._session(dgrpc.DriverStub(ch)))
        self.heard = time.monotonic()
        try:
            while not session.done():
                await asyncio.wait({session}, timeout=0.1)
                if not session.done() and time.monotonic() - self.heard > SILENT_S:
                    session.cancel()  # stopped or cut off: it breaks no connection
                    with contextlib.suppress(asyncio.CancelledError):
                        await session
                    log.warning(
                        "relay silent; going to the driver directly", relay=via[0], s=SILENT_S
                    )
                    self._relay_down = True
                    return True
            session.result()
            return False
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # the driver sent us away through the relay (declared lost): register again
                log.warning("the driver asks us to register again", details=e.details())
                return True
            log.warning(
                "relay failed; going to the driver directly",
                relay=via[0],
                code=e.code().name,
                details=(e.details() or "")[:200],
            )
            self._relay_down = True
            return True
        finally:
            if not session.done():  # (we are being cancelled)
                session.cancel()
            await ch.close(grace=None)

    def _on_rpc_error(self, e: grpc.aio.AioRpcError, target: str) -> None:
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise AgentExit(2, f"driver {target} refused our credentials: {e.details()}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise AgentExit(2, f"driver {target} rejected the registration: {e.details()}")
        details = (e.details() or "").lower()
        if code == grpc.StatusCode.FAILED_PRECONDITION and "register" not in details:
            raise AgentExit(1, f"driver {target} refused this node: {e.details()}")
        leader, standby = "", False
        for k, v in e.trailing_metadata() or ():
            if k == channel.LEADER_KEY:
                leader, standby = str(v), True
        # a standby that knows no leader, or names one of ours (maybe the one that just
        # died: its lease has not expired yet), is waiting for an election to end
        if standby and (not leader or leader in self.config.drivers):
            self._electing_until = time.monotonic() + ELECTION_WINDOW_S
        if leader and leader != target and leader in self.config.drivers:
            self.current = self.endpoints.index(leader)
            log.info("redirected to the leader", leader=leader)
        elif leader and leader != target:  # not one of ours: never follow (nor send it a token)
            self.current += 1
            log.warning(
                "ignoring a redirect to a driver not in --driver", leader=leader, driver=target
            )
        elif code != grpc.StatusCode.FAILED_PRECONDITION:
            self.current += 1
            log.warning(
                "driver unreachable; trying the next one",
                driver=target,
                code=code.name,
                details=(e.details() or "")[:200],
            )
