"""Benchmark of the etcd event log against the embedded etcd (not a test: docs/style.md).

Measures, each against a baseline taken in the same run on the same machine:
- appends/s, one at a time (one fenced transaction each) and from 64 concurrent appenders
  (group commit), against plain sequential etcd Puts of the same bytes (no fence, no index);
- seconds to replay 100k events (read + fold, no snapshot), and to read them back from the
  archive;
- etcd's reported dbSize after 1M events with archival (snapshot every 1000) and without;
- the journal (docs/architecture.md): a 20-event recovery decision as ONE transaction
  against the same 20 events appended one by one (`decision_append_ms`, a ratio); GetStatus
  over gRPC against a real driver process whose log holds 100k events (served from memory, against
  LiveView, the cheapest call, as baseline); the driver's RSS with 10 `WatchEvents(follow)`
  streams from seq 0 of those 100k events, against its RSS before them.

Writes bench/results/eventlog.json (flat keys) and prints a markdown table.
Usage: .venv/bin/python bench/eventlog.py [--events 1000000] [--replay-events 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
from aetcd import rpc

from unbroken.driver import state as statelib
from unbroken.driver.election import Election
from unbroken.driver.etcd import EmbeddedEtcd
from unbroken.driver.etcdlog import NO_ARCHIVE, EtcdEventLog, connect
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

RESULTS = Path(__file__).parent / "results" / "eventlog.json"


def event(i: int) -> ev.Event:
    """A typical small transition event (~110 bytes serialized)."""
    return ev.Event(
        node_lost=ev.NodeLost(
            node_id=f"node-{i % 4096:05d}", epoch=i, silent_ms=312.5, reason="heartbeat timeout"
        )
    )


async def open_log(
    etcd: EmbeddedEtcd, job: str, **kw: object
) -> tuple[object, Election, EtcdEventLog]:
    client = await connect(etcd.config)
    election = Election(client, job, "bench", ttl_s=10)
    log = EtcdEventLog(client, job, await election.campaign(timeout_s=10), **kw)  # type: ignore[arg-type]
    return client, election, log


async def close(client: object, election: Election, log: EtcdEventLog) -> None:
    await log.close()
    await election.resign()
    await client.close()  # type: ignore[attr-defined]


async def fill(log: EtcdEventLog, n: int, tasks: int, *, chunk: int = 0) -> float:
    """Append n events from `tasks` concurrent appenders; return the wall time in seconds."""
    per = n // tasks

    async def one(j: int) -> None:
        base = j * per
        if chunk:
            for i in range(0, per, chunk):
                await log.append_many([event(base + k) for k in range(i, min(per, i + chunk))])
        else:
            for i in range(per):
                await log.append(event(base + i))

    t0 = time.perf_counter()
    await asyncio.gather(*[one(j) for j in range(tasks)])
    return time.perf_counter() - t0


async def throughput(etcd: EmbeddedEtcd, out: dict[str, float]) -> None:
    client, election, log = await open_log(
        etcd, "tput", archive_url=NO_ARCHIVE, snapshot_every=1_000_000
    )
    n_seq = 2000
    t0 = time.perf_counter()
    for i in range(n_seq):
        await log.append(event(i))
    out["appends_per_s_sequential"] = n_seq / (time.perf_counter() - t0)
    n_conc = 20_000
    out["appends_per_s_concurrent"] = n_conc / await fill(log, n_conc, 64)
    # Baseline: plain sequential Puts of the same bytes (no fence, no id index, no seq check).
    data = event(0).SerializeToString()
    t0 = time.perf_counter()
    for i in range(n_seq):
        await client.kvstub.Put(
            rpc.PutRequest(key=b"/bench/raw/%d" % i, value=data),  # type: ignore[attr-defined]
            timeout=5,
        )
    out["raw_puts_per_s_sequential"] = n_seq / (time.perf_counter() - t0)
    out["sequential_append_vs_raw_put_ratio"] = (
        out["appends_per_s_sequential"] / out["raw_puts_per_s_sequential"]
    )
    out["concurrent_vs_sequential_ratio"] = (
        out["appends_per_s_concurrent"] / out["appends_per_s_sequential"]
    )
    await close(client, election, log)


async def replay(etcd: EmbeddedEtcd, n: int, archive: str, out: dict[str, float]) -> None:
    client, election, log = await open_log(
        etcd, "replay", archive_url=NO_ARCHIVE, snapshot_every=10 * n
    )
    await fill(log, n, 8, chunk=60)
    walls, cpus = [], []
    for _ in range(3):  # the median of 3 (the first also alone: a cold start)
        t0, c0 = time.perf_counter(), time.process_time()
        state = await log.replay()
        walls.append((time.perf_counter() - t0) * 100_000 / n)
        cpus.append((time.process_time() - c0) * 100_000 / n)
    out["replay_100k_events_s"] = statistics.median(walls)
    out["replay_100k_events_cold_s"] = walls[0]
    # this process's CPU for it (decode and fold; etcd's own work is not in it): the
    # figure the shared host's load does not stretch
    out["replay_100k_events_cpu_s"] = statistics.median(cpus)
    assert state.last_seq == n
    # baseline, same run: the whole tail read into a list, then folded (replay before it
    # folded each page while the next ones were in flight)
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        whole = statelib.fold(await log.read(), statelib.initial("replay"))
        walls.append((time.perf_counter() - t0) * 100_000 / n)
    out["replay_100k_events_read_then_fold_s"] = statistics.median(walls)
    out["replay_streamed_speedup"] = statistics.median(walls) / out["replay_100k_events_s"]
    assert state == whole
    await close(client, election, log)
    # The same history once archived: snapshot every 1000, all but the tail in the archive.
    client, election, log = await open_log(
        etcd, "replay-archived", archive_url=archive, snapshot_every=1000
    )
    await fill(log, n, 8, chunk=60)
    await settle(log, n)
    t0 = time.perf_counter()
    events = await log.read()
    out["read_100k_archived_events_s"] = (time.perf_counter() - t0) * 100_000 / n
    assert len(events) == n
    t0 = time.perf_counter()
    assert (await log.replay()).last_seq == n
    out["replay_100k_archived_events_from_snapshot_s"] = time.perf_counter() - t0
    await close(client, election, log)


async def settle(log: EtcdEventLog, n: int) -> None:
    deadline = time.monotonic() + 600
    while True:
        snap = await log.latest_snapshot()
        if snap is not None and snap.last_seq >= n - n % log.snapshot_every:
            while await log.maintain_once():
                pass
            return
        assert time.monotonic() < deadline, "archival did not catch up"
        await asyncio.sleep(0.2)


async def db_size(n: int, archive: str | None, out: dict[str, float], key: str) -> None:
    d = tempfile.mkdtemp(prefix="bench-etcd-")
    etcd = EmbeddedEtcd(d).start()
    try:
        client, election, log = await open_log(
            etcd, "dbsize", archive_url=archive if archive else NO_ARCHIVE, snapshot_every=1000
        )
        took = await fill(log, n, 8, chunk=60)
        if archive:
            await settle(log, n)
        status = await log.status()
        out[key] = float(status.dbSize)
        out[key.replace("db_bytes", "db_bytes_in_use")] = float(status.dbSizeInUse)
        out[key.replace("db_bytes_after", "fill_s")] = took
        await close(client, election, log)
    finally:
        etcd.stop(remove=True)
        shutil.rmtree(d, ignore_errors=True)


async def decisions(etcd: EmbeddedEtcd, out: dict[str, float], rounds: int = 50) -> None:
    """A 20-event decision: one transaction (the journal) vs one append per event."""
    client, election, log = await open_log(
        etcd, "decision", archive_url=NO_ARCHIVE, snapshot_every=1_000_000
    )
    one_txn, one_by_one = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        await log.append_many([event(r * 40 + i) for i in range(20)])
        one_txn.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(20):
            await log.append(event(r * 40 + 20 + i))
        one_by_one.append(time.perf_counter() - t0)
    out["decision_append_ms"] = statistics.median(one_txn) * 1000
    out["decision_append_ms_event_by_event"] = statistics.median(one_by_one) * 1000
    out["decision_one_txn_speedup"] = (
        out["decision_append_ms_event_by_event"] / out["decision_append_ms"]
    )
    await close(client, election, log)


async def driver_reads(etcd: EmbeddedEtcd, n: int, out: dict[str, float]) -> None:
    """GetStatus latency and WatchEvents memory of a real driver over an `n`-event log."""
    job = "reads"
    client, election, log = await open_log(etcd, job, archive_url=NO_ARCHIVE, snapshot_every=1000)
    await fill(log, n, 8, chunk=60)
    await settle(log, n)
    await close(client, election, log)
    tmp = Path(tempfile.mkdtemp(prefix="bench-driver-"))
    port_file = tmp / "driver.json"
    argv = f"driver --etcd {etcd.endpoint} --job-id {job} --listen 127.0.0.1:0".split()
    argv += ["--archive-url", "none"]  # the filled log is all in etcd
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken.cli", *argv, "--port-file", str(port_file)],
        stdout=open(tmp / "driver.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "driver did not start"
            await asyncio.sleep(0.1)
        addr = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"
        channel = grpc.insecure_channel(addr)
        stub = dgrpc.DriverStub(channel)
        while True:  # leading, with the whole log replayed
            try:
                if stub.GetStatus(dpb.GetStatusRequest(), timeout=5).last_seq >= n:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "driver did not lead"
            await asyncio.sleep(0.2)

        def median_ms(call: Any, req: Any, k: int = 300) -> float:
            ts = []
            for _ in range(k):
                t0 = time.perf_counter()
                call(req, timeout=5)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1000

        out["getstatus_ms_at_100k_events"] = median_ms(stub.GetStatus, dpb.GetStatusRequest())
        out["liveview_ms_baseline"] = median_ms(stub.LiveView, dpb.LiveViewRequest())
        out["getstatus_vs_liveview_ratio"] = (
            out["getstatus_ms_at_100k_events"] / out["liveview_ms_baseline"]
        )
        ps = psutil.Process(proc.pid)
        before = ps.memory_info().rss
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], ps.memory_info().rss)
                time.sleep(0.02)

        def follow(counts: list[int], i: int) -> None:
            calls = dgrpc.DriverStub(grpc.insecure_channel(addr)).WatchEvents(
                dpb.WatchEventsRequest(since_seq=0, follow=True)
            )
            for got in calls:
                counts[i] += 1
                if got.event.seq >= n:
                    calls.cancel()
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        counts = [0] * 10
        t0 = time.perf_counter()
        threads = [threading.Thread(target=follow, args=(counts, i)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        out["watch_follow_10_watchers_s"] = time.perf_counter() - t0
        done.set()
        sampler.join()
        assert counts == [n] * 10, counts
        out["watch_follow_rss_mb_before"] = before / 2**20
        out["watch_follow_rss_mb_10_watchers_100k_events"] = peak[0] / 2**20
        out["watch_follow_rss_ratio"] = peak[0] / before
        channel.close()
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


async def main(args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    arch = tempfile.mkdtemp(prefix="bench-archive-")
    try:
        with EmbeddedEtcd() as etcd:
            if not args.replay_only:
                await throughput(etcd, out)
                print(f"throughput done: {out}", flush=True)
            await replay(etcd, args.replay_events, arch, out)
            print("replay done", flush=True)
            if args.replay_only:
                return out
            await decisions(etcd, out)
            await driver_reads(etcd, args.replay_events, out)
            print(f"journal done: {out}", flush=True)
            if args.journal_only:
                return out
        await db_size(args.events, arch, out, "db_bytes_after_1m_events_with_archival")
        print("db with archival done", flush=True)
        await db_size(args.events, None, out, "db_bytes_after_1m_events_without")
        out["db_bytes_ratio_without_over_with"] = (
            out["db_bytes_after_1m_events_without"] / out["db_bytes_after_1m_events_with_archival"]
        )
        out["events_for_db_figures"] = float(args.events)
    finally:
        shutil.rmtree(arch, ignore_errors=True)
    return out


def table(out: dict[str, float]) -> str:
    rows = ["| metric | value |", "|---|---|"]
    for k, v in out.items():
        rows.append(f"| {k} | {v:,.3f} |" if v < 100 else f"| {k} | {v:,.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--replay-events", type=int, default=100_000)
    p.add_argument(
        "--journal-only",
        action="store_true",
        help="skip the 1M-event dbSize runs (~7 min); the JSON keeps their last figures",
    )
    p.add_argument(
        "--replay-only",
        action="store_true",
        help="only the replay figures (median of 3); the JSON keeps the others",
    )
    ns = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    import structlog

    structlog.configure(  # quiet the per-round info logs
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
    )
    load_before = os.getloadavg()[0]
    result = asyncio.run(main(ns))
    result["load_avg_1m_before"] = load_before
    result["load_avg_1m_after"] = os.getloadavg()[0]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    keep = ns.journal_only or ns.replay_only
    old = json.loads(RESULTS.read_text()) if keep and RESULTS.exists() else {}
    RESULTS.write_text(
        json.dumps({**old, **result, "machine": platform.node(), "cpus": os.cpu_count()}, indent=2)
        + "\n"
    )
    print(table(result))
    print(f"wrote {RESULTS}")
