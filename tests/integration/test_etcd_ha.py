"""The control plane through the loss of an etcd member.

A real 3-member etcd cluster on loopback. The leader's client starts on member 0; member 0
is SIGKILLed while the leader appends, then, after it heals, the member the client moved
to. The client must move to a live member by itself (it used to retry the dead one until
the driver gave up), the leader must keep its lease (or lead again within the TTL + 1 s),
and every acknowledged event must be in the log exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aetcd import rpc

from tests.procs import Procs, read_events, start_driver
from unbroken.cli.cluster import until
from unbroken.driver import election as electionlib
from unbroken.driver import etcdlog
from unbroken.driver.etcd import EmbeddedEtcdCluster, EtcdConfig, health
from unbroken.driver.etcdclient import EtcdClient, Keys
from unbroken.driver.eventlog import EventLogError, Leadership
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

# The lease TTL: short so the test is quick, long enough that a raft election on 2 busy
# cores (the killed member may be etcd's leader) fits in what is left of it after the last
# keep-alive (driver/election.py RENEW_MAX_S). 2 s, then 3 s with a keep-alive every 1 s,
# were flaky in CI.
TTL_S = 4.0


async def _append_through(elog: etcdlog.EtcdEventLog, seconds: float, acked: list[str]) -> int:
    """Append one event every 50 ms for `seconds`; return how many appends failed."""
    failed = 0
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        e = ev.Event(cause=f"ha-{len(acked)}-{i}", log_alert=ev.LogAlert(node_id="n", line="x"))
        e.event_id = f"ha-{time.monotonic_ns()}"
        try:
            await elog.append(e)
            acked.append(e.event_id)
        except EventLogError:
            failed += 1
        await asyncio.sleep(0.05)
    return failed


def test_the_leader_keeps_writing_through_the_loss_of_its_etcd_member(tmp_path: Path) -> None:
    cluster = EmbeddedEtcdCluster(3, tmp_path / "etcd").start()

    async def go() -> None:
        client = await etcdlog.connect(EtcdConfig(endpoints=cluster.endpoints))
        assert isinstance(client, EtcdClient) and client.endpoint == cluster.members[0].endpoint
        election = electionlib.Election(client, "ha", "d1", ttl_s=TTL_S)
        leadership = await election.campaign(timeout_s=10)
        elog = etcdlog.EtcdEventLog(client, "ha", leadership, archive_url="")
        acked: list[str] = []
        try:
            await _append_through(elog, 1.0, acked)
            before = len(acked)
            for victim in (0, None):  # member 0, then (healed) the member the client moved to
                index = victim if victim is not None else cluster.endpoints.index(client.endpoint)
                cluster.members[index].kill()
                failed = await _append_through(elog, TTL_S + 2.0, acked)
                assert client.endpoint != cluster.members[index].endpoint, "still on the dead one"
                assert not election.lost.is_set(), (
                    f"the lease was lost with a quorum alive ({failed} appends failed, "
                    f"{client.failovers} failovers)"
                )
                # and writes go on: every append of the next half second is acknowledged
                n = len(acked)
                assert await _append_through(elog, 0.5, acked) == 0
                assert len(acked) > n
                cluster.members[index].restart()
                deadline = time.monotonic() + 20
                while not health(cluster.members[index].endpoint):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            assert len(acked) > before and client.failovers >= 2
            events = await elog.read()
            ids = [e.event_id for e in events]
            assert len(ids) == len(set(ids)), "an event appended twice"
            assert set(acked) <= set(ids), "an acknowledged event is missing"
        finally:
            await elog.close()
            await election.resign()
            await client.close()

    try:
        asyncio.run(go())
    finally:
        cluster.stop()


def test_only_the_leader_reports_the_leader_health_service() -> None:
    """A load balancer finds the driver that answers operator calls by its health check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
    from unbroken.driver.service import (
        LEADER_HEALTH,
        SERVICE_NAME,
        DriverService,
        ServiceConfig,
        build_server,
    )

    async def status(addr: str, name: str) -> int:
        async with grpc.aio.insecure_channel(addr) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=name), timeout=5
            )
            return int(r.status)

    async def until(addr: str, name: str, want: int) -> None:
        deadline = time.monotonic() + 30
        while (got := await status(addr, name)) != want:
            assert time.monotonic() < deadline, f"{addr} {name}: {got}, not {want}"
            await asyncio.sleep(0.05)

    async def go() -> None:
        store = InMemoryStore()
        lead = DriverService(ServiceConfig(), driver_id="a", job_id="j")
        lead.lead(InMemoryEventLog(store, "j", store.elect("a")), "")
        standby = DriverService(ServiceConfig(), driver_id="b", job_id="j")
        servers = [await build_server(s, "127.0.0.1:0") for s in (lead, standby)]
        try:
            a, b = (f"127.0.0.1:{port}" for _, port, _ in servers)
            serving = health_pb2.HealthCheckResponse.SERVING
            await until(a, SERVICE_NAME, serving)
            await until(b, SERVICE_NAME, serving)
            await until(a, LEADER_HEALTH, serving)
            assert await status(b, LEADER_HEALTH) == health_pb2.HealthCheckResponse.NOT_SERVING
            lead.step_down()
            await until(a, LEADER_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
        finally:
            for server, _, _ in servers:
                await server.stop(0)
            await lead.close()
            await standby.close()

    asyncio.run(go())


def test_a_stalled_event_loop_does_not_cost_the_lease(etcd_server: object) -> None:
    """The keep-alive runs in its own thread: a driver whose loop is blocked for longer
    than the TTL (a registration storm, a long fold) still leads when it wakes up."""

    async def go() -> None:
        client = await etcdlog.connect(etcd_server.config)  # type: ignore[attr-defined]
        election = electionlib.Election(client, "stall", "d1", ttl_s=TTL_S)
        won = await election.campaign(timeout_s=10)
        try:
            time.sleep(TTL_S * 2 + 1)  # the whole event loop stalls, well past the TTL
            await asyncio.sleep(0.5)
            assert not election.lost.is_set()
            holder = await electionlib.current_leader(client, "stall")
            assert holder is not None and holder[0] == "d1"
            # the log's fence agrees: the lease is still the leader key's
            elog = etcdlog.EtcdEventLog(client, "stall", won, archive_url="")
            await elog.append(ev.Event(log_alert=ev.LogAlert(node_id="n", line="after stall")))
            await elog.close()
        finally:
            await election.resign()
            await client.close()

    asyncio.run(go())


def test_the_driver_holds_its_lease_for_the_ttl_it_is_given(
    tmp_path: Path, etcd_server: object
) -> None:
    """`--etcd-lease-ttl-s` reaches the election: etcd granted the leader's lease that TTL
    (a deployment on a 3-member etcd wants more than the 2 s default; see the flag)."""
    config = etcd_server.config  # type: ignore[attr-defined]
    procs = Procs(tmp_path)
    try:
        start_driver(
            procs, tmp_path, "--etcd", etcd_server.endpoint,  # type: ignore[attr-defined]
            "--job-id", "ttl", "--archive-url", "none", "--etcd-lease-ttl-s", "4",
        )  # fmt: skip

        async def granted() -> int:
            client = await etcdlog.connect(config)
            try:
                r = await client.kvstub.Range(rpc.RangeRequest(key=Keys("ttl").leader))
                if not r.kvs:
                    return 0
                lease = json.loads(r.kvs[0].value)["lease_id"]
                assert r.kvs[0].lease == lease
                t = await client.leasestub.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease))
                return int(t.grantedTTL)
            finally:
                await client.close()

        assert until(lambda: asyncio.run(granted()), 30, "a leader", procs, poll_s=0.2) == 4
    finally:
        procs.stop_all()


