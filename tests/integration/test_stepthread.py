"""A rank whose gloo send was cut mid-payload is freed by its agent's hold (trainer/stepthread.py).

Gloo forgets the waiter of a transfer already on the wire when its connection breaks: the
receiver of a send whose sender was SIGKILLed mid-payload waits out the group's timeout,
and shutting its own sockets down (the gloo guard) does not end that wait (the pair is
closed already). Seen in CI: `make run`'s layout (pp2 x tp2) with a rank killed, a survivor
stayed in its step's last pipeline transfer, was killed at the hold limit and replaced.

Here a real agent `Supervisor` and `HookServer` run a worker that joins a real 2-rank gloo
world and receives 256 MiB from a peer outside the agent. The test stops the worker
(SIGSTOP) once its receive is posted, lets the peer send until the sockets' buffers are
full, kills the peer, and resumes the worker: gloo reads part of the payload and then the
closed connection. With the step on its side thread, the agent's hold frees the worker at
once and it is held in its process; with the step on the main thread it is still blocked
at the hold's limit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.agenthold import hold_worker
from unbroken.agent.workers import Worker
from unbroken.driver.etcd import free_port

pytestmark = pytest.mark.integration

HOLD_LIMIT_S = 3.0

RANK = """
import datetime, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from unbroken.trainer import ncclguard, stepthread
from unbroken.trainer.rejoin import Held, hold, open_sockets, peer_failure

port, rank, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[4])
threaded = sys.argv[3] == "1"
n = (256 << 20) // 4
before = open_sockets()
hooks = None
if rank == 0:
    from unbroken.trainer import hookchannel
    hooks = hookchannel.install()
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=120),
)
dist.all_reduce(torch.ones(4))  # the pair is up
if rank == 1:  # the sender, outside the agent: killed by the test mid-send
    while not (out / "go").exists():
        time.sleep(0.01)
    (out / "sending").touch()
    dist.send(torch.ones(n), 0)
    time.sleep(120)
    sys.exit(0)
guard = ncclguard.start_guard(hooks, before)
buf = torch.empty(n)

def step():
    work = dist.irecv(buf, 1)
    hooks.phase("train")
    work.wait()

try:
    stepthread.run(step, buf) if threaded else step()
    print("received all", flush=True)
except Exception as e:
    print(f"freed {type(e).__name__} tripped={ncclguard.tripped()!r}", flush=True)
    guard.stop()
    hold(Held(str(e), 1), hooks, wait_s=30, world_since=before)
"""


def _hold(tmp_path: Path, threaded: bool) -> tuple[str, float, list[dict[str, object]], str]:
    port = free_port()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [str(port), "1", "0", str(tmp_path)]
    peer = subprocess.Popen([sys.executable, str(script), *argv], env=env)

    async def cut_its_transfer(w: Worker) -> None:
        deadline = time.monotonic() + 90
        os.kill(w.pid, signal.SIGSTOP)  # it reads nothing while the peer sends
        (tmp_path / "go").touch()
        while not (tmp_path / "sending").exists():
            assert time.monotonic() < deadline, "the peer never sent"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the sockets' buffers are full: the send blocks
        peer.kill()
        peer.wait()
        os.kill(w.pid, signal.SIGCONT)
        await asyncio.sleep(1.0)  # the worker reads part of the payload, then the close

    cmd = [sys.executable, str(script), str(port), "0", str(int(threaded)), str(tmp_path)]
    try:
        said, took, logs = asyncio.run(
            hold_worker(tmp_path, cmd, HOLD_LIMIT_S, "train", cut_its_transfer)
        )
    finally:
        peer.kill()
        peer.wait()
    log = (tmp_path / "worker-0.log").read_text(errors="replace")
    return said, took, logs, log


def test_the_hold_frees_a_rank_whose_transfer_gloo_lost(tmp_path: Path) -> None:
    said, took, logs, log = _hold(tmp_path, threaded=True)
    assert "held local ranks [0]" in said and "stopped []" in said, (said, log)
    assert took < 1.5, (took, log)  # guard poll 50 ms, grace 250 ms; no wait for the limit
    assert "step left on its thread" in log, log
    assert "freed LeftBehind tripped='held by the agent'" in log, log
    (summary,) = [e for e in logs if e.get("event") == "in-job hold"]
    assert summary["held"] == [0] and summary["not_held_in_time"] == []


def test_on_the_main_thread_gloo_keeps_the_rank_blocked_at_the_limit(tmp_path: Path) -> None:
    """The bug the step thread works around: neither the closed connection nor the guard's
    shut sockets end the receive's wait."""
    said, took, _, log = _hold(tmp_path, threaded=False)
    assert "held local ranks []" in said and "stopped [0]" in said, (said, log)
    assert took >= HOLD_LIMIT_S, took
    assert "shut this rank's gloo world down" in log, log
    assert "freed" not in log and "received all" not in log, log
