"""EtcdEventLog beyond the shared contract: archival on disk and in etcd, exactly-once under
unknown outcomes, bad input, unreachable and full etcd, and etcd dying mid-stream.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from pathlib import Path

import pytest

from unbroken.driver import state as statelib
from unbroken.driver.archive import Archive
from unbroken.driver.election import Election
from unbroken.driver.etcd import EmbeddedEtcd, EtcdConfig, free_port
from unbroken.driver.etcdlog import NO_ARCHIVE, EtcdEventLog, Keys, connect
from unbroken.driver.eventlog import (
    EventTooLargeError,
    Leadership,
    LogFullError,
    LogUnavailableError,
    NotLeaderError,
)
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


def lost(node: str, **kw: object) -> ev.Event:
    return ev.Event(node_lost=ev.NodeLost(node_id=node, silent_ms=300), **kw)  # type: ignore[arg-type]


def job() -> str:
    return "job-" + uuid.uuid4().hex[:8]


async def count(client: object, prefix: bytes) -> int:
    from aetcd import rpc

    r = await client.kvstub.Range(
        rpc.RangeRequest(  # type: ignore[attr-defined]
            key=prefix, range_end=prefix[:-1] + bytes([prefix[-1] + 1]), count_only=True
        )
    )
    return int(r.count)


def test_archival_trims_etcd_and_replay_equals_full_history(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    async def main() -> None:
        client = await connect(etcd_server.config)
        j = job()
        election = Election(client, j, "d1")
        log = EtcdEventLog(
            client,
            j,
            await election.campaign(timeout_s=10),
            snapshot_every=50,
            archive_url=str(tmp_path / "arch"),
        )
        try:
            for i in range(0, 237, 7):
                await log.append_many(
                    [
                        ev.Event(
                            node_registered=ev.NodeRegistered(
                                node_id=f"n{(i + k) % 11}", epoch=i + k
                            )
                        )
                        if k % 2
                        else lost(f"n{(i + k) % 11}")
                        for k in range(7)
                    ]
                )
            head = await log.last_seq()
            assert head == 238
            deadline = time.monotonic() + 20
            while (await log.latest_snapshot()).last_seq < 200 or await count(
                client, Keys(j).ev_prefix
            ) > head - 200:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "archival did not finish"
                await asyncio.sleep(0.05)
            keys = Keys(j)
            assert await count(client, keys.ev_prefix) == head - 200  # only the tail in etcd
            assert await count(client, keys.base + b"id/") == head - 200
            archive = Archive(str(tmp_path / "arch"), j)
            archived = archive.read(1, 200)
            assert [e.seq for e in archived] == list(range(1, 201))
            assert sum(s.last_seq - s.first_seq + 1 for s in archive.segments()) == 200
            tail = await log.read(201)
            history = statelib.fold(archived + tail, statelib.initial(j))
            assert await log.replay() == history  # snapshot + tail == whole archived history
            assert [e.seq for e in await log.read(190, 210)] == list(range(190, 211))
        finally:
            await log.close()
            await election.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_unknown_outcomes_never_duplicate_and_retries_find_the_event(
    etcd_server: EmbeddedEtcd,
) -> None:
    """Deadlines too short to confirm anything: whatever landed is found, nothing twice."""

    def big(i: int) -> ev.Event:  # ~1 MiB per batch: slow enough to miss a ms deadline
        return ev.Event(
            event_id=f"e{i:03d}", log_alert=ev.LogAlert(node_id=f"n{i}", line="x" * 30_000)
        )

    async def main() -> None:
        client = await connect(etcd_server.config)
        j = job()
        election = Election(client, j, "d1")
        lead = await election.campaign(timeout_s=10)
        calm = EtcdEventLog(client, j, lead, archive_url=NO_ARCHIVE)
        hasty_logs = []
        outcomes: list[object] = []
        try:
            # 0.1 ms: no etcd transaction completes that fast, even on an idle machine
            for k, deadline_s in enumerate((0.0001, 0.0005, 0.002, 0.008, 0.032)):
                hasty = EtcdEventLog(
                    client, j, lead, archive_url=NO_ARCHIVE, append_timeout_s=deadline_s
                )
                hasty_logs.append(hasty)
                outcomes += await asyncio.gather(
                    *[hasty.append(big(i)) for i in range(10 * k, 10 * k + 10)],
                    return_exceptions=True,
                )
            assert all(isinstance(o, (ev.Event, LogUnavailableError)) for o in outcomes), [
                repr(o) for o in outcomes if not isinstance(o, ev.Event)
            ]
            unknown = sum(h.unknown_outcomes for h in hasty_logs)
            assert unknown > 0, "no deadline hit a transaction: the test tested nothing"
            # The caller retries everything (also what it saw succeed) on a healthy log.
            retried = await asyncio.gather(*[calm.append(big(i)) for i in range(60)])
            stored = await calm.read()
            assert [e.seq for e in stored] == list(range(1, 61))
            assert sorted(e.event_id for e in stored) == [f"e{i:03d}" for i in range(60)]
            assert {e.event_id: e.seq for e in retried} == {e.event_id: e.seq for e in stored}
            for o in outcomes:
                if isinstance(o, ev.Event):  # acknowledged by a hasty log: same seq
                    assert stored[o.seq - 1].event_id == o.event_id
        finally:
            for h in hasty_logs:
                await h.close()
            await calm.close()
            await election.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_second_driver_cannot_append_while_first_holds_the_lease(etcd_server: EmbeddedEtcd) -> None:
    async def main() -> None:
        client = await connect(etcd_server.config)
        j = job()
        first, second = Election(client, j, "d1"), Election(client, j, "d2")
        try:
            lead = await first.campaign(timeout_s=10)
            log1 = EtcdEventLog(client, j, lead, archive_url=NO_ARCHIVE)
            await log1.append(lost("a"))
            with pytest.raises(TimeoutError, match="d1"):
                await second.campaign(timeout_s=0.5)
            # Even forging a Leadership with its own live lease does not get it past the fence.
            forged = Leadership("d2", second._lease, lead.term + 1)
            log2 = EtcdEventLog(client, j, forged, archive_url=NO_ARCHIVE)
            with pytest.raises(NotLeaderError, match="d1"):
                await log2.append(lost("b"))
            assert [e.node_lost.node_id for e in await log1.read()] == ["a"]
            await log1.close()
            await log2.close()
        finally:
            await first.resign()
            await second.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_too_large_event_never_reaches_etcd(etcd_server: EmbeddedEtcd) -> None:
    async def main() -> None:
        from aetcd import rpc

        client = await connect(etcd_server.config)
        j = job()
        election = Election(client, j, "d1")
        log = EtcdEventLog(
            client,
            j,
            await election.campaign(timeout_s=10),
            archive_url=NO_ARCHIVE,
            max_event_bytes=1000,
        )
        try:
            await log.append(lost("small"))
            before = (await client.kvstub.Range(rpc.RangeRequest(key=b"x"))).header.revision
            with pytest.raises(EventTooLargeError, match="1000-byte cap"):
                await log.append(ev.Event(log_alert=ev.LogAlert(line="x" * 2000)))
            after = (await client.kvstub.Range(rpc.RangeRequest(key=b"x"))).header.revision
            assert after == before
        finally:
            await log.close()
            await election.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_unreachable_etcd_is_named_after_a_bounded_wait() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def main() -> None:
        # bounded: it gives up by itself (a hang would end in wait_for's TimeoutError)
        with pytest.raises(LogUnavailableError) as info:
            await asyncio.wait_for(connect(EtcdConfig(endpoints=dead, connect_timeout_s=0.5)), 60)
        assert dead[0] in str(info.value) and dead[1] in str(info.value)
        with pytest.raises(ValueError, match="endpoints is empty"):
            await connect(EtcdConfig())

    asyncio.run(main())


def test_nospace_alarm_is_log_full_and_nothing_acknowledged_is_lost(tmp_path: Path) -> None:
    etcd = EmbeddedEtcd(tmp_path / "etcd", quota_backend_bytes=2 * 1024 * 1024).start()

    async def main() -> None:
        client = await connect(etcd.config)
        j = job()
        election = Election(client, j, "d1")
        log = EtcdEventLog(client, j, await election.campaign(timeout_s=10), archive_url=NO_ARCHIVE)
        acked: list[ev.Event] = []
        try:
            with pytest.raises(LogFullError, match="NOSPACE") as info:
                for i in range(500):
                    acked.append(
                        await log.append(
                            ev.Event(log_alert=ev.LogAlert(node_id=f"n{i}", line="x" * 60_000))
                        )
                    )
            assert "alarm disarm" in str(info.value)
            assert len(acked) > 5
            with pytest.raises(LogFullError):
                await log.append(lost("still full"))
            stored = await log.read()
            assert [e.event_id for e in stored] == [e.event_id for e in acked]
        finally:
            await log.close()
            await election.resign()
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        etcd.stop(remove=True)


def test_etcd_killed_and_restarted_mid_stream_loses_and_duplicates_nothing(
    fresh_etcd: EmbeddedEtcd,
) -> None:
    async def main() -> None:
        client = await connect(fresh_etcd.config)
        j = job()
        election = Election(client, j, "d1", ttl_s=10)
        log = EtcdEventLog(
            client,
            j,
            await election.campaign(timeout_s=10),
            archive_url=NO_ARCHIVE,
            append_timeout_s=1.0,
        )
        acked: list[ev.Event] = []
        failed = 0

        async def writer() -> None:
            nonlocal failed
            for i in range(300):
                try:
                    acked.append(await log.append(lost(f"n{i}", event_id=f"e{i:04d}")))
                except LogUnavailableError:
                    failed += 1
                    # the caller's retry with the same id: lands once, or is found
                    acked.append(await _retry(log, lost(f"n{i}", event_id=f"e{i:04d}")))

        task = asyncio.create_task(writer())
        while len(acked) < 20:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(fresh_etcd.kill)
        assert len(acked) < 300, "etcd must die mid-stream"
        await asyncio.sleep(0.5)
        await asyncio.to_thread(fresh_etcd.restart)
        await asyncio.wait_for(task, 40)
        try:
            stored = await log.read()
            assert [e.seq for e in stored] == list(range(1, 301))
            assert [e.event_id for e in stored] == [f"e{i:04d}" for i in range(300)]
            assert [a.seq for a in acked] == list(range(1, 301))
        finally:
            await log.close()
            await election.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 90))


async def _retry(log: EtcdEventLog, event: ev.Event) -> ev.Event:
    for _ in range(20):
        try:
            return await log.append(event)
        except LogUnavailableError:
            await asyncio.sleep(0.25)
    raise AssertionError("etcd did not come back")


def test_new_leader_carries_on_archival_where_the_old_one_stopped(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    async def main() -> None:
        client = await connect(etcd_server.config)
        j = job()
        arch = str(tmp_path / "arch")
        first, second = Election(client, j, "d1"), Election(client, j, "d2")
        log1 = EtcdEventLog(
            client, j, await first.campaign(timeout_s=10), snapshot_every=10, archive_url=arch
        )
        log2: EtcdEventLog | None = None
        try:
            await log1.append_many([lost(f"a{i}") for i in range(25)])
            while not await _archived_upto(client, j, 20):
                await asyncio.sleep(0.02)
            await log1.close()
            await first.resign()
            # The successor archives elsewhere: reads still find the old segments via etcd.
            log2 = EtcdEventLog(
                client,
                j,
                await second.campaign(timeout_s=10),
                snapshot_every=10,
                archive_url=str(tmp_path / "arch2"),
            )
            await log2.append_many([lost(f"b{i}") for i in range(20)])
            while not await _archived_upto(client, j, 40):
                await asyncio.sleep(0.02)
            stored = await log2.read()
            assert [e.seq for e in stored] == list(range(1, 46))
            assert [e.writer for e in stored] == ["d1"] * 25 + ["d2"] * 20
            assert await log2.replay() == statelib.fold(stored, statelib.initial(j))
            # it archived only what the old leader had not: 21..40, in one segment or more
            # (how many depends on when its archiver ran)
            segs = Archive(str(tmp_path / "arch2"), j).segments()
            assert segs and segs[0].first_seq == 21 and segs[-1].last_seq == 40, segs
            assert all(a.last_seq + 1 == b.first_seq for a, b in itertools.pairwise(segs)), segs
        finally:
            if log2 is not None:
                await log2.close()
            await second.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


async def _archived_upto(client: object, job_id: str, seq: int) -> bool:
    import json

    from aetcd import rpc

    r = await client.kvstub.Range(rpc.RangeRequest(key=Keys(job_id).archived))  # type: ignore[attr-defined]
    return bool(r.kvs) and int(json.loads(r.kvs[0].value)["seq"]) >= seq


def test_archive_drops_stale_twins_and_reads_each_event_once(tmp_path: Path) -> None:
    archive = Archive(str(tmp_path), "j")
    mk = [ev.Event(seq=i, node_lost=ev.NodeLost(node_id=f"n{i}")) for i in range(1, 31)]
    archive.write_segment(mk[:10])
    archive.write_segment(mk[10:15])  # a crashed leader's segment, never committed
    archive.write_segment(mk[10:20])  # its successor's: same first seq, replaces it
    archive.write_segment(mk[20:30])
    assert [(s.first_seq, s.last_seq) for s in archive.segments()] == [(1, 10), (11, 20), (21, 30)]
    assert [e.seq for e in archive.read(1, 30)] == list(range(1, 31))
    assert [e.seq for e in archive.read(9, 22)] == list(range(9, 23))


def test_leader_notices_its_key_deleted_by_hand(etcd_server: EmbeddedEtcd) -> None:
    async def main() -> None:
        from aetcd import rpc

        client = await connect(etcd_server.config)
        j = job()
        election = Election(client, j, "d1")
        try:
            lead = await election.campaign(timeout_s=10)
            log = EtcdEventLog(client, j, lead, archive_url=NO_ARCHIVE)
            await log.append(lost("a"))
            await client.kvstub.DeleteRange(rpc.DeleteRangeRequest(key=Keys(j).leader))
            await asyncio.wait_for(election.lost.wait(), 5)
            with pytest.raises(NotLeaderError, match="nobody"):
                await log.append(lost("b"))
            await log.close()
        finally:
            await election.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_streamed_replay_over_many_pages_equals_the_fold_and_refuses_a_newer_schema(
    etcd_server: EmbeddedEtcd,
) -> None:
    """Replay folds each page while the next ones are in flight: across more pages than the
    window holds it equals folding what `read` returns; an event of a newer schema stops
    both, naming it."""
    from aetcd import rpc

    from unbroken.driver import etcdlog
    from unbroken.driver.eventlog import SchemaError

    async def main() -> None:
        client = await connect(etcd_server.config)
        j = job()
        election = Election(client, j, "d1")
        log = EtcdEventLog(
            client,
            j,
            await election.campaign(timeout_s=10),
            snapshot_every=10**6,
            archive_url=NO_ARCHIVE,
        )
        n = etcdlog.READ_PAGE * (etcdlog.READ_PARALLEL + 2) + 17
        try:
            for i in range(0, n, 100):
                await log.append_many(
                    [
                        ev.Event(node_registered=ev.NodeRegistered(node_id=f"n{k % 37}", epoch=k))
                        if k % 3
                        else lost(f"n{k % 37}")
                        for k in range(i, min(n, i + 100))
                    ]
                )
            events = await log.read()
            assert [e.seq for e in events] == list(range(1, n + 1))
            replayed = await log.replay()
            assert replayed == statelib.fold(events, statelib.initial(j))
            assert replayed.event_counts["node_lost"] == sum(1 for k in range(n) if k % 3 == 0)
            newer = ev.Event()
            newer.CopyFrom(events[n // 2])
            newer.schema_version = max(ev.SchemaVersion.values()) + 1
            await client.kvstub.Put(  # type: ignore[attr-defined]
                rpc.PutRequest(key=Keys(j).event(newer.seq), value=newer.SerializeToString())
            )
            for call in (log.read, log.replay):
                with pytest.raises(SchemaError, match=f"event {newer.seq} has schema version"):
                    await call()
        finally:
            await log.close()
            await election.resign()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))
