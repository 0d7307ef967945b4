"""An agent retries a live standby driver quickly while it waits for an election.

After the leader dies, its standby answers every Register with UNAVAILABLE and the leader it
knows (none yet, or the dead one until its lease expires). The agent's exponential backoff
used to grow to --backoff-max-s (2 s, up to 3 s with jitter) during those ~2 s, so agents
found the new leader seconds after it won (bench-recovery's driver kills: 2.0-2.1 s to
detect, and one node's session 3 s after the election). While a standby says so, the waits
stay under --election-retry-s; a driver that refuses the connection, or a standby naming a
leader outside --driver (never followed), keeps the backoff growing.

The waits are the ones the agent asks `asyncio.sleep` for, recorded (and not slept) against
a real gRPC server on loopback: no assertion on wall time.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest

from unbroken.agent import link
from unbroken.agent.config import AgentConfig
from unbroken.agent.daemon import Agent
from unbroken.common import channel
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.unit


class _Standby(dgrpc.DriverServicer):
    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.calls = 0

    async def Register(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "not the leader",
            trailing_metadata=((channel.LEADER_KEY, self.leader),),
        )


DEFAULTS = AgentConfig(drivers=["127.0.0.1:1"], node_id="n0")


async def _refusing() -> str:
    """A loopback address nothing listens on (every connection refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def _waits(drivers: list[str], monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits the agent asks for between its first 8 attempts at `drivers`."""
    agent = Agent(AgentConfig(drivers=drivers, node_id="n0"))
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args: Any, **kwargs: Any) -> Any:
        if delay > 0.01:  # the agent's waits (grpc's own are zero-length yields)
            waits.append(delay)
            if len(waits) >= 8:
                agent.stop.set()
        return await real_sleep(0)

    monkeypatch.setattr(link.asyncio, "sleep", sleep)
    monkeypatch.setattr(link.random, "uniform", lambda a, b: 1.0)
    try:
        await asyncio.wait_for(agent.link.run(agent.register_request()), 30)
    finally:
        monkeypatch.undo()
    return waits


async def _with_standby(
    leader: str, dead: str | None, monkeypatch: pytest.MonkeyPatch
) -> list[float]:
    """Waits against a standby naming `leader`, with `dead` as a second endpoint."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    dgrpc.add_DriverServicer_to_server(_Standby(leader), server)
    await server.start()
    try:
        drivers = [f"127.0.0.1:{port}"] + ([dead] if dead else [])
        return await _waits(drivers, monkeypatch)
    finally:
        await server.stop(None)


@pytest.mark.parametrize("names_dead_leader", [False, True])
def test_a_standby_waiting_for_an_election_is_retried_quickly(
    names_dead_leader: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standby that knows no leader, or names the one of ours that just died (whose
    refused connections come between the standby's answers)."""

    async def main() -> list[float]:
        dead = await _refusing() if names_dead_leader else None
        return await _with_standby(dead or "", dead, monkeypatch)

    waits = asyncio.run(main())
    assert len(waits) == 8
    assert max(waits) <= DEFAULTS.election_retry_s, waits


@pytest.mark.parametrize("foreign_leader", [False, True])
def test_a_refused_connection_or_a_foreign_leader_keeps_the_backoff(
    foreign_leader: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No driver at all, or a standby naming a leader outside --driver: the backoff grows to
    --backoff-max-s as before."""

    async def main() -> list[float]:
        if foreign_leader:
            return await _with_standby("10.9.9.9:1", None, monkeypatch)
        return await _waits([await _refusing()], monkeypatch)

    waits = asyncio.run(main())
    assert len(waits) == 8
    assert max(waits) == DEFAULTS.backoff_max_s, waits


def test_election_retry_is_checked() -> None:
    with pytest.raises(ValueError, match="election_retry_s"):
        AgentConfig(drivers=["127.0.0.1:1"], node_id="n0", election_retry_s=0)
    with pytest.raises(ValueError, match="election_retry_s"):
        AgentConfig(drivers=["127.0.0.1:1"], node_id="n0", election_retry_s=5.0)
