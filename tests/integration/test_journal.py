"""The journal on a real etcd: metrics follow every recorded event, and the state stays small.

A `DriverService` leads on the session's etcd through an `Election` and an `EtcdEventLog`
(exactly what `unbroken driver` builds), with its gRPC server on a free port.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from aetcd import rpc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.journal_harness import leading
from unbroken.driver import etcdsnapshot
from unbroken.driver import state as statelib
from unbroken.driver.eventlog import EventLogError
from unbroken.driver.liveview import LiveViewConfig
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


def one_of_every_kind() -> list[ev.Event]:
    """A valid event of every payload kind the log can hold."""
    out = []
    for f in ev.Event.DESCRIPTOR.oneofs_by_name["payload"].fields:
        e = ev.Event()
        getattr(e, f.name).SetInParent()
        if f.name == "job_started":
            e.job_started.world.node_ids.append("n0")
        out.append(e)
    return out


def test_every_recorded_kind_is_counted_in_events_total(etcd_server: Any, tmp_path: Path) -> None:
    async def go() -> dict[str, float]:
        async with leading(etcd_server, tmp_path / "archive") as (svc, journal, _, _):
            for e in one_of_every_kind():
                await journal.record(e)  # one by one: a kind the fold rejects fails alone
            text = generate_latest(svc.metrics.registry).decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        return {
            s.labels["kind"]: s.value
            for s in fams["unbroken_events"].samples
            if s.name == "unbroken_events_total"
        }

    counts = asyncio.run(asyncio.wait_for(go(), 60))
    kinds = [f.name for f in ev.Event.DESCRIPTOR.oneofs_by_name["payload"].fields]
    assert counts == {k: 1.0 for k in kinds}  # LeaderElected is recorded by main.py, not here


def test_twenty_thousand_nodes_come_and_go_and_the_state_stays_small(
    etcd_server: Any, tmp_path: Path
) -> None:
    """20,000 registrations and losses of distinct nodes: snapshots keep succeeding (the
    state is pruned), archival keeps etcd's keys bounded, GetStatus answers from memory."""
    n = 20_000
    config = ServiceConfig(live=LiveViewConfig(max_nodes=100_000), slot_retention_s=0.5)

    async def go() -> None:
        async with leading(etcd_server, tmp_path / "archive", config) as (svc, journal, addr, elog):
            for i in range(0, n, 50):  # as the detectors would hand them over
                for k in range(i, i + 50):
                    svc.emit(
                        ev.Event(
                            node_registered=ev.NodeRegistered(node_id=f"node-{k:06d}", epoch=1)
                        )
                    )
                    svc.emit(ev.Event(node_lost=ev.NodeLost(node_id=f"node-{k:06d}", epoch=1)))
                while journal.pending() > 1000:
                    await asyncio.sleep(0.01)
            deadline = time.monotonic() + 300
            while journal.state.last_seq < 2 * n or journal.pending():
                assert time.monotonic() < deadline, (journal.state.last_seq, journal.pending())
                await asyncio.sleep(0.1)
            while await elog.maintain_once():  # snapshot and archive up to the head
                pass
            snap = await elog.latest_snapshot()
            assert snap is not None and snap.last_seq >= 2 * n - elog.snapshot_every
            assert snap.state.pruned_nodes > 0
            assert snap.ByteSize() < 512 * 1024, snap.ByteSize()  # far below etcd's 1.5 MiB
            assert len(journal.state.nodes) <= 2 * statelib.KEEP_GONE_NODES
            assert journal.state == await elog.replay()  # memory equals the log
            keys = await elog.client.kvstub.Range(
                rpc.RangeRequest(
                    key=elog.keys.ev_prefix, range_end=elog.keys.ev_end, count_only=True
                ),
                timeout=10,
            )
            assert keys.count < 2 * elog.snapshot_every, keys.count  # only the tail stays
            stub = dgrpc.DriverStub(grpc.aio.insecure_channel(addr))
            # served from memory, not a replay (its latency: bench/eventlog.py, GetStatus)
            st = await stub.GetStatus(dpb.GetStatusRequest(), timeout=5)
            assert st.last_seq == journal.state.last_seq

    asyncio.run(asyncio.wait_for(go(), 600))


def test_a_snapshot_too_large_for_etcd_is_a_clear_error_and_counted(
    etcd_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 active nodes with random 3 KB hostnames: a 3 MB state that stays over one
    part when deflated (random hex halves, no more), so it would go in parts; with parts
    limited to one, the snapshot is refused before the put, the driver says why and counts
    it; every event stays in etcd (nothing archived without a snapshot) and appends go on.
    (In parts: tests/integration/test_scale_world.py.)"""
    monkeypatch.setattr(etcdsnapshot, "MAX_SNAPSHOT_PARTS", 1)

    async def go() -> None:
        async with leading(etcd_server, tmp_path / "archive") as (svc, journal, _, elog):
            for i in range(0, 1000, 50):
                await journal.record(
                    *(
                        ev.Event(
                            node_registered=ev.NodeRegistered(
                                node_id=f"n{k}", epoch=1, hostname=secrets.token_hex(1500)
                            )
                        )
                        for k in range(i, i + 50)
                    )
                )
            with pytest.raises(EventLogError, match=r"over the \d+-byte limit"):
                await elog.maintain_once()
            assert elog.snapshots_too_large >= 1
            text = generate_latest(svc.metrics.registry).decode()
            assert "unbroken_snapshots_too_large_total 0.0" not in text
            assert await elog.latest_snapshot() is None
            assert len(await elog.read()) == 1000  # nothing lost, nothing archived
            (more,) = await journal.record(ev.Event(node_lost=ev.NodeLost(node_id="n0", epoch=1)))
            assert more.seq == 1001

    asyncio.run(asyncio.wait_for(go(), 120))
