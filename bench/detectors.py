"""Detector quality: hang and straggler detection latency, false alarms under CPU stress.

Real processes only: an embedded etcd, `unbroken driver`, `unbroken agent`s and their
workers on loopback. Three parts (`--parts`, default all):

* hang: one agent, two workers of a 100 ms-step gloo job (sleep 100 ms, all-reduce through
  `hooks.collective()`). `--hangs` times: SIGSTOP rank 1, time until HangSuspected is in
  the log (`hang_detect_s`); SIGCONT, time until the driver's live view shows the next step
  (`hang_resume_s`; no recovery loop here, the worker itself resumes).
* straggler: `unbroken driver --nodes 2 --dp 2` training the tiny preset with
  `--straggler-policy alert`; `InjectFault slow-train --factor F` on node-1 for F in 1.20,
  1.10, 1.05 (each reset to 1.0 after, and the window washed out): time until
  StragglerSuspected, and which node it names (`straggler_detect_s`).
* false_positives: `unbroken up --no-drill` (the defaults `make run` uses: 2 nodes x 2
  workers, 2 spares, pp2 x tp2, two drivers, miss limit 5, the agents' 1 s hang floor) for
  `--minutes` while `--hog` busy processes load the CPU (stress-ng when installed); then
  the log's NodeLost, HangSuspected, StragglerSuspected and leader changes after the first
  are counted, and extrapolated per node-day. The load average is sampled every 10 s.
  A poller reads the leader's live view every 100 ms: each node's longest silences give
  the latency / false-positive table for other miss limits (`miss_limit_table`). Every
  2 s it also records each node's timing summary (`timings.jsonl`); the recorded sweeps
  are replayed through the straggler detector at k = 3 (its default), 2.5 and 2
  (`straggler_replay`): how far the run's zero is from a false straggler.

* overload (bench/overload.py): the job `make run` trains, through CPU hogs, a
  memory-bandwidth hog and restart storms in turn (`--overload-seconds` each; the issue
  asks 20 minutes): `false_node_lost` per kind, and `detect_p99_s_under_load` of spare
  agents SIGKILLed in the same runs; `--variants new,baseline` adds the same with the
  starvation grace and the agents' real-time loops off.

Writes bench/results/detectors.json and prints tables. `make bench-detectors`
(`ARGS="--minutes 20"` for the full false-positive run; the default is short).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the shared jobs)
from tests.jobs import ALLREDUCE_WORKER
from unbroken.cli.cluster import LocalCluster, UntilTimeout, until
from unbroken.common.timing import node_timing
from unbroken.common.tls import read_token, token_metadata
from unbroken.driver import paging
from unbroken.driver.etcd import EmbeddedEtcd, free_port
from unbroken.driver.straggler import Sample, StragglerConfig, StragglerWatch
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

RESULTS = Path(__file__).parent / "results" / "detectors.json"
FACTORS = (1.20, 1.10, 1.05)
MISS_LIMITS = (3, 5, 10, 20)
REPLICA_KEY = "bench-detectors-replica-key-0123456789"  # the table's settings (x 100 ms heartbeats)


def cluster(run: Path, job: str = "", etcd: EmbeddedEtcd | None = None) -> LocalCluster:
    """The processes a part starts (each in its own group, all stopped at the end)."""
    return LocalCluster(
        run,
        job=job,
        etcd=etcd,
        env={"UNBROKEN_REPLICA_KEY": REPLICA_KEY},  # the buddy stream is authenticated
        grace_s=15,
    )


def live(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[dpb.NodeLive]:
    try:
        with grpc.insecure_channel(address) as ch:
            stub = dgrpc.DriverStub(ch)
            req = dpb.LiveViewRequest()
            return list(paging.all_nodes(stub.LiveView, req, timeout=5, metadata=metadata))
    except grpc.RpcError:
        return []


def inject(address: str, node: str, kind: str, factor: float = 0.0) -> None:
    with grpc.insecure_channel(address) as ch:
        req = dpb.InjectFaultRequest(node_id=node, kind=kind, factor=factor)
        resp = dgrpc.DriverStub(ch).InjectFault(req, timeout=30)
    if not resp.ok:
        raise RuntimeError(f"inject {kind} on {node}: {resp.detail}")


def start_driver(p: LocalCluster, *extra: str) -> str:
    assert p.etcd is not None
    return p.start_driver(
        "driver",
        ["--archive-url", str(p.etcd.data_dir.parent / "archive"), "--allow-fault-injection",
         *extra],
        wait_s=120,
    )  # fmt: skip


def p50(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------- hang
def hang_part(run: Path, etcd: EmbeddedEtcd, n: int) -> dict[str, Any]:
    p = cluster(run, f"hang-{os.getpid()}", etcd)
    try:
        address = start_driver(p, "--straggler-policy", "off")
        script = run / "worker.py"
        script.write_text(ALLREDUCE_WORKER)
        p.spawn(
            "agent-n0",
            ["agent", "--driver", address, "--node-id", "n0", "--nproc-per-node", "2",
             "--worker-cmd", f"{sys.executable} {script}", "--master-port", str(free_port()),
             "--log-dir", str(run / "logs-n0"), "--socket", str(run / "n0.sock"), "--no-flash"],
        )  # fmt: skip

        def ranks(at_least: int) -> dict[int, dpb.WorkerStatus] | None:
            nodes = live(address)
            if not nodes or len(nodes[0].workers) != 2:
                return None
            ws = {w.local_rank: w for w in nodes[0].workers}
            return ws if min(w.step for w in ws.values()) >= at_least else None

        ws = until(lambda: ranks(30), 300, "two ranks stepping", poll_s=0.5)
        detect, resume, thresholds = [], [], []
        for i in range(n):
            ws = until(lambda: ranks(0), 60, "a steady rhythm")
            before = len([e for e in p.events() if e.HasField("hang_suspected")])
            pid, stuck = ws[1].pid, ws[1].step
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()

            def hung(before: int = before) -> list[ev.HangSuspected]:
                got = [e.hang_suspected for e in p.events() if e.HasField("hang_suspected")]
                return got[before:]

            found = until(hung, 60, "HangSuspected", poll_s=0.05)
            detect.append(time.monotonic() - t0)
            thresholds.append(found[0].threshold_ms)
            os.kill(pid, signal.SIGCONT)
            t1 = time.monotonic()
            until(
                lambda stuck=stuck: (w := ranks(0)) and w[1].step > stuck + 1,
                60,
                "the next step",
                poll_s=0.02,
            )
            resume.append(time.monotonic() - t1)
            print(f"  hang {i + 1}/{n}: detected {detect[-1]:.2f} s, resumed {resume[-1]:.2f} s")
            time.sleep(3.0)  # a few steps of rhythm again
        step_ms = [w.median_step_ms for w in (ranks(0) or {}).values()]
        return {
            "hangs": n,
            "hang_detect_s": detect,
            "hang_detect_p50_s": p50(detect),
            "hang_resume_s": resume,
            "hang_resume_p50_s": p50(resume),
            "hang_threshold_ms": thresholds,
            "step_ms": p50(step_ms),
            "hang_resume_meaning": "SIGCONT to the next step in the live view (no recovery loop)",
        }
    finally:
        p.stop()


# ---------------------------------------------------------------- straggler
def straggler_part(run: Path, etcd: EmbeddedEtcd, timeout_s: float) -> dict[str, Any]:
    p = cluster(run, f"straggler-{os.getpid()}", etcd)
    job = p.job
    metrics = run / "metrics.jsonl"
    train = (
        f"{sys.executable} -m unbroken.trainer.run --preset tiny --dp 2 --steps 10000000 "
        f"--log-every 1000 --metrics-out {metrics}"
    )
    stop = threading.Event()
    try:
        address = start_driver(
            p, "--nodes", "2", "--workers-per-node", "1", "--dp", "2",
            "--worker-cmd", train, "--master-addr", "127.0.0.1", "--miss-limit", "30",
            "--straggler-policy", "alert",
        )  # fmt: skip
        for node, buddy in (("node-0", "node-1"), ("node-1", "node-0")):
            p.start_agent(
                node,
                ["--no-start", "--worker-cmd", f"{sys.executable} -c pass", "--allow-remote-cmd",
                 "--flash-dir", str(run / f"shm-{node}"), "--flash-job", job],
                buddy=buddy,
            )  # fmt: skip

        def step() -> int:
            steps = [w.step for n in live(address) for w in n.workers]
            return min(steps) if len(steps) == 2 else 0

        timings = (run / "timings.jsonl").open("a")

        def recorder() -> None:  # every sweep's inputs, for replaying the detector offline
            while not stop.wait(StragglerConfig().sweep_ms / 1000.0):
                with contextlib.suppress(grpc.RpcError):
                    record_timings(timings, live(address))

        threading.Thread(target=recorder, daemon=True).start()
        until(lambda: step() >= 150, 600, "training past its first windows", poll_s=1.0)
        # ...and the detector past its settle and baseline sweeps (a slowdown before the
        # nodes' roles are taken would be taken for their roles)
        time.sleep(StragglerConfig().role_s(w for n in live(address) for w in n.workers))
        out: dict[str, Any] = {}
        for f in FACTORS:
            before = len([e for e in p.events() if e.HasField("straggler_suspected")])
            inject(address, "node-1", "slow-train", f)
            timings.write(json.dumps({"t": time.time(), "inject": f}) + "\n")
            t0 = time.monotonic()

            def named(before: int = before) -> list[ev.StragglerSuspected]:
                got = [
                    e.straggler_suspected for e in p.events() if e.HasField("straggler_suspected")
                ]
                return got[before:]

            try:
                s = until(named, timeout_s, f"StragglerSuspected at {f}x", poll_s=0.5)[0]
                out[f"{f:.2f}"] = {
                    "detect_s": time.monotonic() - t0,
                    "node": s.node_id,
                    "right_node": s.node_id == "node-1",
                    "slowdown": s.slowdown,
                    "z": s.z,
                    "evidence": s.evidence,
                }
            except UntilTimeout:
                out[f"{f:.2f}"] = {"detect_s": None, "node": "", "right_node": False}
            print(f"  straggler {f:.2f}x: {out[f'{f:.2f}']}")
            inject(address, "node-1", "slow-train", 1.0)
            timings.write(json.dumps({"t": time.time(), "inject": 1.0}) + "\n")
            at = step()
            # two of the agent's windows (128 reports, a report standing for up to 2 steps
            # this short): the next factor starts from a node that recovered, not from the
            # tail of this one (which would still be the finding already named)
            until(lambda at=at: step() >= at + 512, 900, "the window to wash out", poll_s=1.0)
        nodes = live(address)
        stop.set()
        named = [e.straggler_suspected for e in p.events() if e.HasField("straggler_suspected")]
        return {
            "straggler_detect_s": out,
            # every StragglerSuspected of the run naming a node never slowed (node-0)
            "false_straggler_flags": sum(x.node_id != "node-1" for x in named),
            "straggler_events": len(named),
            "replay": replay_timings(run / "timings.jsonl"),
            "step_ms": p50([w.median_step_ms for n in nodes for w in n.workers]),
            "timeout_s": timeout_s,
        }
    finally:
        stop.set()
        p.stop()


# ---------------------------------------------------------------- false positives
def start_hog(run: Path, n: int) -> list[subprocess.Popen[bytes]]:
    if n <= 0:
        return []
    stress = shutil.which("stress-ng")
    if stress:
        cmd = [stress, "--cpu", str(n), "--timeout", "0"]
        return [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)]
    busy = "while True: pass"
    return [
        subprocess.Popen([sys.executable, "-c", busy], start_new_session=True) for _ in range(n)
    ]


def fp_part(run: Path, minutes: float, hog: int) -> dict[str, Any]:
    up_dir = run / "up"
    hogs = start_hog(run, hog)
    loads: list[float] = []
    silences: dict[str, list[float]] = {}
    p = cluster(run)
    try:
        p.spawn(
            "up",
            ["up", "--no-drill", "--no-live", "--duration", str(minutes * 60.0 + 120.0),
             "--steps", "100000000", "--run-dir", str(up_dir)],
        )  # fmt: skip
        # the drivers' port files name their gRPC ports
        until(lambda: list(up_dir.glob("*.port.json")), 300, "up's drivers", poll_s=1.0)

        def driver_addresses() -> list[str]:
            out = []
            for f in sorted(up_dir.glob("*.port.json")):
                with contextlib.suppress(ValueError, KeyError, OSError):  # being written
                    out.append(f"127.0.0.1:{json.loads(f.read_text())['grpc_port']}")
            return out

        # read again until both drivers' files are whole: read once, as soon as the first
        # file appeared, a 20-minute run once had no live view at all (no silences, no table)
        addresses = driver_addresses()
        # `up` runs secured: the viewer token reads the live view
        md = token_metadata(read_token(None, str(up_dir / "tokens" / "viewer.token")))
        t_end = time.monotonic() + minutes * 60.0 + 60.0  # + start-up
        next_load = next_timing = 0.0
        timings = (run / "timings.jsonl").open("a")
        last: dict[str, float] = {}
        while time.monotonic() < t_end and p.procs["up"].poll() is None:
            now = time.monotonic()
            if now >= next_load:
                loads.append(os.getloadavg()[0])
                next_load = now + 10.0
                if len(addresses) < 2:
                    addresses = driver_addresses()
            for a in addresses:
                nodes = live(a, md)
                if nodes and any(n.alive for n in nodes):
                    if now >= next_timing:  # every node's timing, as the straggler sweep sees it
                        record_timings(timings, nodes)
                        next_timing = now + 2.0
                    for n in nodes:
                        if not n.alive:
                            continue
                        # a silence episode is the largest silent_ms seen before it drops
                        prev = last.get(n.node_id, 0.0)
                        if n.silent_ms < prev:
                            silences.setdefault(n.node_id, []).append(prev)
                        last[n.node_id] = n.silent_ms
                    break
            time.sleep(0.1)
    finally:
        for h in hogs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(h.pid, signal.SIGKILL)
        p.stop()
    timings.close()
    with LocalCluster(up_dir, job="demo") as c:  # up's etcd, on its data
        events = c.events()
    kinds = [e.WhichOneof("payload") for e in events]
    world_nodes = 4  # 2 training nodes + 2 spares heartbeat the whole time
    counts = {
        "node_lost": kinds.count("node_lost"),
        "hang_suspected": kinds.count("hang_suspected"),
        "straggler_suspected": kinds.count("straggler_suspected"),
        "leader_changes": max(0, kinds.count("leader_elected") - 1),
    }
    node_days = world_nodes * minutes / 1440.0
    all_gaps = [g for gs in silences.values() for g in gs]
    table: list[dict[str, Any]] | None = [] if all_gaps else None  # None: no live view read
    for m in MISS_LIMITS if all_gaps else ():
        timeout_ms = m * 100.0
        table.append(  # type: ignore[union-attr]
            {
                "miss_limit": m,
                "detect_latency_ms": timeout_ms + 20.0,  # + the sweep period (interval / 5)
                "false_node_lost": sum(1 for g in all_gaps if g > timeout_ms),
                "per_node_day": sum(1 for g in all_gaps if g > timeout_ms) / max(node_days, 1e-9),
            }
        )
    return {
        "minutes": minutes,
        "hog_processes": hog,
        "hog": "stress-ng" if shutil.which("stress-ng") else "busy python",
        "load1_samples": loads,
        "load1_p50": p50(loads),
        "load1_min": min(loads) if loads else None,
        "false_positives": counts,
        "false_positives_per_node_day": {k: v / max(node_days, 1e-9) for k, v in counts.items()},
        "events": len(events),
        "max_silence_ms": max(all_gaps) if all_gaps else None,
        "miss_limit_table": table,
        "straggler_replay": replay_timings(run / "timings.jsonl"),
    }


def record_timings(out: Any, nodes: list[dpb.NodeLive]) -> None:
    """One line: every alive node's timing summary (common/timing.py), for the replay."""
    timings: dict[str, list[float]] = {}
    rec = {"t": time.time(), "nodes": timings}
    for n in nodes:
        t = node_timing(n.workers) if n.alive else None
        if t is not None:
            timings[n.node_id] = [
                t.generation, t.compute_ms, t.mad_ms, t.wait_ms, t.window_steps, t.wait_mad_ms
            ]  # fmt: skip
    out.write(json.dumps(rec) + "\n")
    out.flush()


