"""The agent's own CPU for flash checkpoints: ring scans, replicas to the buddy, persistence.

Two agents' flash parts (`NodeFlash`, each in a process of its own, buddies of each other,
keyed replicas over loopback, persistence to a local folder) with a writer process each
that saves a tiny-model-like state (157 tensors, 1.5 MB) every `--period-ms` into the
agent-owned ring, as a worker's trainer does with a save every step. The figure is each
agent process's CPU per second of wall time (utime + stime from /proc), with the writers
saving against the same agents idle (no writer), runs interleaved `--reps` times, so the
host's drift falls on both; the ratio of the medians and the load average are recorded.

Why it matters: on a node whose cores all train, every millisecond the agent spends is taken
from a rank (bench-recovery's 2-core host: ~2 % of the steps per agent CPU-%). Session 7
found most of it in the ring scans' thread hops (`to_thread` per listing) and pathlib joins,
not in the copies: 26-31 ms/s per agent before, this bench's figures after.

Run: ``make bench-agent_flash`` or ``.venv/bin/python bench/agent_flash.py [--secs 30]
[--reps 3] [--poll-ms 100]``. Writes bench/results/agent_flash.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "agent_flash.json"
TENSORS, NUMEL = 157, 2400  # ~1.5 MB of float32, as the tiny preset's state per rank
KEY = b"bench-agent-flash-key-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def writer(root: str, rank: int, period_s: float, secs: float) -> None:
    """Save a fresh 1.5 MB state every `period_s` (memory only; one in 400 persisted)."""
    import torch

    from unbroken.recovery.flash import FlashWriter
    from unbroken.recovery.flashcopy import PERSIST_META
    from unbroken.recovery.flashowner import FlashConfig, FlashOwner

    torch.set_num_threads(1)
    w = FlashWriter(rank, FlashOwner(FlashConfig(root=Path(root), job="bench")))
    state: dict[str, Any] = {f"layers.{i}.w": torch.randn(NUMEL) for i in range(TENSORS)}
    step, due = 0, time.monotonic()
    end = due + secs
    while time.monotonic() < end:
        step += 1
        state["step"] = step
        state["layers.0.w"].add_(1.0)
        w.save(state, step=step, meta={PERSIST_META: step % 400 == 0}).wait_copied()
        due += period_s
        time.sleep(max(0.0, due - time.monotonic()))
    w.close()


async def agent(root: str, node: str, port: int, buddy: int, secs: float, poll_ms: int) -> None:
    """One node's flash part, serving and replicating for `secs`."""
    from unbroken.agent.flash import NodeFlash, NodeFlashConfig

    cfg = NodeFlashConfig(
        root=root,
        job="bench",
        node=node,
        persist_url=str(Path(root).parent / f"storage-{node}"),
        replica_key=KEY,
        listen=f"127.0.0.1:{port}",
        buddy=f"127.0.0.1:{buddy}",
        poll_ms=poll_ms,
    )
    flash = NodeFlash(cfg, world_size=2, node_id=node)
    await flash.start()
    Path(f"{root}.ready").write_text("ready")
    await asyncio.sleep(secs)
    await flash.close(clean=True)


def run_once(saves: bool, secs: float, poll_ms: int, period_s: float) -> dict[str, Any]:
    """Two agents (and with `saves`, their writers); each agent's CPU ms per second."""
    work = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ub-agent-flash-"))
    py, me = sys.executable, str(Path(__file__).resolve())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ports = [_free_port(), _free_port()]
    procs: list[subprocess.Popen[bytes]] = []
    load0 = os.getloadavg()[0]
    try:
        agents = []
        for i, node in enumerate(("n0", "n1")):
            cmd = [py, me, "--agent", str(work / node), node, str(ports[i]), str(ports[1 - i])]
            cmd += [str(secs + 10), str(poll_ms)]
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
            procs.append(p)
            agents.append(p)
        deadline = time.monotonic() + 120
        while not all((work / f"{n}.ready").exists() for n in ("n0", "n1")):
            assert all(p.poll() is None for p in agents), "an agent exited before it was ready"
            assert time.monotonic() < deadline, "the agents did not start in 120 s"
            time.sleep(0.05)
        if saves:
            for i, node in enumerate(("n0", "n1")):
                cmd = [py, me, "--writer", str(work / node), str(i), str(period_s), str(secs + 5)]
                procs.append(subprocess.Popen(cmd, env=env))
        time.sleep(3.0)  # the writers' first saves (the ring's allocation) left out
        c0, t0 = [_cpu_s(p.pid) for p in agents], time.monotonic()
        time.sleep(secs)
        c1, t1 = [_cpu_s(p.pid) for p in agents], time.monotonic()
        for p in procs:
            p.wait(timeout=60)
        ms = [1000.0 * (b - a) / (t1 - t0) for a, b in zip(c0, c1, strict=True)]
        return {"saves": saves, "agent_cpu_ms_per_s": ms, "load1": (load0, os.getloadavg()[0])}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        root, rank, period, secs = sys.argv[2:6]
        writer(root, int(rank), float(period), float(secs))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--agent":
        root, node, port, buddy, secs, poll = sys.argv[2:8]
        asyncio.run(agent(root, node, int(port), int(buddy), float(secs), int(poll)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--secs", type=float, default=30.0, help="measured seconds per run")
    ap.add_argument("--reps", type=int, default=3, help="runs per mode, interleaved")
    ap.add_argument("--poll-ms", type=int, default=100, help="the agents' --flash-poll-ms")
    ap.add_argument("--period-ms", type=float, default=65.0, help="a save every (the step)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    runs = []
    for rep in range(a.reps):
        for saves in (True, False):
            r = run_once(saves, a.secs, a.poll_ms, a.period_ms / 1000.0)
            r["rep"] = rep
            runs.append(r)
            print(json.dumps(r), flush=True)
    med = {
        s: statistics.median(x for r in runs if r["saves"] is s for x in r["agent_cpu_ms_per_s"])
        for s in (True, False)
    }
    result = {
        "what": "each agent process's CPU ms per wall second: two buddy agents, a writer each "
        f"saving {TENSORS} tensors ({TENSORS * NUMEL * 4 / 1e6:.1f} MB) every "
        f"{a.period_ms:g} ms, against the same agents with no writer",
        "poll_ms": a.poll_ms,
        "secs": a.secs,
        "cores": os.cpu_count(),
        "runs": runs,
        "median_ms_per_s_with_saves": med[True],
        "median_ms_per_s_idle": med[False],
        "saves_over_idle": med[True] / med[False] if med[False] else None,
        "extra_ms_per_s": med[True] - med[False],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n| agents | CPU ms per s (median) |\n|---|---|")
    print(f"| writers saving every {a.period_ms:g} ms | {med[True]:.1f} |")
    print(f"| idle (no writer) | {med[False]:.1f} |")
    print(f"\nextra for the saves: {result['extra_ms_per_s']:.1f} ms/s per agent; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