async def _campaign_through_outage(election: electionlib.Election, timeout_s: float) -> Leadership:
    """Campaign as the driver does: etcd away (no quorum yet) is retried, not fatal."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await election.campaign(timeout_s=max(0.1, deadline - time.monotonic()))
        except EventLogError:
            assert time.monotonic() < deadline, "etcd did not come back"
            await asyncio.sleep(0.2)


def _quorum_lost(cluster: EmbeddedEtcdCluster, client: EtcdClient) -> list[int]:
    """SIGKILL two of the three members, the client's own first (it may be etcd's leader)."""
    mine = cluster.endpoints.index(client.endpoint)
    victims = [mine, next(i for i in range(3) if i != mine)]
    for i in victims:
        cluster.members[i].kill()
    return victims


@contextlib.asynccontextmanager
async def _leader_in_doubt(
    cluster: EmbeddedEtcdCluster, job: str
) -> AsyncIterator[tuple[EtcdClient, electionlib.Election, Leadership, list[int]]]:
    """d1 leads `job`, then etcd loses its quorum until d1's lease is in doubt: the client,
    the election, its first leadership and the members killed (the client's own first)."""
    client = await etcdlog.connect(EtcdConfig(endpoints=cluster.endpoints))
    assert isinstance(client, EtcdClient)
    election = electionlib.Election(client, job, "d1", ttl_s=TTL_S)
    try:
        won = await election.campaign(timeout_s=10)
        victims = _quorum_lost(cluster, client)
        await asyncio.wait_for(election.lost.wait(), TTL_S + 5)
        assert election.in_doubt
        yield client, election, won, victims
    finally:
        await election.resign()
        await client.close()


# `make test-all` only (CI budget): the next test checks the same through a real driver
# process (it steps down without a quorum and leads again in its term)
@pytest.mark.slow
def test_a_leader_keeps_its_term_through_a_lost_etcd_quorum(tmp_path: Path) -> None:
    """etcd short of a quorum for longer than the TTL: the leader cannot know whether its
    lease expired, so it stops leading (`lost`); but it keeps the lease, and once etcd has a
    quorum again (its new leader extends every lease) the next campaign finds the leader key
    on that lease and leads again in the same term, without waiting for an expiry."""
    cluster = EmbeddedEtcdCluster(3, tmp_path / "etcd").start()
    ttl = TTL_S

    async def go() -> None:
        async with _leader_in_doubt(cluster, "quorum") as (client, election, won, victims):
            assert election.doubts == 1
            await asyncio.sleep(2 * ttl)  # well past the TTL: it would have expired by now
            cluster.members[victims[0]].restart()  # a quorum again
            t0 = time.monotonic()
            again = await _campaign_through_outage(election, 30)
            took = time.monotonic() - t0
            assert again == won, f"a new term {again} after the outage, not {won}"
            assert election.kept_terms == 1 and not election.lost.is_set()
            assert not election.in_doubt
            holder = await electionlib.current_leader(client, "quorum")
            assert holder is not None and holder[0] == "d1"
            # the log's fence agrees: the old leadership appends
            elog = etcdlog.EtcdEventLog(client, "quorum", again, archive_url="")
            await elog.append(ev.Event(log_alert=ev.LogAlert(node_id="n", line="same term")))
            await elog.close()
            print(f"led again in the same term {took:.2f} s after the quorum came back")
            # and the lease is kept alive from then on
            await asyncio.sleep(ttl + 1)
            assert not election.lost.is_set()

    try:
        asyncio.run(go())
    finally:
        cluster.stop()


def test_a_lease_that_expired_in_doubt_is_not_taken_back(tmp_path: Path) -> None:
    """The safety half: when the doubted lease did end (here revoked while etcd had no
    quorum for the leader; an expiry deletes the key the same way) and another driver
    leads, the old leader's campaign does not lead: etcd refuses the old lease, it takes a
    new one and stands by."""
    cluster = EmbeddedEtcdCluster(3, tmp_path / "etcd").start()
    ttl = TTL_S

    async def go() -> None:
        async with _leader_in_doubt(cluster, "gone") as (client, election, won, victims):
            cluster.members[victims[0]].restart()
            # before d1 campaigns again, its lease ends (as an expiry would) and d2 wins
            other_client = await etcdlog.connect(EtcdConfig(endpoints=cluster.endpoints))
            other = electionlib.Election(other_client, "gone", "d2", ttl_s=ttl)
            try:
                await other_client.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=won.lease_id))
                theirs = await _campaign_through_outage(other, 30)
                assert theirs.term == won.term + 1
                deadline = time.monotonic() + 10  # the keeper hears that the lease is gone
                while election.in_doubt:
                    assert time.monotonic() < deadline, "the keeper still doubts a revoked lease"
                    await asyncio.sleep(0.1)
                with pytest.raises(TimeoutError):
                    await election.campaign(timeout_s=3)
                holder = await electionlib.current_leader(client, "gone")
                assert holder is not None and holder[0] == "d2"
                # and the old leadership cannot write one event
                elog = etcdlog.EtcdEventLog(client, "gone", won, archive_url="")
                with pytest.raises(EventLogError):
                    await elog.append(ev.Event(log_alert=ev.LogAlert(node_id="n", line="stale")))
                await elog.close()
            finally:
                await other.resign()
                await other_client.close()

    try:
        asyncio.run(go())
    finally:
        cluster.stop()


