"""Leader terms count within one etcd cluster and one incarnation of the job.

An agent kept the newest term it had seen for good: after etcd was restored or replaced
(terms start again at 1), every command of the new leader was 'stale' until the agent
restarted, and a command stamped with the earlier incarnation's higher term was taken.
Now the registration says what its term counts in (`term_scope`: the etcd cluster id and
the creation of the job's term key); under a new scope the agent counts afresh, and a
command of another scope is refused whatever its number.

A real agent and the driver service in-process; real gRPC; the real etcd election's
scope is checked against an embedded etcd.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.inproc import driver, until
from unbroken.agent.config import AgentConfig
from unbroken.agent.daemon import Agent
from unbroken.driver.config import LoopConfig, ServiceConfig
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore, Leadership
from unbroken.driver.service import DriverService, build_server
from unbroken.driver.term import Term
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


async def _lead(config: Any, job: str) -> tuple[int, str]:
    """Win `job`'s election once on the etcd of `config` and resign: (term, scope)."""
    from unbroken.driver import election as electionlib
    from unbroken.driver import etcdlog

    client = await etcdlog.connect(config)
    election = electionlib.Election(client, job, "d1", ttl_s=2)
    try:
        won = await election.campaign(timeout_s=20)
        return won.term, won.scope
    finally:
        await election.resign()
        await client.close()


