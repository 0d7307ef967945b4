"""A rank blocked in a gloo operation on a live peer is freed by its agent's hold.

Seen in a `make run` drill (pp2 x tp2, gloo): after a worker's SIGKILL the stage-0 rank whose
pipeline peer died stayed blocked in its receive while its other peers left; it never read
the agent's hold, was called hung 2.1 s later, and the incident restarted every process
(10.4 s instead of about 3). Here a real agent `Supervisor` and `HookServer` run a worker
that joins a real 2-rank gloo world and blocks in `recv` from a peer that is alive and never
sends (a process outside the agent, as a rank on another node whose agent has not acted yet).
With the worker's `GlooGuard` (trainer/ncclguard.py) the hold shuts the worker's own world
sockets down, the receive fails at once, and the worker is held in its process through the
real `rejoin.hold`. Without the guard the same worker is still blocked at the hold's limit.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.agenthold import hold_worker
from unbroken.agent.workers import Worker
from unbroken.driver.etcd import free_port

pytestmark = pytest.mark.integration

HOLD_LIMIT_S = 3.0

RANK = """
import datetime, os, sys, time
import torch
import torch.distributed as dist
from unbroken.trainer import ncclguard
from unbroken.trainer.rejoin import Held, hold, open_sockets, peer_failure

port, rank, guarded = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
before = open_sockets()
hooks = None
if rank == 0:
    from unbroken.trainer import hookchannel
    hooks = hookchannel.install()
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=60),
)
t = torch.ones(1 << 16)
dist.all_reduce(t)  # the pair is up
if rank == 1:
    print("peer ready", flush=True)
    time.sleep(120)  # alive, never sends again
    sys.exit(0)
guard = ncclguard.start_guard(hooks, before) if guarded else None
hooks.phase("train")
print("ready", flush=True)
try:
    dist.recv(t, 1)
except Exception as e:
    print(f"freed peer_failure={peer_failure(e)} tripped={ncclguard.tripped()!r}", flush=True)
    if guard is not None:
        guard.stop()
    hold(Held(str(e), 1), hooks, wait_s=30, world_since=before)
"""


def _hold(tmp_path: Path, guarded: bool) -> tuple[str, float, list[dict[str, object]], str]:
    port = free_port()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peer = subprocess.Popen(
        [sys.executable, str(script), str(port), "1", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )

    async def inside_its_recv(_: Worker) -> None:
        await asyncio.sleep(0.3)

    cmd = [sys.executable, str(script), str(port), "0", "1" if guarded else "0"]
    try:
        said, took, logs = asyncio.run(
            hold_worker(tmp_path, cmd, HOLD_LIMIT_S, "train", inside_its_recv)
        )
    finally:
        peer.kill()
        peer.wait()
    log = (tmp_path / "worker-0.log").read_text(errors="replace")
    return said, took, logs, log


def test_the_hold_frees_a_rank_blocked_on_a_live_gloo_peer(tmp_path: Path) -> None:
    said, took, logs, log = _hold(tmp_path, guarded=True)
    assert "held local ranks [0]" in said and "stopped []" in said, (said, log)
    assert took < 1.5, (took, log)  # the guard polls every 50 ms; no wait for the limit
    assert "freed peer_failure=True tripped='held by the agent'" in log, log
    assert "shut this rank's gloo world down" in log, log
    (summary,) = [e for e in logs if e.get("event") == "in-job hold"]
    assert summary["held"] == [0] and summary["not_held_in_time"] == []


def test_without_the_guard_the_rank_is_still_blocked_at_the_limit(tmp_path: Path) -> None:
    said, took, logs, log = _hold(tmp_path, guarded=False)
    assert "held local ranks []" in said and "stopped [0]" in said, (said, log)
    assert took >= HOLD_LIMIT_S, took
    assert "freed" not in log, log
    (late,) = [e for e in logs if "not held in time" in str(e.get("event"))]
    assert late["local_ranks"] == [0]
