"""Benchmark of a node crash recovered through Slurm: detect, replacement started, resumed.

Each run is a fresh single-host Slurm cluster of 5 nodes (tests/slurmcluster.py: munged,
slurmctld, one slurmd per node) and an `sbatch --no-kill` job holding n1..n4; the tiny model
trains at dp 3 on n1..n3, each agent its own one-node job step (as `unbroken slurm submit`
does); n4 is the spare. Then n2 crashes: its slurmd, its slurmstepd, its agent and worker
are SIGKILLed. Two modes, alternating, on the same cluster layout:

* `slurm` (what is measured): `unbroken driver --scheduler slurm --scheduler-spares 1
  --slurm-spares job,expand`: the driver starts n4's agent itself through Slurm (`srun
  --jobid=J -w n4`); after the crash it drains n2 with the incident in the reason and
  refills the spare pool by growing the job onto the free n5 (`salloc
  --dependency=expand:J`) and starting n5's agent as a step.
* `static` (the baseline, today's static pool): `--scheduler none`, n4's spare agent started
  by hand (the bench's own `srun` step); nothing reaches Slurm.

Figures per run, from the events' wall times (seconds after the crash): detect (NodeLost
n2), spare assigned (SpareAssigned n4 -> n2), resumed (the first TrainingResumed after it),
drained (SchedulerCall drain n2, slurm only), refill started (SchedulerCall replace: n5's
agent step started) and refill registered (NodeRegistered n5), with the load average at the
crash. Medians over the runs; the ratio of slurm's resumed to static's in the same run.

Run: ``.venv/bin/python bench/slurm.py [--runs N]`` or ``make bench-slurm`` (default 3 runs
per mode, ~1-2 min each on 2 cores). Needs Slurm installed (tests/slurmcluster.py installs
the Debian packages when apt-get can). Writes bench/results/slurm.json and prints the
README table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.jobs import Job, slurm_agent_script, start_slurm_driver  # noqa: E402
from tests.slurmcluster import SlurmCluster, ensure_installed  # noqa: E402
from unbroken.cli.cluster import until  # noqa: E402
from unbroken.driver.etcd import EmbeddedEtcd  # noqa: E402
from unbroken.proto import events_pb2 as ev  # noqa: E402

BUDDY = {"n1": "n2", "n2": "n1", "n3": "n1", "n4": "n1", "n5": "n1"}
KEY = "test-job-replica-key-0123456789"  # as Job._spawn gives the driver
FIGURES = ("detect_s", "spare_s", "resumed_s", "drained_s", "refill_started_s", "refill_reg_s")


def one_run(mode: str, tmp: Path, endpoint: str) -> dict[str, Any]:
    """One crash of n2 in a fresh 5-node cluster; the figures of `mode`."""
    cluster = SlurmCluster(tmp / "slurm", 5).start()
    job = Job(tmp, endpoint)
    steps: list[subprocess.Popen[bytes]] = []
    jid = ""
    try:
        agent = slurm_agent_script(job, tmp, BUDDY)
        hold = tmp / "hold.sh"
        hold.write_text("#!/bin/bash\nsleep 3600\n")
        r = cluster.cmd(
            "sbatch", "--parsable", "--no-kill", "-N4", "-w", "n[1-4]", "-o", "/dev/null", str(hold)
        )
        jid = r.stdout.strip().split(";")[0]
        until(
            lambda: cluster.cmd("squeue", "-h", "-j", jid, "-o", "%t").stdout.strip() == "R",
            30,
            "the allocation",
        )
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "SLURM_CONF": str(cluster.conf),
            "UNBROKEN_REPLICA_KEY": KEY,
        }
        sched = (
            ["--scheduler", "slurm", "--slurm-job-id", jid, "--slurm-conf", str(cluster.conf),
             "--scheduler-spares", "1", "--slurm-spares", "job,expand",
             "--slurm-agent-cmd", f"bash {agent} {{node}} --spare"]
            if mode == "slurm"
            else []
        )  # fmt: skip
        archive = ("--archive-url", str(tmp / "archive"))
        start_slurm_driver(job, cluster.conf, tmp / "driver.json", *archive, *sched)
        by_hand = ["n1", "n2", "n3"] + (["n4"] if mode == "static" else [])
        for n in by_hand:
            extra = ["--spare"] if n == "n4" else []
            argv = ["srun", f"--jobid={jid}", "--overlap", "-N1", "-n1", f"-w{n}"]
            steps.append(
                subprocess.Popen(
                    [*argv, "bash", str(agent), n, *extra],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        until(lambda: job.max_step() >= 3, 300, "training to start", job)
        until(lambda: _registered(job, "n4"), 120, "the spare n4 registered", job)
        step0 = job.max_step()
        until(lambda: job.max_step() >= step0 + 2, 60, "two more steps", job)
        load = os.getloadavg()[0]
        crash_wall = time.time()
        cluster.crash_node("n2")
        want_refill = mode == "slurm"

        def done() -> bool:
            f = figures(job.events(), crash_wall)
            return f["resumed_s"] is not None and (
                not want_refill or (f["refill_reg_s"] is not None and f["drained_s"] is not None)
            )

        until(done, 300, "the recovery", job)
        out = figures(job.events(), crash_wall)
        out.update(mode=mode, load1=round(load, 2))
        return out
    finally:
        job.close()
        cluster.end_job(steps, jid)
        cluster.stop()


def _registered(job: Job, node: str) -> bool:
    return any(
        e.HasField("node_registered") and e.node_registered.node_id == node for e in job.events()
    )


def figures(events: list[ev.Event], crash_wall: float) -> dict[str, Any]:
    """Seconds from the crash to each event of the recovery (None: not seen)."""

    def after(e: ev.Event) -> float:
        return round(e.wall_time_unix_ns / 1e9 - crash_wall, 3)

    out: dict[str, Any] = dict.fromkeys(FIGURES)
    lost = next(
        (e for e in events if e.HasField("node_lost") and e.node_lost.node_id == "n2"), None
    )
    if lost is None:
        return out
    out["detect_s"] = after(lost)
    for e in events:
        if e.seq <= lost.seq:
            continue
        if (
            out["spare_s"] is None
            and e.HasField("spare_assigned")
            and e.spare_assigned.replaces_node_id == "n2"
        ):
            out["spare_s"] = after(e)
            out["spare"] = e.spare_assigned.spare_node_id
        elif out["resumed_s"] is None and e.HasField("training_resumed"):
            out["resumed_s"] = after(e)
            out["resumed_step"] = e.training_resumed.at_step
        elif e.HasField("scheduler_call"):
            c = e.scheduler_call
            if c.action == "drain" and c.node_id == "n2" and c.ok and out["drained_s"] is None:
                out["drained_s"] = after(e)
                out["drain_reason"] = c.reason
            elif c.action == "replace" and c.ok and out["refill_started_s"] is None:
                out["refill_started_s"] = after(e)
                out["refill_node"] = c.detail
                out["refill_call_s"] = round(c.duration_s, 3)
        elif (
            out["refill_reg_s"] is None
            and e.HasField("node_registered")
            and e.node_registered.node_id == out.get("refill_node")
        ):
            out["refill_reg_s"] = after(e)
    return out


def _median(xs: list[Any]) -> float | None:
    got = [x for x in xs if x is not None]
    return round(statistics.median(got), 2) if got else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("static", "slurm"):
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {f: _median([r.get(f) for r in mine]) for f in FIGURES}
        out[mode]["runs"] = len(mine)
        out[mode]["load1_median"] = _median([r["load1"] for r in mine])
    a, b = out["slurm"]["resumed_s"], out["static"]["resumed_s"]
    out["resumed_ratio_slurm_vs_static"] = round(a / b, 2) if a and b else None
    # the load moves both modes a lot on a shared host: each slurm run against the static
    # run just before it (same round)
    rounds: dict[int, dict[str, float]] = {}
    for r in runs:
        if r.get("resumed_s") is not None:
            rounds.setdefault(r["round"], {})[r["mode"]] = r["resumed_s"]
    paired = [x["slurm"] / x["static"] for x in rounds.values() if len(x) == 2]
    out["resumed_ratio_paired_median"] = round(statistics.median(paired), 2) if paired else None
    return out


def table(result: dict[str, Any]) -> str:
    s = result["summary"]

    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    rows = [
        ("crash -> NodeLost (detect)", "detect_s"),
        ("crash -> spare n4 assigned", "spare_s"),
        ("crash -> training resumed", "resumed_s"),
        ("crash -> n2 drained in Slurm", "drained_s"),
        ("crash -> refill: n5's agent step started (job grown)", "refill_started_s"),
        ("crash -> refill: n5's agent registered", "refill_reg_s"),
    ]
    lines = [
        f"| median of {s['slurm']['runs']} runs each | static pool (baseline) | Slurm |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {cell(s['static'][k])} | {cell(s['slurm'][k])} |" for name, k in rows]
    lines.append(
        f"| load average (1 min) at the crash | {s['static']['load1_median']} | "
        f"{s['slurm']['load1_median']} |"
    )
    lines.append(
        f"\nresumed, Slurm / static: {s['resumed_ratio_slurm_vs_static']} (medians), "
        f"{s['resumed_ratio_paired_median']} (median of each round's pair)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "slurm.json"))
    ns = p.parse_args(argv)
    why = ensure_installed()
    if why:
        print(f"bench/slurm.py: {why}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    etcd = EmbeddedEtcd(root / "etcd").start()
    runs: list[dict[str, Any]] = []
    errors: list[str] = []
    t0 = time.monotonic()
    try:
        for i in range(ns.runs):
            for mode in ("static", "slurm"):
                tmp = root / f"{mode}-{i}"
                tmp.mkdir()
                try:
                    r = one_run(mode, tmp, etcd.endpoint)
                except (AssertionError, TimeoutError, RuntimeError) as e:
                    errors.append(f"{mode}-{i}: {str(e)[:300]}")
                    print(f"run {mode}-{i} failed: {str(e)[:2000]}", file=sys.stderr)
                    continue
                r["round"] = i
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        etcd.stop(remove=True)
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "cluster": "5 Slurm nodes on one host; job n1..n4 (3 training, tiny gpt3d dp3, + spare "
        "n4), n5 free; n2 crashed (slurmd, slurmstepd, agent, worker SIGKILLed); "
        "--miss-limit 30 at 100 ms heartbeats",
        "runs_per_mode": ns.runs,
        "wall_s": round(time.monotonic() - t0, 1),
        "errors": errors,
        "summary": summarize(runs),
        "raw": runs,
    }
    Path(ns.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
