"""False NodeLost under the overloads this machine really sees, and a real kill's detection.

Used by bench/detectors.py (`--parts overload`). One job as `make run` trains it (a driver
with `--nodes 2 --dp 2` and the tiny trainer flash-saving every step on two agents, two
spare agents; miss limit 5 x 100 ms) runs through each overload kind in turn:

* `cpu`: `stress-ng --cpu N` (busy loops, in their own session as another tenant's job);
* `memory_bandwidth`: `stress-ng --stream N` (memory-bandwidth hogs, as many as the CPU
  hogs so the load is as high);
* `restart_storm`: the job's own restarts: a world worker SIGKILLed every `storm_every_s`,
  so the loop restarts both workers and each imports torch at once, plus `storm_procs`
  processes importing torch beside them at all times (one starts as one ends), so the
  storm keeps the load up for the whole run rather than in bursts.

While each runs, a spare agent is SIGKILLed every `kill_every_s` (its stream closes) and
started again: `detect_s` is the kill to its NodeLost's wall time in the log. Every NodeLost
of a node not killed in the 10 s before is a false one (`false_node_lost`). The driver's
"held node came back" lines count late nodes held as starved that came back (losses that
the grace avoided). The load average is sampled every 5 s.

`variant` "baseline" runs the same with the starvation grace off (`--starved-hold-ms 0`)
and the agents' loops not real-time (`--no-realtime`): the figures before this change.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from unbroken.cli.cluster import LocalCluster, until
from unbroken.driver.etcd import EmbeddedEtcd

KINDS = ("cpu", "memory_bandwidth", "restart_storm")
REPLICA_KEY = "bench-overload-replica-key-0123456789"
TRAIN = [
    "-m", "unbroken.trainer.run", "--preset", "tiny", "--dp", "2", "--log-every", "1000",
    "--steps", "100000000",
]  # fmt: skip
IMPORT_TORCH = "import torch, torch.distributed"


def _overload(kind: str, hogs: int) -> list[subprocess.Popen[bytes]]:
    stress = shutil.which("stress-ng")
    if kind == "cpu":
        cmd = [stress, "--cpu", str(hogs)] if stress else None
    elif kind == "memory_bandwidth":
        cmd = [stress, "--stream", str(hogs)] if stress else None
    else:
        return []
    if cmd is None:
        raise RuntimeError("stress-ng is not installed (apt-get install stress-ng)")
    return [
        subprocess.Popen(
            [*cmd, "--timeout", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]  # fmt: skip


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]  # nearest rank


class Job:
    """The job's processes on `run`'s etcd."""

    def __init__(self, run: Path, etcd: EmbeddedEtcd, variant: str) -> None:
        self.c = LocalCluster(run, etcd=etcd, env={"UNBROKEN_REPLICA_KEY": REPLICA_KEY}, grace_s=15)
        self.variant = variant
        self.run = run

    def start(self) -> None:
        c = self.c
        extra = ["--starved-hold-ms", "0"] if self.variant == "baseline" else []
        cmd = " ".join([sys.executable, *TRAIN, "--dp", "2"])
        c.start_driver(
            "driver",
            ["--nodes", "2", "--workers-per-node", "1", "--dp", "2", "--worker-cmd", cmd,
             "--master-addr", "127.0.0.1", "--miss-limit", "5",
             "--archive-url", str(self.run / "archive"), *extra],
            wait_s=180,
        )  # fmt: skip
        for node, buddy, spare in (("n0", "n1", False), ("n1", "n0", False)):
            self.agent(node, buddy, spare)
        for s in ("s0", "s1"):
            self.agent(s, "n1", True)

    def agent(self, node: str, buddy: str, spare: bool) -> None:
        args = [
            "--no-start", "--worker-cmd", sys.executable + " -c pass", "--allow-remote-cmd",
            "--flash-dir", str(self.run / f"shm-{node}"), "--flash-job", self.c.job,
            "--hang-floor-ms", "10000", "--no-warm-checks",
        ]  # fmt: skip
        if self.variant == "baseline":
            args.append("--no-realtime")
        self.c.start_agent(node, args, buddy=buddy, spare=spare)

    def workers(self) -> list[int]:
        """Pids of the world's workers now (from their agents' logs' newest start)."""
        out = []
        for node in ("n0", "n1", "s0", "s1"):
            pid = self._newest_worker(node)
            if pid:
                out.append(pid)
        return out

    def _newest_worker(self, node: str) -> int:
        try:
            text = self.c.log(node)
        except OSError:
            return 0
        for line in reversed(text.splitlines()):
            if "worker started" in line and "pid=" in line:
                with contextlib.suppress(ValueError):
                    return int(line.split("pid=")[1].split()[0])
        return 0

    def stepping(self) -> bool:
        return any("worker started" in self.c.log(n) for n in ("n0", "n1"))


