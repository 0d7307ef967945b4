"""Leader failover between two real driver processes sharing one etcd.

The old leader is a separate Python process that wins the election and appends as fast as
it can, printing every acknowledged event. The test process is the standby. It must not lead
while the old leader keeps appending; when the old leader is SIGKILLed the standby must lead
once its lease expires (how fast a new leader takes over is measured by bench/recovery.py's
driver kill; tests never assert on wall time); when it is SIGSTOPped
past its TTL and then SIGCONTed, every append it tries must be refused (by etcd's fence,
not just by its own bookkeeping). In both cases every acknowledged event is in the log and
no event of the old leader comes after the new leader's first.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from unbroken.driver.election import Election, current_leader
from unbroken.driver.etcd import EmbeddedEtcd
from unbroken.driver.etcdlog import NO_ARCHIVE, EtcdEventLog, connect
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

TTL_S = 2.0

CHILD = r"""
import asyncio, sys
from unbroken.driver.etcd import EtcdConfig
from unbroken.driver.etcdlog import NO_ARCHIVE, EtcdEventLog, connect
from unbroken.driver.election import Election
from unbroken.driver.eventlog import NotLeaderError
from unbroken.proto import events_pb2 as ev

async def main(endpoint, job):
    client = await connect(EtcdConfig(endpoints=[endpoint]))
    election = Election(client, job, "old", ttl_s=float(sys.argv[3]), address="old:1")
    lead = await election.campaign(timeout_s=10)
    log = EtcdEventLog(client, job, lead, archive_url=NO_ARCHIVE, append_timeout_s=1.0)
    print("LEADING", flush=True)
    i = 0
    while True:
        try:
            got = await log.append(ev.Event(node_lost=ev.NodeLost(node_id=f"old-{i}")))
            print(f"ACK {got.seq} {got.event_id}", flush=True)
        except NotLeaderError:
            print(f"REFUSED lost={election.lost.is_set()}", flush=True)
            # A fresh log object with the stale leadership: only etcd can refuse it now.
            again = EtcdEventLog(client, job, lead, archive_url=NO_ARCHIVE)
            try:
                await again.append(ev.Event(node_lost=ev.NodeLost(node_id="old-late")))
                print("ACCEPTED-LATE", flush=True)
            except NotLeaderError:
                print("REFUSED-BY-ETCD", flush=True)
            return
        i += 1
        await asyncio.sleep(0.002)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