def test_the_driver_leads_again_in_its_term_after_etcd_lost_its_quorum(tmp_path: Path) -> None:
    """The same through a real driver process: etcd has no quorum for longer than the
    driver's TTL, the driver steps down, and when a quorum is back it leads again in the
    term it had (two LeaderElected of one term in the log), not in a new one."""
    cluster = EmbeddedEtcdCluster(3, tmp_path / "etcd").start()
    procs = Procs(tmp_path)

    def elected() -> list[ev.LeaderElected]:
        try:
            events = read_events(cluster.config, "q")
        except EventLogError:
            return []
        return [e.leader_elected for e in events if e.WhichOneof("payload") == "leader_elected"]

    try:
        start_driver(
            procs, tmp_path, "--etcd", ",".join(cluster.endpoints), "--job-id", "q",
            "--archive-url", "none", "--etcd-lease-ttl-s", f"{TTL_S:g}",
        )  # fmt: skip
        first = until(elected, 30, "the driver's LeaderElected", procs)[0]
        for i in (0, 1):  # no quorum: the driver cannot confirm its lease
            cluster.members[i].kill()
        time.sleep(TTL_S + 2)  # > the TTL: it stepped down
        cluster.members[0].restart()
        t0 = time.monotonic()
        again = until(lambda: elected()[1:], 60, "a second LeaderElected", procs)
        print(f"leading again {time.monotonic() - t0:.2f} s after the quorum came back: {again[0]}")
        assert (again[0].driver_id, again[0].term, again[0].lease_id) == (
            first.driver_id,
            first.term,
            first.lease_id,
        ), f"led again as {again[0]}, not in its term {first.term}"
        assert "leadership lost" in procs.log("driver")
    finally:
        procs.stop_all()
        cluster.stop()