def run_kind(job: Job, kind: str, seconds: float, cfg: dict[str, Any]) -> dict[str, Any]:
    c = job.c
    hogs = _overload(kind, cfg["hogs"])
    storm: list[subprocess.Popen[bytes]] = []
    loads: list[float] = []
    kills: list[tuple[str, float]] = []  # (node, wall time of the kill)
    first_seq = len(c.events()) + 1
    t0 = time.monotonic()
    next_load = next_kill = next_storm = t0 + 5.0
    victims = ["s0", "s1"]
    try:
        while time.monotonic() - t0 < seconds:
            now = time.monotonic()
            if now >= next_load:
                loads.append(os.getloadavg()[0])
                next_load = now + 5.0
            if kind == "restart_storm":
                storm = [p for p in storm if p.poll() is None]
                storm += [
                    subprocess.Popen([sys.executable, "-c", IMPORT_TORCH], start_new_session=True)
                    for _ in range(cfg["storm_procs"] - len(storm))
                ]
                if now >= next_storm:
                    for pid in job.workers()[:1]:  # the loop restarts every worker: a storm
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    next_storm = now + cfg["storm_every_s"]
            if now >= next_kill:
                node = victims[len(kills) % len(victims)]
                if c.procs[node].poll() is None:
                    kills.append((node, time.time()))
                    c.kill(node)
                    time.sleep(1.5)  # let its loss land before it comes back (new epoch)
                    c.respawn(node)
                next_kill = now + cfg["kill_every_s"]
            time.sleep(0.2)
    finally:
        _stop(hogs)
        _stop(storm)
    time.sleep(3.0)  # the last kill's NodeLost
    events = [e for e in c.events(first_seq) if e.HasField("node_lost")]
    detect: list[float] = []
    false: list[dict[str, Any]] = []
    used: set[int] = set()
    for e in events:
        t = e.wall_time_unix_ns / 1e9
        match = next(
            (i for i, (n, k) in enumerate(kills)
             if i not in used and n == e.node_lost.node_id and 0 <= t - k <= 10.0),
            None,
        )  # fmt: skip
        if match is None:
            false.append(
                {"node": e.node_lost.node_id, "silent_ms": round(e.node_lost.silent_ms),
                 "reason": e.node_lost.reason}
            )  # fmt: skip
        else:
            used.add(match)
            detect.append(t - kills[match][1])
    return {
        "seconds": round(time.monotonic() - t0, 1),
        "load1_samples": [round(x, 2) for x in loads],
        "load1_min": min(loads) if loads else None,
        "load1_mean": round(sum(loads) / len(loads), 2) if loads else None,
        "kills": len(kills),
        "kills_detected": len(detect),
        "detect_s": [round(x, 3) for x in detect],
        "detect_p99_s_under_load": _percentile(detect, 0.99),
        "detect_p50_s": _percentile(detect, 0.5),
        "false_node_lost": len(false),
        "false_node_lost_detail": false,
    }


def overload_part(
    run: Path,
    etcd: EmbeddedEtcd,
    variant: str,
    seconds: float,
    cfg: dict[str, Any],
    kinds: tuple[str, ...] = KINDS,
) -> dict[str, Any]:
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"overload kinds must be among {KINDS}, got {sorted(unknown)}")
    job = Job(run, etcd, variant)
    out: dict[str, Any] = {"variant": variant, "seconds_per_kind": seconds, **cfg}
    try:
        job.start()
        until(lambda: len(job.workers()) >= 2, 300, "the job's workers", poll_s=1.0)
        time.sleep(10.0)  # first steps
        for kind in kinds:
            out[kind] = run_kind(job, kind, seconds, cfg)
            time.sleep(5.0)
        held = job.c.log("driver").count("held node came back")
        out["held_nodes_came_back"] = held
    finally:
        job.c.stop()
    out["false_node_lost"] = {k: out[k]["false_node_lost"] for k in kinds}
    out["detect_p99_s_under_load"] = {k: out[k]["detect_p99_s_under_load"] for k in kinds}
    return out


if __name__ == "__main__":  # `make bench` runs every file here: this one is a part
    print("a part of bench/detectors.py: make bench-detectors ARGS='--parts overload'")
