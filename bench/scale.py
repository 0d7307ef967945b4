"""Benchmark of the driver's state at 10,000 nodes (not a test; see docs/style.md).

Sections (each against a baseline taken in the same run on the same machine):

- ``fold``: what one NodeRegistered costs the journal at 1,024 / 5,120 / 10,240 registered
  nodes (30-character host names), the copying fold it used before (`state.fold`: a copy of
  the whole JobState per draft observation and per commit) against the in-place fold with an
  undo (driver/fold.py). Per registration, alone (a batch of one) and in a batch of 64 (the
  journal's group commit: 63 drafts and one commit). Then the whole join end to end: N nodes
  submitted to a journal on the in-memory log, seconds until all are folded, with the
  in-place fold and with the copying one put back (`join_journal_s_*`,
  `join_journal_legacy_s_*`; `join_s_N` is the e2e section's join of real processes), and
  decided by the recovery machine as the driver's loop does (`join_machine_s_*`; with its
  per-registration draft and the copying fold put back: `join_machine_legacy_s_*`).

- ``snapshot``: what a snapshot stores (compressed: driver/etcdsnapshot.py) at each level with
  40-character names, every node registered and in a running world (`snapshot_bytes_N`),
  beside the state serialized as it is (`snapshot_serialized_bytes_N`); and RegisterJob of
  the largest level's world with 40-character names over gRPC on a real etcd
  (`register_job_N_ok`, `register_job_N_ms`).
- ``reconnect``: one agent's NodeRegistered (its same epoch) in a running world of N
  nodes: `machine.decide` (a draft copy of the state and the settle, what every reconnect
  after a failover paid) against `machine.reconnect` (`reconnect_decide_ms_N`,
  `reconnect_ms_N`).
- ``e2e``: a job of `--e2e-nodes` simulated nodes behind relays on two real drivers and a
  real etcd: join, steady load, detection, one incident, failover (bench/scale_e2e.py).
- ``replay``: decoding and folding 100k stored NodeLost events (bench/eventlog.py's replay
  workload, 4,096 nodes, pruning included) from their bytes, with this code against the
  previous decode (max(SchemaVersion) per event) and fold hot spots (`_node_lost`,
  `_prune`, `_apply_in_place`, kept below as they were), interleaved, median of 3 each;
  the first run of each is also reported alone (`cold`). The etcd read is not in it
  (bench/eventlog.py's `replay_100k_events_s` has it).
- ``prune``: what one prune of gone node records costs the fold in a job of N registered
  nodes (the largest level), by the full scan of every node it did before
  (tests/prunescan.py) against the heap of gone records it keeps now
  (`prune_scan_ms_N`, `prune_indexed_ms_N`, `prune_speedup_N`: CPU time of the same fold,
  interleaved, median of 3; the heap's first build, one scan, is in its figure). Nodes
  outside the job keep registering and being lost: every PRUNE_SLACK losses past
  KEEP_GONE_NODES, one prune.

Writes bench/results/scale.json (flat keys, the load average beside them) and prints a table.
Usage: ``make bench-scale`` or ``.venv/bin/python bench/scale.py [--levels 1024 5120 10240]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the reference prune)
from tests.prunescan import prune_by_scan
from unbroken.driver import etcdclient, etcdlog, etcdsnapshot
from unbroken.driver import fold as foldlib
from unbroken.driver import journal as journallib
from unbroken.driver import machine as machinelib
from unbroken.driver import state as statelib
from unbroken.driver.decider import Decision
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.proto import events_pb2 as ev

RESULTS = Path(__file__).parent / "results" / "scale.json"
LEVELS = (1024, 5120, 10240)


def host(i: int, width: int = 30) -> str:
    """A realistic host name of exactly `width` characters."""
    return f"gpu-{i:06d}.rack{i // 64:04d}.dc1.example.com".ljust(width, "x")[:width]


def node_id(i: int) -> str:
    return host(i)


def registered(i: int, epoch: int = 1) -> ev.Event:
    return ev.Event(
        node_registered=ev.NodeRegistered(
            node_id=node_id(i),
            epoch=epoch,
            hostname=host(i),
            ip=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
            num_workers=8,
            num_gpus=8,
            agent_version="0.1.0",
            replica_buddy=f"{host(i + 1)}:29600",
        )
    )


def state_with(n: int) -> ev.JobState:
    """A state with `n` registered nodes, as a join leaves it before its world forms."""
    events = [registered(i) for i in range(n)]
    for seq, e in enumerate(events, 1):
        e.seq = seq
    s = statelib.initial("bench")
    foldlib.fold_in_place(s, events)
    return s


def _median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


def fold_costs(n: int, reps: int, out: dict[str, Any]) -> None:
    """Per-registration fold cost at `n` nodes: copying against in place (alone, batch 64)."""
    s = state_with(n)
    seq = [s.last_seq]

    def fresh(k: int) -> list[ev.Event]:
        evs = []
        for _ in range(k):
            seq[0] += 1
            e = registered(n + seq[0])  # a new node joining
            e.seq = seq[0]
            evs.append(e)
        return evs

    def copying_one() -> None:
        statelib.fold(fresh(1), s)  # the old commit: a copy, folded (then dropped here)

    def in_place_one() -> None:
        foldlib.fold_in_place(s, fresh(1))

    batch = 64

    def copying_batch() -> None:
        evs = fresh(batch)
        for k in range(1, batch):  # the old drafts: every observation after the first
            statelib.fold(evs[:k], s)
        statelib.fold(evs, s)  # the commit

    def in_place_batch() -> None:
        evs = fresh(batch)
        draft = foldlib.Savepoint(s)
        for e in evs[:-1]:
            draft.apply(e)
        draft.undo()
        foldlib.fold_in_place(s, evs)

    # the in-place runs grow the state by what they fold; measure the copying ones first
    out[f"register_copying_ms_{n}"] = _median_ms(copying_one, reps)
    out[f"register_in_place_ms_{n}"] = _median_ms(in_place_one, reps)
    out[f"register_speedup_{n}"] = (
        out[f"register_copying_ms_{n}"] / out[f"register_in_place_ms_{n}"]
    )
    b_reps = max(3, reps // 20)
    out[f"register_batch64_copying_ms_{n}"] = _median_ms(copying_batch, b_reps) / batch
    out[f"register_batch64_in_place_ms_{n}"] = _median_ms(in_place_batch, b_reps) / batch
    out[f"register_batch64_speedup_{n}"] = (
        out[f"register_batch64_copying_ms_{n}"] / out[f"register_batch64_in_place_ms_{n}"]
    )


class _CopyingSavepoint(foldlib.Savepoint):
    """The draft as the journal kept it before: a copy of the state with the batch's
    events so far folded, made again before every decision."""

    def __init__(self, state: ev.JobState) -> None:
        super().__init__(state)
        self._events: list[ev.Event] = []

    def apply(self, event: ev.Event) -> None:
        self._events.append(event)
        statelib.fold(self._events, self.state)
        super().apply(event)


_Savepoint = foldlib.Savepoint  # fold_in_place's own, while the journal's is replaced


def _copying_fold_in_place(state: ev.JobState, events: Iterable[ev.Event]) -> None:
    events = list(events)
    statelib.fold(events, state)  # the old commit's copy and fold
    sp = _Savepoint(state)
    for e in events:
        sp.apply(e)


async def join(n: int, *, copying: bool, machine: bool = False) -> float:
    """Seconds for a journal on the in-memory log to record and fold `n` registrations
    submitted at once (the writer batches them, 64 a transaction). `machine`: decided by
    the recovery machine as the driver's loop does (copying: with its draft, a copy of the
    state per registration, as before), else recorded as they are."""
    saved = journallib.foldlib.Savepoint, journallib.foldlib.fold_in_place, machinelib._JOINING
    if copying:
        journallib.foldlib.Savepoint = _CopyingSavepoint  # type: ignore[misc]
        journallib.foldlib.fold_in_place = _copying_fold_in_place
        machinelib._JOINING = ()
    try:
        store = InMemoryStore()
        elog = InMemoryEventLog(store, "bench", store.elect("d1"), snapshot_every=10**9)
        j = journallib.Journal(elog, statelib.initial("bench"))

        policy = machinelib.Policy()

        class Decide:
            recovers = machine

            def decide(self, state: ev.JobState, obj: ev.Event) -> Decision:
                if machine:
                    return Decision(list(machinelib.decide(state, obj, policy).events))
                return Decision([obj])

        j.decider = Decide()  # a decider, so every observation after a batch's first drafts
        t0 = time.perf_counter()
        for i in range(n):
            j.submit(registered(i))
        j.start()
        deadline = time.monotonic() + 600
        while j.state.last_seq < n:
            if time.monotonic() > deadline or j.stats.too_large:
                raise RuntimeError(f"the join stopped at {j.state.last_seq} of {n} events")
            await asyncio.sleep(0.01)
        took = time.perf_counter() - t0
        assert len(j.state.nodes) == n
        await j.close()
        return took
    finally:
        (
            journallib.foldlib.Savepoint,
            journallib.foldlib.fold_in_place,
            machinelib._JOINING,
        ) = saved


def snapshot_size(n: int, out: dict[str, Any]) -> None:
    """Bytes of the folded state (what a snapshot stores) of `n` registered nodes with
    40-character names in a started, running world of all of them."""
    ids = [host(i, 40) for i in range(n)]
    world = ev.WorldLayout(dp=n, pp=1, tp=1, node_ids=ids, workers_per_node=8)
    events = [
        ev.Event(job_started=ev.JobStarted(trainer="bench", world=world)),
        *(
            ev.Event(
                node_registered=ev.NodeRegistered(
                    node_id=i, epoch=1, hostname=i, ip="10.1.2.3", num_workers=8
                )
            )
            for i in ids
        ),
        ev.Event(training_resumed=ev.TrainingResumed(world=world)),
    ]
    for seq, e in enumerate(events, 1):
        e.seq = seq
    s = statelib.initial("bench")
    foldlib.fold_in_place(s, events)
    # what etcd stores (driver/etcdsnapshot.py: compressed) against the state serialized as is
    out[f"snapshot_bytes_{n}"] = len(etcdsnapshot.snapshot_value(s.last_seq, s))
    out[f"snapshot_serialized_bytes_{n}"] = ev.Snapshot(last_seq=s.last_seq, state=s).ByteSize()


def reconnect_costs(n: int, reps: int, out: dict[str, Any]) -> None:
    """What one agent reconnecting to a new leader costs the recovery loop at `n` nodes in a
    running world: `machine.decide` (its draft, a copy of the state, and the settle) as
    every NodeRegistered went before, against `machine.reconnect`, which records it as is."""
    ids = [node_id(i) for i in range(n)]
    world = ev.WorldLayout(dp=n * 8, pp=1, tp=1, node_ids=ids, workers_per_node=8)
    events = [
        ev.Event(job_started=ev.JobStarted(trainer="bench", world=world)),
        *(registered(i) for i in range(n)),
        ev.Event(training_resumed=ev.TrainingResumed(world=world)),
    ]
    for seq, e in enumerate(events, 1):
        e.seq = seq
    s = statelib.initial("bench")
    foldlib.fold_in_place(s, events)
    assert s.phase == ev.PHASE_RUNNING
    policy = machinelib.Policy()
    again = registered(n // 2)
    assert machinelib.reconnect(s, again)
    out[f"reconnect_decide_ms_{n}"] = _median_ms(
        lambda: machinelib.decide(s, again, policy), max(5, reps // 10)
    )
    out[f"reconnect_ms_{n}"] = _median_ms(lambda: machinelib.reconnect(s, again), reps)
    out[f"reconnect_speedup_{n}"] = out[f"reconnect_decide_ms_{n}"] / out[f"reconnect_ms_{n}"]


async def register_job(n: int, out: dict[str, Any]) -> None:
    """RegisterJob of `n` nodes with 40-character host names on a real driver service over
    gRPC on a real etcd: recorded (`register_job_N_ok`), every stored event within the cap."""
    import tempfile
    import uuid

    import grpc

    from unbroken.driver.election import Election
    from unbroken.driver.etcd import EmbeddedEtcd
    from unbroken.driver.service import DriverService, ServiceConfig, build_server
    from unbroken.proto import driver_pb2 as dpb
    from unbroken.proto import driver_pb2_grpc as dgrpc

    ids = [host(i, 40) for i in range(n)]
    with (
        tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp,
        EmbeddedEtcd(Path(tmp) / "etcd") as etcd,
    ):
        job = f"scale-{uuid.uuid4().hex[:6]}"
        client = await etcdlog.connect(etcd.config)
        election = Election(client, job, "d1", ttl_s=10)
        elog = etcdlog.EtcdEventLog(
            client, job, await election.campaign(timeout_s=10), archive_url=str(Path(tmp) / "a")
        )
        svc = DriverService(ServiceConfig(), driver_id="d1", job_id=job)
        svc.lead(elog, "127.0.0.1:0", await elog.replay())
        svc.start()
        server, port, _ = await build_server(svc, "127.0.0.1:0")
        try:
            stub = dgrpc.DriverStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            world = ev.WorldLayout(pp=1, tp=1, node_ids=ids, workers_per_node=8)
            t0 = time.perf_counter()
            await stub.RegisterJob(
                dpb.RegisterJobRequest(trainer="bench", world=world), timeout=120
            )
            out[f"register_job_{n}_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            stored = await elog.read()
            out[f"register_job_{n}_ok"] = (
                list(svc.state.world.node_ids) == ids
                and max(e.ByteSize() for e in stored) <= elog.max_event_bytes
            )
        finally:
            await server.stop(0)
            await svc.close()
            await elog.close()
            await election.resign()
            await client.close()


# ---------------------------------------------------------------- replay: the previous code
def _legacy_decode(data: bytes) -> ev.Event:
    e = ev.Event.FromString(data)
    if e.schema_version > max(ev.SchemaVersion.values()):
        raise ValueError("newer schema")
    return e


def _legacy_prune(s: ev.JobState) -> None:
    if s.gone_nodes <= statelib.KEEP_GONE_NODES + statelib.PRUNE_SLACK:
        return
    gone_states = (ev.NODE_STATE_LOST, ev.NODE_STATE_EVICTED)
    keep = {*s.world.node_ids, *s.suspects, *s.bad_nodes, *s.incident_world.node_ids}
    gone = sorted(
        (r.gone_seq, n) for n, r in s.nodes.items() if r.state in gone_states and n not in keep
    )
    for _, n in gone[: s.gone_nodes - statelib.KEEP_GONE_NODES]:
        del s.nodes[n]
        s.gone_nodes -= 1
        s.pruned_nodes += 1


def _legacy_node_lost(s: ev.JobState, e: ev.Event) -> None:
    rec = statelib._node(s, e.node_lost.node_id)
    if e.node_lost.epoch and e.node_lost.epoch < rec.epoch:
        return
    if rec.state != ev.NODE_STATE_EVICTED:
        statelib._set_state(s, rec, ev.NODE_STATE_LOST, e.seq)
    rec.failures += 1
    _legacy_prune(s)


def _legacy_apply_in_place(s: ev.JobState, e: ev.Event) -> None:
    kind = e.WhichOneof("payload")
    assert kind is not None
    assert e.seq == 0 or e.seq > s.last_seq
    if e.seq:
        s.last_seq = e.seq
    s.event_counts[kind] += 1
    if kind in statelib.CAUSE_KINDS:
        s.goodput.last_fault = kind
        if not s.goodput.incident_began_ns:
            s.goodput.pending_detect_s = statelib._silence_s(e, kind)
    handler = _LEGACY_HANDLERS.get(kind)
    if handler is not None:
        handler(s, e)
    statelib._segment(s, e)


_LEGACY_HANDLERS = {**statelib._HANDLERS, "node_lost": _legacy_node_lost}


_CPU: list[float] = []  # each replay_once's process CPU time, in order


def replay_once(datas: list[bytes], *, legacy: bool) -> tuple[float, ev.JobState]:
    """Seconds to decode and fold `datas`, with the previous code or this one."""
    saved = statelib._apply_in_place
    decode = _legacy_decode if legacy else etcdclient.decode
    if legacy:
        statelib._apply_in_place = _legacy_apply_in_place
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        state = statelib.fold([decode(d) for d in datas], statelib.initial("bench"))
        _CPU.append(time.process_time() - c0)
        return time.perf_counter() - t0, state
    finally:
        statelib._apply_in_place = saved


def replay_costs(n: int, out: dict[str, Any]) -> None:
    datas = []
    for i in range(n):
        e = ev.Event(
            seq=i + 1,
            node_lost=ev.NodeLost(
                node_id=f"node-{i % 4096:05d}", epoch=i, silent_ms=312.5, reason="heartbeat timeout"
            ),
        )
        datas.append(e.SerializeToString())
    runs: dict[bool, list[float]] = {True: [], False: []}
    cpus: dict[bool, list[float]] = {True: [], False: []}
    states = {}
    for _ in range(3):
        for legacy in (True, False):
            took, states[legacy] = replay_once(datas, legacy=legacy)
            runs[legacy].append(took * 100_000 / n)
            cpus[legacy].append(_CPU[-1] * 100_000 / n)
    # the process's CPU time: what the shared host's load does not stretch
    out["replay_100k_decode_fold_legacy_cpu_s"] = statistics.median(cpus[True])
    out["replay_100k_decode_fold_now_cpu_s"] = statistics.median(cpus[False])
    assert states[True] == states[False], "the folds disagree"
    for legacy, name in ((True, "legacy"), (False, "now")):
        out[f"replay_100k_decode_fold_{name}_cold_s"] = runs[legacy][0]
        out[f"replay_100k_decode_fold_{name}_s"] = statistics.median(runs[legacy])
    out["replay_100k_decode_fold_speedup"] = (
        out["replay_100k_decode_fold_legacy_s"] / out["replay_100k_decode_fold_now_s"]
    )


def prune_costs(n: int, out: dict[str, Any]) -> None:
    """Per prune, in a job of `n` registered nodes: the full scan against the heap."""
    base = state_with(n)
    seq = base.last_seq
    churn = []  # outsiders that register and are lost: 12 prunes' worth
    losses = statelib.KEEP_GONE_NODES + statelib.PRUNE_SLACK + 12 * (statelib.PRUNE_SLACK + 1)
    for i in range(losses):
        reg = registered(n + i)
        lost = ev.Event(
            node_lost=ev.NodeLost(node_id=node_id(n + i), epoch=1, reason="heartbeat timeout")
        )
        for e in (reg, lost):
            seq += 1
            e.seq = seq
            churn.append(e)
    indexed = statelib._prune
    spent: list[float] = []

    def timed(fn: Callable[[ev.JobState], None]) -> Callable[[ev.JobState], None]:
        def prune(s: ev.JobState) -> None:
            t0 = time.thread_time()  # CPU time: the shared host's load does not stretch it
            fn(s)
            spent.append(time.thread_time() - t0)

        return prune

    per_prune: dict[str, list[float]] = {"scan": [], "indexed": []}
    states = {}
    for _ in range(3):
        for name, fn in (("scan", prune_by_scan), ("indexed", indexed)):
            s = ev.JobState()
            s.CopyFrom(base)
            spent.clear()
            statelib._prune = timed(fn)
            try:
                statelib.fold_into(s, churn)
            finally:
                statelib._prune = indexed
            prunes = s.pruned_nodes // (statelib.PRUNE_SLACK + 1)
            per_prune[name].append(sum(spent) / prunes * 1000.0)
            states[name] = s
    assert states["scan"] == states["indexed"], "the prunes disagree"
    out[f"prune_count_{n}"] = states["indexed"].pruned_nodes // (statelib.PRUNE_SLACK + 1)
    out[f"prune_scan_ms_{n}"] = statistics.median(per_prune["scan"])
    out[f"prune_indexed_ms_{n}"] = statistics.median(per_prune["indexed"])
    out[f"prune_speedup_{n}"] = out[f"prune_scan_ms_{n}"] / out[f"prune_indexed_ms_{n}"]


def sustained(res: dict[str, Any]) -> dict[str, Any]:
    """The largest end-to-end level in `res` that one driver core sustained: under a whole
    core steady, and every phase reached with every detection made and no false NodeLost
    (the simulators' share of the same 2 cores beside it)."""

    def held(n: int) -> bool:
        share = res.get(f"driver_core_share_{n}")
        lost = [res.get(f"false_node_lost_{p}_{n}") for p in ("join", "incident", "failover")]
        return (
            share is not None
            and share < 1.0
            and res.get(f"detect_detected_{n}") == "30 of 30"
            and res.get(f"failover_s_{n}") is not None
            and lost == [0, 0, 0]
        )

    levels = sorted(int(k.rsplit("_", 1)[1]) for k in res if k.startswith("e2e_load_avg_1m_"))
    ok = [n for n in levels if held(n)]
    if not ok:
        return {}
    top = max(ok)
    return {
        "max_nodes_one_driver_core_sustained": top,
        "max_nodes_one_driver_core_sustained_driver_share": res[f"driver_core_share_{top}"],
        "max_nodes_one_driver_core_sustained_simulators_share": res.get(
            f"simulators_core_share_{top}"
        ),
        # the smallest level above it that failed, if one ran: the ceiling lies between
        "max_nodes_one_driver_core_failed_at": min(
            (n for n in levels if n > top and not held(n)), default=None
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    ap.add_argument("--reps", type=int, default=200, help="registrations timed per level")
    ap.add_argument("--no-join", action="store_true", help="skip the end-to-end joins")
    ap.add_argument("--replay-events", type=int, default=100_000)
    ap.add_argument(
        "--machine-legacy-max",
        type=int,
        default=5120,
        help="largest level whose join through the machine is also run the old way (slow)",
    )
    ap.add_argument(
        "--only",
        choices=("fold", "replay", "snapshot", "reconnect", "e2e", "prune"),
        default=None,
        help="run one section (default: all)",
    )
    ap.add_argument(
        "--e2e-nodes",
        type=int,
        nargs="+",
        default=[10240],
        help="simulated nodes of the end-to-end run (bench/scale_e2e.py), multiples of 64",
    )
    ap.add_argument(
        "--e2e-join-timeout-s",
        type=float,
        default=900.0,
        help="give up an end-to-end run whose join took longer (what it reached is recorded)",
    )
    ap.add_argument(
        "--e2e-no-relay-batches",
        action="store_true",
        help="the simulated relays take and send members' messages one by one (the baseline "
        "of RelayedDownBatch / RelayedUpBatch)",
    )
    ns = ap.parse_args()
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "command": " ".join([".venv/bin/python", "bench/scale.py", *sys.argv[1:]]),
        f"load_avg_1m_before_{ns.only or 'all'}": os.getloadavg()[0],
    }
    if ns.only in (None, "replay"):
        replay_costs(ns.replay_events, out)
        print(
            "replay 100k (decode + fold): previous "
            f"{out['replay_100k_decode_fold_legacy_s']:.2f} s, now "
            f"{out['replay_100k_decode_fold_now_s']:.2f} s (cold: "
            f"{out['replay_100k_decode_fold_legacy_cold_s']:.2f} / "
            f"{out['replay_100k_decode_fold_now_cold_s']:.2f} s)"
        )
    if ns.only in (None, "prune"):
        n = max(ns.levels)
        prune_costs(n, out)
        print(
            f"prune at {n} nodes: full scan {out[f'prune_scan_ms_{n}']:.2f} ms, "
            f"indexed {out[f'prune_indexed_ms_{n}']:.2f} ms "
            f"({out[f'prune_speedup_{n}']:.1f}x, {out[f'prune_count_{n}']} prunes)"
        )
    for n in ns.levels if ns.only in (None, "snapshot") else ():
        snapshot_size(n, out)
    if ns.only in (None, "snapshot"):
        asyncio.run(register_job(max(ns.levels), out))
    for n in ns.levels if ns.only in (None, "reconnect") else ():
        reconnect_costs(n, ns.reps, out)
        print(
            f"reconnect at {n}: decide {out[f'reconnect_decide_ms_{n}']:.3f} ms, "
            f"recorded as is {out[f'reconnect_ms_{n}']:.4f} ms"
        )
    for n in ns.e2e_nodes if ns.only in (None, "e2e") else ():
        import scale_e2e  # bench/, beside this file

        # which levels this run reached (older keys of other levels stay in the file)
        out.setdefault("e2e_levels_ran", []).append(n)
        out[f"e2e_load_avg_1m_{n}"] = [round(os.getloadavg()[0], 2)]
        scale_e2e.run(
            n, out, join_timeout_s=ns.e2e_join_timeout_s, batches=not ns.e2e_no_relay_batches
        )
        out[f"e2e_load_avg_1m_{n}"].append(round(os.getloadavg()[0], 2))
    for n in ns.levels if ns.only in (None, "fold") else ():
        fold_costs(n, ns.reps, out)
        if not ns.no_join:
            out[f"join_journal_legacy_s_{n}"] = asyncio.run(join(n, copying=True))
            out[f"join_journal_s_{n}"] = asyncio.run(join(n, copying=False))
            out[f"join_journal_speedup_{n}"] = (
                out[f"join_journal_legacy_s_{n}"] / out[f"join_journal_s_{n}"]
            )
            if n <= ns.machine_legacy_max:
                out[f"join_machine_legacy_s_{n}"] = asyncio.run(join(n, copying=True, machine=True))
            out[f"join_machine_s_{n}"] = asyncio.run(join(n, copying=False, machine=True))
        print(f"level {n} done", file=sys.stderr)
    out[f"load_avg_1m_after_{ns.only or 'all'}"] = os.getloadavg()[0]
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    merged = {**old, **out}
    # every level whose end-to-end figures are in the file (this run's: e2e_levels_ran)
    merged["e2e_levels_in_file"] = sorted(
        int(k.rsplit("_", 1)[1]) for k in merged if k.startswith("e2e_load_avg_1m_")
    )
    merged.update(sustained(merged))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    print(
        "| nodes | copying ms/reg | in place ms/reg | x | batch64 copying | batch64 in place | x "
        "| join copying s | join in place s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in ns.levels if ns.only in (None, "fold") else ():
        cols = [
            f"{out[f'register_copying_ms_{n}']:.3f}",
            f"{out[f'register_in_place_ms_{n}']:.4f}",
            f"{out[f'register_speedup_{n}']:.0f}",
            f"{out[f'register_batch64_copying_ms_{n}']:.3f}",
            f"{out[f'register_batch64_in_place_ms_{n}']:.4f}",
            f"{out[f'register_batch64_speedup_{n}']:.0f}",
            f"{out.get(f'join_journal_legacy_s_{n}', float('nan')):.2f}",
            f"{out.get(f'join_journal_s_{n}', float('nan')):.2f}",
        ]
        print(f"| {n} | " + " | ".join(cols) + " |")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