class Child:
    """The old leader: a real process whose stdout lines are collected by a thread."""

    def __init__(self, endpoint: str, job: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, endpoint, job, str(TTL_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_for(self, pred: object, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():  # type: ignore[operator]
            if time.monotonic() > deadline:
                err = self.proc.stderr.read() if self.proc.poll() is not None else ""  # type: ignore[union-attr]
                raise AssertionError(f"child: {self.lines[-5:]} {err[-2000:]}")
            time.sleep(0.01)

    def acked(self) -> dict[int, str]:
        return {int(p[1]): p[2] for p in (ln.split() for ln in list(self.lines)) if p[0] == "ACK"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


@pytest.fixture
def child_factory(etcd_server: EmbeddedEtcd) -> Iterator[object]:
    children: list[Child] = []

    def make(job: str) -> Child:
        c = Child(etcd_server.endpoint, job)
        children.append(c)
        return c

    yield make
    for c in children:
        c.stop()


async def _take_over(etcd: EmbeddedEtcd, job: str, old: Child, fault: object) -> list[ev.Event]:
    """Standby campaigns, `fault()` hits the leader; returns the log."""
    client = await connect(etcd.config)
    standby = Election(client, job, "new", ttl_s=TTL_S, address="new:1")
    campaign = asyncio.create_task(standby.campaign(timeout_s=30))
    acked = len(old.acked())
    deadline = time.monotonic() + 30
    while len(old.acked()) < acked + 20:  # the old leader goes on appending meanwhile
        assert time.monotonic() < deadline, f"the old leader stopped appending: {old.lines[-5:]}"
        assert not campaign.done(), "the standby must not lead while the old leader lives"
        await asyncio.sleep(0.01)
    assert not campaign.done(), "the standby must not lead while the old leader lives"
    fault()  # type: ignore[operator]
    lead = await campaign  # within its timeout_s: the old lease expires after TTL_S
    assert await current_leader(client, job) == ("new", "new:1")
    log = EtcdEventLog(client, job, lead, archive_url=NO_ARCHIVE)
    try:
        for i in range(5):
            await log.append(ev.Event(node_lost=ev.NodeLost(node_id=f"new-{i}")))
        return await log.read()
    finally:
        await log.close()
        await standby.resign()
        await client.close()


def _check_history(stored: list[ev.Event], acked: dict[int, str]) -> None:
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))  # dense
    assert len({e.event_id for e in stored}) == len(stored)  # no duplicate
    for seq, event_id in acked.items():  # every acknowledged event is there
        assert stored[seq - 1].event_id == event_id
    first_new = min(e.seq for e in stored if e.writer == "new")
    assert all(e.seq < first_new for e in stored if e.writer == "old"), (
        "an append of the old leader was accepted after the new leader took over"
    )
    assert [e.node_lost.node_id for e in stored if e.writer == "new"] == [
        f"new-{i}" for i in range(5)
    ]


def test_sigkilled_leader_is_replaced_once_its_lease_expires(
    etcd_server: EmbeddedEtcd, child_factory: object
) -> None:
    job = "failover-" + uuid.uuid4().hex[:8]
    old = child_factory(job)  # type: ignore[operator]
    old.wait_for(lambda: len(old.acked()) >= 20, 30)
    stored = asyncio.run(
        asyncio.wait_for(
            _take_over(etcd_server, job, old, lambda: old.proc.send_signal(signal.SIGKILL)), 60
        )
    )
    old.proc.wait(10)
    _check_history(stored, old.acked())


def test_sigstopped_leader_past_its_ttl_is_refused_after_sigcont(
    etcd_server: EmbeddedEtcd, child_factory: object
) -> None:
    job = "failover-" + uuid.uuid4().hex[:8]
    old = child_factory(job)  # type: ignore[operator]
    old.wait_for(lambda: len(old.acked()) >= 20, 30)
    stored = asyncio.run(
        asyncio.wait_for(
            _take_over(etcd_server, job, old, lambda: old.proc.send_signal(signal.SIGSTOP)), 60
        )
    )
    old.proc.send_signal(signal.SIGCONT)
    old.wait_for(lambda: old.proc.poll() is not None, 20)
    assert old.proc.returncode == 0
    assert any(ln.startswith("REFUSED lost=") for ln in old.lines)
    assert "REFUSED-BY-ETCD" in old.lines and "ACCEPTED-LATE" not in old.lines

    # Re-read: nothing the old leader tried after SIGCONT got in.
    async def reread() -> list[ev.Event]:
        client = await connect(etcd_server.config)
        try:
            return await EtcdEventLog(client, job, None, archive_url=NO_ARCHIVE).read()
        finally:
            await client.close()

    final = asyncio.run(reread())
    assert [e.event_id for e in final] == [e.event_id for e in stored]
    _check_history(final, old.acked())


def test_a_waiting_standby_wins_over_a_driver_just_restarted(etcd_server: EmbeddedEtcd) -> None:
    """A killed leader respawned at once races the standby that has been waiting; the
    standby heard the agents ask for the leader during the election (so a node that died
    meanwhile is lost after the failover grace, not the whole grace), and in bench-recovery
    the respawned driver won half the races. A candidate younger than `young_s` tries
    `defer_s` after the leader key goes; alone, it still leads."""

    async def main() -> None:
        client = await connect(etcd_server.config)
        job = "senior-" + uuid.uuid4().hex[:8]
        leader = Election(client, job, "leader")
        standby = Election(client, job, "standby", young_s=0.0)  # waiting for long
        fresh = Election(client, job, "fresh", defer_s=1.0)  # just restarted
        tasks: dict[str, asyncio.Task[object]] = {}
        try:
            await leader.campaign(timeout_s=10)
            tasks = {e.driver_id: asyncio.create_task(e.campaign()) for e in (standby, fresh)}
            await asyncio.sleep(0.5)  # both watch the leader key
            await leader.resign()
            done, _ = await asyncio.wait(
                tasks.values(), timeout=30, return_when=asyncio.FIRST_COMPLETED
            )
            assert [t.result().driver_id for t in done] == ["standby"]  # type: ignore[attr-defined]
            await standby.resign()
            won = await asyncio.wait_for(tasks["fresh"], 30)
            assert won.driver_id == "fresh"  # type: ignore[attr-defined]
        finally:
            for t in tasks.values():
                t.cancel()
            for e in (leader, standby, fresh):
                await e.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 90))


LISTENING_LEADER = r"""
import asyncio, sys
from unbroken.driver.etcd import EtcdConfig
from unbroken.driver.etcdlog import connect
from unbroken.driver.election import Election

async def main(endpoint, job, ttl):
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = await connect(EtcdConfig(endpoints=[endpoint]))
    election = Election(client, job, "old", ttl_s=ttl, address=f"127.0.0.1:{port}")
    await election.campaign(timeout_s=10)
    print("LEADING", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_standby_takes_a_dead_leaders_place_without_waiting_out_its_lease(
    etcd_server: EmbeddedEtcd, fault: str
) -> None:
    """A leader whose process died leaves its address refusing connections: the standby
    revokes its lease and leads, long before the lease's TTL (30 s here, the standby's
    campaign gives up after 20). A frozen leader (SIGSTOP) still has its socket, whose
    connections the kernel accepts: that proves nothing, and the standby waits for the
    lease (3 s here) as before, revoking nothing."""
    job = f"probe-{fault}-{uuid.uuid4().hex[:6]}"
    ttl = "30" if fault == "kill" else "3"
    old = subprocess.Popen(
        [sys.executable, "-c", LISTENING_LEADER, etcd_server.endpoint, job, ttl],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert old.stdout is not None
        while (line := old.stdout.readline()) and line.strip() != "LEADING":
            pass  # the election's own log lines
        assert line.strip() == "LEADING", "the leader process did not lead"

        async def go() -> int:
            client = await connect(etcd_server.config)
            standby = Election(client, job, "new", ttl_s=TTL_S, address="new:1", probe_leader=True)
            try:
                campaign = asyncio.create_task(standby.campaign(timeout_s=20))
                await asyncio.sleep(0.5)
                assert not campaign.done(), "the standby led while the leader lived"
                assert standby.revoked_dead == 0
                old.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                await campaign
                assert await current_leader(client, job) == ("new", "new:1")
                return standby.revoked_dead
            finally:
                await standby.resign()
                await client.close()

        assert asyncio.run(go()) == (1 if fault == "kill" else 0)
    finally:
        old.send_signal(signal.SIGCONT)
        old.kill()
        old.wait(10)