def test_a_watch_whose_channel_closes_under_it_ends_it_does_not_cancel(
    etcd_server: object,
) -> None:
    """After a failover the client closes the old member's channel, and grpc cancels the
    calls still open on it: a standby's watch for the leader key's deletion raised
    CancelledError out of its campaign (seen here under a failover; the driver would have
    crashed). `read_stream` reads that as the stream's end; a cancelled reader still
    raises."""
    import grpc

    from unbroken.driver.etcdclient import read_stream

    async def watch(client: EtcdClient) -> Any:
        call = rpc.WatchStub(client.channel).Watch()
        await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(key=b"/nothing")))
        created = await read_stream(call)
        assert created.created
        return call

    async def go() -> None:
        client = await etcdlog.connect(etcd_server.config)  # type: ignore[attr-defined]
        assert isinstance(client, EtcdClient)
        try:
            call = await watch(client)
            reader = asyncio.ensure_future(read_stream(call))
            await asyncio.sleep(0.2)
            await client.channel.close()  # what a failover does to the old member's channel
            assert await asyncio.wait_for(reader, 5) is grpc.aio.EOF
        finally:
            await client.close()
        client = await etcdlog.connect(etcd_server.config)  # type: ignore[attr-defined]
        assert isinstance(client, EtcdClient)
        try:
            reader = asyncio.ensure_future(read_stream(await watch(client)))
            await asyncio.sleep(0.2)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
        finally:
            await client.close()

    asyncio.run(go())


def test_a_cluster_whose_member_cannot_bind_starts_again_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI saw a 3-member cluster fail to start once (a member exited at start: a probed
    port taken before it bound). A member that exits at start restarts the cluster on new
    ports, from fresh data dirs, instead of failing the caller."""
    import socket

    from unbroken.driver import etcd as etcdmod

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    real = etcdmod.free_port
    handed = iter([busy])  # the first port handed out is someone else's

    monkeypatch.setattr(etcdmod, "free_port", lambda host="127.0.0.1": next(handed, None) or real())
    cluster = EmbeddedEtcdCluster(1, tmp_path / "etcd")
    try:
        cluster.start()
        assert health(cluster.endpoint)
        assert busy not in (cluster.members[0].client_port, cluster.members[0].peer_port)
    finally:
        cluster.stop()
        taken.close()