def replay_timings(path: Path, ks: tuple[float, ...] = (3.0, 2.5, 2.0)) -> dict[str, Any]:
    """The recorded sweeps through the straggler detector at its defaults and at lower `k`:
    how many stragglers each names (the margin of the run's zero, not only the zero)."""
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in lines if "nodes" in r]  # not the injections' marks
    named: dict[str, Any] = {"sweeps": len(recs)}
    for k in ks:
        watch = StragglerWatch(StragglerConfig(k=k))
        found = 0
        for r in recs:
            found += len(
                watch.sweep([
                    Sample(n, int(v[0]), v[1], v[2], v[3], int(v[4]), v[5])
                    for n, v in r["nodes"].items()
                ])
            )  # fmt: skip
        named[f"named_at_k_{k:g}"] = found
    return named


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="hang,straggler,false_positives")
    ap.add_argument("--hangs", type=int, default=5)
    ap.add_argument("--minutes", type=float, default=3.0, help="false-positive run (issue: 20)")
    ap.add_argument("--hog", type=int, default=2, help="busy processes during it (0: none)")
    ap.add_argument("--straggler-timeout", type=float, default=120.0)
    ap.add_argument("--overload-seconds", type=float, default=180.0, help="per kind")
    ap.add_argument("--variants", default="new", help="overload: new and/or baseline")
    ap.add_argument("--hogs", type=int, default=8, help="overload: stress-ng workers")
    ap.add_argument("--kinds", default="cpu,memory_bandwidth,restart_storm", help="overload")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the JSON file it merges into")
    ns = ap.parse_args()
    results: Path = ns.results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what it started, then exit
    parts = {x.strip() for x in ns.parts.split(",") if x.strip()}
    out: dict[str, Any] = {"load1_start": os.getloadavg()[0], "cores": os.cpu_count()}
    base = Path(tempfile.mkdtemp(prefix="bench-detectors-"))
    etcd = EmbeddedEtcd(base / "etcd").start()
    try:
        if "hang" in parts:
            (base / "hang").mkdir()
            out["hang"] = hang_part(base / "hang", etcd, ns.hangs)
            out["hang_detect_p50_s"] = out["hang"]["hang_detect_p50_s"]
            out["hang_resume_p50_s"] = out["hang"]["hang_resume_p50_s"]
        if "straggler" in parts:
            (base / "straggler").mkdir()
            out["straggler"] = straggler_part(base / "straggler", etcd, ns.straggler_timeout)
            out["straggler"]["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            out["straggler_detect_s"] = {
                k: v["detect_s"] for k, v in out["straggler"]["straggler_detect_s"].items()
            }
            out["false_straggler_flags"] = out["straggler"]["false_straggler_flags"]
        if "overload" in parts:
            from bench.overload import overload_part

            cfg = {"hogs": ns.hogs, "storm_procs": 6, "storm_every_s": 20.0, "kill_every_s": 15.0}
            runs = out["overload"] = {}
            for variant in [v.strip() for v in ns.variants.split(",") if v.strip()]:
                (base / f"overload-{variant}").mkdir()
                kinds = tuple(k.strip() for k in ns.kinds.split(",") if k.strip())
                runs[variant] = overload_part(
                    base / f"overload-{variant}", etcd, variant, ns.overload_seconds, cfg, kinds
                )
            first = runs.get("new") or next(iter(runs.values()))
            out["false_node_lost"] = first["false_node_lost"]
            out["detect_p99_s_under_load"] = first["detect_p99_s_under_load"]
            out["overload_seconds_per_kind"] = ns.overload_seconds
    finally:
        etcd.stop()
    if "false_positives" in parts:
        (base / "fp").mkdir()
        out["false_positive_run"] = fp_part(base / "fp", ns.minutes, ns.hog)
        out["false_positive_run"]["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        out["false_positives"] = out["false_positive_run"]["false_positives"]
    out["load1_end"] = os.getloadavg()[0]
    out["logs"] = str(base)
    results.parent.mkdir(parents=True, exist_ok=True)
    if results.exists():  # keep the parts not run now (read now: another run may have ended)
        with contextlib.suppress(ValueError):
            out = {**json.loads(results.read_text()), **out}
    results.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=2))
    shown = (
        "straggler_detect_s", "false_straggler_flags", "false_positives", "false_node_lost",
        "detect_p99_s_under_load",
    )  # fmt: skip
    for k in shown:
        if k in out:
            print(k, json.dumps(out[k]))
    if (out.get("false_positive_run") or {}).get("miss_limit_table"):
        print("| miss limit | detection latency (ms) | false NodeLost | per node-day |")
        print("|---:|---:|---:|---:|")
        for row in out["false_positive_run"]["miss_limit_table"]:
            print(
                f"| {row['miss_limit']} | {row['detect_latency_ms']:.0f} | "
                f"{row['false_node_lost']} | {row['per_node_day']:.1f} |"
            )


if __name__ == "__main__":
    main()
