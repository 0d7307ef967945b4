"""A SIGSTOPped rank of a real 2-rank gloo job is flagged by its agent within a few seconds,
with the stacks of both ranks in HangSuspected; continued, it trains on and is re-armed.

One driver (etcd-backed log, no recovery loop) and one agent with two workers that
all-reduce every 100 ms step through torch.distributed (gloo), marking the wait with the
SDK's `hooks.collective()`. SIGSTOP on rank 1 stalls rank 0 in its all-reduce: both ranks
stop progressing, the agent judges rank 1 hung from its own rhythm (1 s floor; rank 0,
waiting in a collective, is a victim judged later), dumps the stacks of both ranks (the
stopped rank through its SIGUSR2 dump-and-stop handler, so it stays stopped) and raises
the STALLED flag; the driver appends one HangSuspected for the node.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import ALLREDUCE_WORKER
from tests.procs import Procs, live, procs, read_events, start_driver
from unbroken.agent.hang import STOPPED_AFTER_MS
from unbroken.cli.cluster import until
from unbroken.common.workerenv import STACKS_END
from unbroken.diagnostics.check import free_port

pytestmark = pytest.mark.integration
__all__ = ["procs"]


def test_sigstopped_rank_is_flagged_with_stacks_and_rearmed(
    procs: Procs, tmp_path: Path, etcd_server: Any
) -> None:
    job = f"hang-{uuid.uuid4().hex[:8]}"
    addr, stub = start_driver(procs, tmp_path, "--etcd", etcd_server.endpoint, "--job-id", job)
    script = tmp_path / "worker.py"
    script.write_text(
        f"import os\nopen({str(tmp_path / 'worker-pids')!r}, 'a').write(str(os.getpid()) + ' ')\n"
        + ALLREDUCE_WORKER
    )
    procs.start(
        "agent-n0",
        [
            "agent", "--driver", addr, "--node-id", "n0", "--nproc-per-node", "2",
            "--worker-cmd", f"{sys.executable} {script}", "--master-port", str(free_port()),
            "--log-dir", str(tmp_path / "logs-n0"), "--socket", str(tmp_path / "n0.sock"),
            "--no-flash",
        ],
    )  # fmt: skip

    def stepping(at_least: int) -> dict[int, Any] | None:
        n = live(stub).get("n0")
        if n is None or len(n.workers) != 2:
            return None
        ws = {w.local_rank: w for w in n.workers}
        return ws if all(w.step >= at_least and w.window_steps > 0 for w in ws.values()) else None

    ws = until(lambda: stepping(10), 120, "two ranks all-reducing for 10 steps", poll_s=0.2)
    assert all(w.wait_ms >= 0.0 and w.compute_ms > 50.0 for w in ws.values()), ws

    def hangs() -> list[Any]:
        return [
            e.hang_suspected
            for e in read_events(etcd_server.config, job)
            if e.HasField("hang_suspected")
        ]

    victim = ws[1].pid
    os.kill(victim, signal.SIGSTOP)
    (h,) = until(hangs, 30, "HangSuspected", poll_s=0.1)  # how fast: bench/detectors.py
    # rank 1's process is stopped: named first, as "stopped" (the culprit: a restart without a
    # diagnosis); rank 0 waits in the all-reduce (a victim, judged collective_k times later),
    # so it may or may not be flagged yet
    assert h.node_id == "n0" and h.local_rank == 1 and 1 in h.hung_ranks, h
    assert h.silent_ms > h.threshold_ms == STOPPED_AFTER_MS and h.phase == "stopped", h
    assert "--- local rank 1 ---\n(process stopped: SIGSTOP)" in h.stack_dump, h.stack_dump
    assert "worker.py" in h.stack_dump and "--- local rank 0 ---" in h.stack_dump
    assert STACKS_END not in h.stack_dump, h.stack_dump  # the dump's end, read and dropped
    # the dump did not end the stop: the rank is still stopped, no step ran
    state = Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state == "T", state

    before = max(w.step for w in live(stub)["n0"].workers)
    os.kill(victim, signal.SIGCONT)
    until(lambda: stepping(before + 5), 30, "training on after SIGCONT", poll_s=0.2)
    os.kill(victim, signal.SIGSTOP)  # progress re-armed the detector: a second hang is reported
    until(lambda: len(hangs()) == 2, 30, "a second HangSuspected", poll_s=0.1)
    os.kill(victim, signal.SIGCONT)


def test_a_rank_stopped_before_its_first_step_is_flagged(
    procs: Procs, tmp_path: Path, etcd_server: Any
) -> None:
    """A rank that has only said "startup" (trainer/run.py says it before the rendezvous)
    and is stopped there, as a restarted world's rank was in bench-recovery, is flagged
    "stopped": not left to the 300 s phase limit its peers and the driver's restore waited."""
    job = f"hang-{uuid.uuid4().hex[:8]}"
    addr, stub = start_driver(procs, tmp_path, "--etcd", etcd_server.endpoint, "--job-id", job)
    script = tmp_path / "worker.py"
    script.write_text(
        "import time\nfrom unbroken.trainer.hookchannel import install\n"
        "install().phase('startup')\n"
        "time.sleep(120)  # as a rank waiting for its peers to join the group\n"
    )
    procs.start(
        "agent-n0",
        [
            "agent", "--driver", addr, "--node-id", "n0",
            "--worker-cmd", f"{sys.executable} {script}", "--master-port", str(free_port()),
            "--log-dir", str(tmp_path / "logs-n0"), "--socket", str(tmp_path / "n0.sock"),
            "--no-flash",
        ],
    )  # fmt: skip

    def starting() -> Any:
        n = live(stub).get("n0")
        ws = [w for w in n.workers if w.phase == "startup"] if n is not None else []
        return ws[0] if ws else None

    w = until(starting, 120, "the worker to say startup", poll_s=0.1)
    assert not w.hung and w.step == 0
    os.kill(w.pid, signal.SIGSTOP)
    try:
        hangs = lambda: [  # noqa: E731
            e.hang_suspected
            for e in read_events(etcd_server.config, job)
            if e.HasField("hang_suspected")
        ]
        (h,) = until(hangs, 30, "HangSuspected", poll_s=0.1)
        assert h.node_id == "n0" and h.phase == "stopped", h
        assert h.threshold_ms == STOPPED_AFTER_MS, h
    finally:
        os.kill(w.pid, signal.SIGCONT)
