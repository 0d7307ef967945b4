"""The agent's driver is the driver: a node certificate of the same CA cannot pose as one.

Before, every `unbroken certs` certificate carried localhost, 127.0.0.1 and serverAuth,
and the agent accepted any certificate of its CA: a node's certificate served a fake
driver, which deleted the agent's storage and silenced the real driver with a huge term.
Real mTLS gRPC servers (the driver service in-process) and a real `Agent` connecting.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.inproc import driver
from unbroken.agent.config import AgentConfig
from unbroken.agent.daemon import Agent
from unbroken.agent.peerid import PeerIdentityError, check_peer
from unbroken.common.tls import TlsConfig
from unbroken.driver import certs
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.integration


def _tls(tmp: Path, pair: tuple[Path, Path]) -> TlsConfig:
    return TlsConfig(cert=str(pair[0]), key=str(pair[1]), ca=str(tmp / "ca.pem"))


def test_certificates_carry_only_what_their_role_needs(tmp_path: Path) -> None:
    certs.make_ca(tmp_path)
    usage = {}
    for who in ("driver:main", "node:gpu-1", "operator:alice", "viewer:v", "launcher:l"):
        crt, _ = certs.issue(tmp_path, who)
        c = x509.load_pem_x509_certificate(crt.read_bytes())
        san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        eku = c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        hosts = san.get_values_for_type(x509.DNSName) + [
            str(ip) for ip in san.get_values_for_type(x509.IPAddress)
        ]
        usage[who] = (sorted(hosts), ExtendedKeyUsageOID.SERVER_AUTH in eku)
    assert usage["driver:main"] == (["127.0.0.1", "localhost"], True)
    assert usage["node:gpu-1"] == ([], True)  # its replica server; no host name
    for who in ("operator:alice", "viewer:v", "launcher:l"):
        assert usage[who] == ([], False), who
    with pytest.raises(ValueError, match="serves nothing"):
        certs.issue(tmp_path, "operator:bob", hosts=["127.0.0.1"])


def test_an_agent_refuses_a_node_certificate_posing_as_its_driver(tmp_path: Path) -> None:
    """A node certificate issued with the driver's host (`--host 127.0.0.1`, allowed for a
    relay) passes gRPC's checks; the agent reads its principal, finds `node:evil`, and
    never registers. The real driver's certificate passes."""
    certs.make_ca(tmp_path)
    evil = _tls(tmp_path, certs.issue(tmp_path, "node:evil", hosts=["127.0.0.1"]))
    real = _tls(tmp_path, certs.issue(tmp_path, "driver:main"))
    mine = _tls(tmp_path, certs.issue(tmp_path, "node:node-a"))

    async def go() -> None:
        async with driver(ServiceConfig(tls=evil)) as (fake, _store, addr):
            with pytest.raises(PeerIdentityError, match="presents node:evil, not driver"):
                await asyncio.to_thread(check_peer, addr, mine, role="driver")
            agent = Agent(AgentConfig(drivers=[addr], node_id="node-a", tls=mine))
            run = asyncio.create_task(agent.run())
            await asyncio.sleep(3)  # several connection attempts
            agent.stop.set()
            await asyncio.wait_for(run, 30)
            assert "node-a" not in fake.view.nodes  # it never registered with the impostor
        async with driver(ServiceConfig(tls=real)) as (svc, _store, addr):
            assert await asyncio.to_thread(check_peer, addr, mine, role="driver") == "driver:main"
            agent = Agent(AgentConfig(drivers=[addr], node_id="node-a", tls=mine))
            run = asyncio.create_task(agent.run())
            deadline = asyncio.get_running_loop().time() + 30
            while "node-a" not in svc.view.nodes:
                assert asyncio.get_running_loop().time() < deadline, "never registered"
                await asyncio.sleep(0.1)
            agent.stop.set()
            await asyncio.wait_for(run, 30)

    asyncio.run(go())


def test_a_forged_huge_term_cannot_silence_the_real_leader() -> None:
    """A command with term 2^63-1 (forged: by a relay, or a driver that got through) was
    adopted, and every later command of the real leader was then 'stale'. Now the agent
    refuses a term far above the one its registration was answered under, and the real
    leader's next command is obeyed."""

    async def go() -> None:
        async with driver() as (svc, _store, addr):
            assert svc.journal is not None
            agent = Agent(AgentConfig(drivers=[addr], node_id="node-a"))
            run = asyncio.create_task(agent.run())
            deadline = asyncio.get_running_loop().time() + 30
            while not ("node-a" in svc.view.nodes and svc.view.nodes["node-a"].outbox is not None):
                assert asyncio.get_running_loop().time() < deadline, "no session"
                await asyncio.sleep(0.1)
            real = svc.journal.state.leader_term
            svc.journal.state.leader_term = (1 << 63) - 1  # what the forger stamps
            forged = await svc.request("node-a", dpb.DriverMessage(pause=dpb.Pause()), 10)
            assert not forged.ack.ok and "refused" in forged.ack.detail, forged
            assert agent.term_seen == real
            svc.journal.state.leader_term = real
            ok = await svc.request("node-a", dpb.DriverMessage(pause=dpb.Pause()), 10)
            assert "stale" not in ok.ack.detail, ok
            agent.stop.set()
            await asyncio.wait_for(run, 30)

    asyncio.run(go())