async def _session(svc: object, agent: Agent, term: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not (
        agent.session_term == term
        and "node-a" in svc.view.nodes  # type: ignore[attr-defined]
        and svc.view.nodes["node-a"].outbox is not None  # type: ignore[attr-defined]
    ):
        assert loop.time() < deadline, "no session"
        await asyncio.sleep(0.05)


def test_terms_of_another_etcd_cluster_or_incarnation_neither_silence_nor_steer() -> None:
    async def go() -> None:
        async with driver() as (svc, _store, addr):
            assert svc.journal is not None
            state = svc.journal.state
            state.leader_term, state.leader_scope = 5, "c1.7"
            agent = Agent(AgentConfig(drivers=[addr], node_id="node-a"))
            run = asyncio.create_task(agent.run())
            try:
                await _session(svc, agent, 5)
                r = await svc.request("node-a", dpb.DriverMessage(pause=dpb.Pause()), 10)
                assert "refused" not in r.ack.detail and agent.term_seen == 5, r

                # etcd is replaced (or restored): the new leader's terms begin again at 1
                state.leader_term, state.leader_scope = 1, "c2.3"
                svc.sessions.end(
                    "node-a", grpc.StatusCode.FAILED_PRECONDITION, "call Register again"
                )
                await _session(svc, agent, 1)
                r = await svc.request("node-a", dpb.DriverMessage(pause=dpb.Pause()), 10)
                assert "stale" not in r.ack.detail, "the new cluster's leader is silenced"
                assert agent.term_seen == 1

                # a command of the earlier incarnation, with its higher term, is refused
                state.leader_term, state.leader_scope = 5, "c1.7"
                r = await svc.request("node-a", dpb.DriverMessage(pause=dpb.Pause()), 10)
                assert not r.ack.ok and "scope" in r.ack.detail, r
                assert agent.term_seen == 1
                state.leader_term, state.leader_scope = 1, "c2.3"
                r = await svc.request("node-a", dpb.DriverMessage(pause=dpb.Pause()), 10)
                assert "refused" not in r.ack.detail and "stale" not in r.ack.detail, r
            finally:
                agent.stop.set()
                await asyncio.wait_for(run, 30)

    asyncio.run(go())


class _HeldElection(InMemoryEventLog):
    """A log whose first append (the term's `LeaderElected`) waits for `release`: the
    window in which an agent can register with a leader whose election is not yet
    recorded (an etcd append under load)."""

    def __init__(self, store: InMemoryStore, grant: Leadership) -> None:
        super().__init__(store, "job", grant)
        self.release = asyncio.Event()

    async def append_many(self, events: Iterable[ev.Event]) -> list[ev.Event]:
        events = list(events)
        if any(e.HasField("leader_elected") for e in events):
            await self.release.wait()
        return await super().append_many(events)


def test_an_agent_registering_before_the_election_is_recorded_obeys_the_new_leader() -> None:
    """CI saw an agent register while the new leader's `LeaderElected` was being written:
    its registration carried the log's previous scope ('') and every command of the term
    was refused as of another scope until the job gave up. The registration now carries
    the election's own term and scope."""

    async def go() -> None:
        store = InMemoryStore()
        grant = dataclasses.replace(store.elect("d1"), scope="c9.2")
        store.leader = grant  # the election's grant names its scope, as etcd's does
        svc = DriverService(ServiceConfig(), driver_id="d1", job_id="job")
        svc.start()
        server, port, _ = await build_server(svc, "127.0.0.1:0")
        log_ = _HeldElection(store, grant)
        term = Term(svc, log_, grant, f"127.0.0.1:{port}", loop=LoopConfig())
        begun = asyncio.create_task(term.begin())
        agent = Agent(AgentConfig(drivers=[f"127.0.0.1:{port}"], node_id="node-a"))
        run = asyncio.create_task(agent.run())
        try:
            await until(lambda: svc.journal is not None, 10, "the term to lead")
            await _session(svc, agent, grant.term)
            assert not store.events, "registered after the election was recorded"
            assert agent.term_scope == "c9.2", agent.term_scope
            log_.release.set()
            await asyncio.wait_for(begun, 10)
            assert svc.journal is not None and svc.journal.state.leader_scope == "c9.2"
            r = await svc.request("node-a", dpb.DriverMessage(pause=dpb.Pause()), 10)
            # obeyed past the term check (this agent runs no workers: it says so)
            assert "scope" not in r.ack.detail and agent.term_seen == grant.term, r
        finally:
            log_.release.set()
            agent.stop.set()
            await asyncio.wait_for(run, 30)
            if not begun.done():
                begun.cancel()
            await term.end()
            await server.stop(0)
            await svc.close()

    asyncio.run(go())


def test_a_real_election_names_its_cluster_and_the_jobs_incarnation(
    etcd_server: object, fresh_etcd: object
) -> None:
    """Two real etcd clusters, and one job deleted and started again in one of them: a
    term's scope changes with either, and stays while the same job is led again."""
    from aetcd import rpc

    from unbroken.driver import etcdlog

    async def wipe(etcd: object, job: str) -> None:
        client = await etcdlog.connect(etcd.config)  # type: ignore[attr-defined]
        try:
            prefix = f"/unbroken/{job}/".encode()  # ...up to, not including, /unbroken/{job}0
            end = prefix[:-1] + bytes([prefix[-1] + 1])
            await client.kvstub.DeleteRange(rpc.DeleteRangeRequest(key=prefix, range_end=end))
        finally:
            await client.close()

    async def go() -> None:
        t1, s1 = await _lead(etcd_server.config, "scoped")  # type: ignore[attr-defined]
        t2, s2 = await _lead(etcd_server.config, "scoped")  # type: ignore[attr-defined]
        assert (t2, s2) == (t1 + 1, s1)  # the same job led again: the same scope
        _, other = await _lead(fresh_etcd.config, "scoped")  # type: ignore[attr-defined]  # another cluster
        assert other.split(".")[0] != s1.split(".")[0], (other, s1)
        await wipe(etcd_server, "scoped")  # the job deleted and started again
        t3, s3 = await _lead(etcd_server.config, "scoped")  # type: ignore[attr-defined]
        assert t3 == 1 and s3 != s1 and s3.split(".")[0] == s1.split(".")[0], (s3, s1)

    asyncio.run(go())


def test_an_etcd_restored_from_a_snapshot_of_the_same_cluster_leads_above_the_agents_terms(
    tmp_path: Path,
) -> None:
    """The usual disaster recovery: etcd restored from a snapshot with the old member's
    name and peer URL (the same cluster id, the same creation of the term key). Plainly
    restored, its next leader's term is below what the agents saw after the snapshot and
    every command of it is dropped as a stale leader's; restored through
    `driver/etcdrestore.py` the terms go on above them. Real etcd servers, real snapshot
    and restore (etcdctl, etcdutl), real elections."""
    from unbroken.agent.commands import _term_refusal
    from unbroken.driver import etcdbin
    from unbroken.driver.etcd import EmbeddedEtcd
    from unbroken.driver.etcdrestore import RESTORE_TERM_RAISE, raise_terms, restore_snapshot

    binary = etcdbin.resolve(None)
    snap = tmp_path / "snap.db"
    with EmbeddedEtcd(tmp_path / "old") as old:
        peer = f"http://127.0.0.1:{old.peer_port}"
        asyncio.run(_lead(old.config, "restored"))
        asyncio.run(_lead(old.config, "restored"))
        saved = subprocess.run(
            [str(etcdbin.etcdctl_beside(binary)), "--endpoints", old.endpoint, "snapshot", "save",
             str(snap)],
            capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"}, check=False,
        )  # fmt: skip
        assert saved.returncode == 0, saved.stderr
        seen, scope = asyncio.run(
            _lead(old.config, "restored")
        )  # two more elections after the snapshot
        seen, scope = asyncio.run(_lead(old.config, "restored"))
    assert seen == 4
    agent = Agent(AgentConfig(drivers=["127.0.0.1:1"], node_id="node-a"))
    agent.term_scope, agent.term_seen = scope, seen  # what the agents saw of the old history

    def refusal(term: int, scope: str) -> str | None:
        agent.session_term = term  # registered with the new leader
        return _term_refusal(agent, dpb.DriverMessage(term=term, term_scope=scope))

    etcdutl = etcdbin.etcdutl_beside(binary)
    restore_snapshot(snap, tmp_path / "plain", etcdutl=etcdutl, peer_url=peer)
    with EmbeddedEtcd(tmp_path / "plain") as plain:
        term, same = asyncio.run(_lead(plain.config, "restored"))
    assert same == scope and term == 3, (term, same, scope)  # the same cluster, terms back
    assert "stale" in (refusal(term, same) or ""), "the gap this test is about is not there"

    restore_snapshot(snap, tmp_path / "raised", etcdutl=etcdutl, peer_url=peer)
    with EmbeddedEtcd(tmp_path / "raised") as raised:
        assert asyncio.run(raise_terms(raised.config)) == {"restored": (2, 2 + RESTORE_TERM_RAISE)}
        term, same = asyncio.run(_lead(raised.config, "restored"))
    assert same == scope and term == 3 + RESTORE_TERM_RAISE
    assert refusal(term, same) is None  # the new leader is obeyed
    assert "stale" in (refusal(seen - 1, scope) or "")  # a stale leader of the old history is not


def test_unbroken_etcd_restores_a_snapshot_raises_the_terms_and_serves_it(tmp_path: Path) -> None:
    """`unbroken etcd --restore-from SNAPSHOT --data-dir DIR` as an operator runs it; a data
    dir that already holds etcd data is refused, naming what to do."""
    from unbroken.driver import etcdbin
    from unbroken.driver.etcd import EmbeddedEtcd
    from unbroken.driver.etcdrestore import RESTORE_TERM_RAISE

    snap = tmp_path / "snap.db"
    with EmbeddedEtcd(tmp_path / "old") as old:
        asyncio.run(_lead(old.config, "cli-restored"))
        subprocess.run(
            [str(etcdbin.etcdctl_beside(etcdbin.resolve(None))), "--endpoints", old.endpoint,
             "snapshot", "save", str(snap)],
            capture_output=True, env={**os.environ, "ETCDCTL_API": "3"}, check=True,
        )  # fmt: skip
    cli = [sys.executable, "-m", "unbroken.cli.main", "etcd", "--restore-from", str(snap)]
    proc = subprocess.Popen(
        [*cli, "--data-dir", str(tmp_path / "new")], stdout=subprocess.PIPE, text=True
    )
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("etcd is up at"):
                break
        text = "".join(lines)
        assert f"job cli-restored: leader term 1 -> {1 + RESTORE_TERM_RAISE}" in text, text
        endpoint = text.split("etcd is up at ")[1].split()[0]
        from unbroken.driver.etcd import EtcdConfig

        term, _ = asyncio.run(_lead(EtcdConfig(endpoints=[endpoint]), "cli-restored"))
        assert term == 2 + RESTORE_TERM_RAISE
        # the raise alone, as after restoring a cluster by hand
        alone = subprocess.run(
            [*cli[:4], "--raise-terms-at", endpoint], capture_output=True, text=True, timeout=60
        )
        raised = f"leader term {2 + RESTORE_TERM_RAISE} -> {2 + 2 * RESTORE_TERM_RAISE}"
        assert alone.returncode == 0 and raised in alone.stdout, alone
    finally:
        proc.terminate()
        proc.wait(30)
    again = subprocess.run(
        [*cli, "--data-dir", str(tmp_path / "new")], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 2 and "already holds etcd data" in again.stderr, again.stderr
