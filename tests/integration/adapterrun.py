"""Running an adapter example under torchrun twice: with no agent (the reference) and with a
real `unbroken agent` while one worker is SIGKILLed mid-training.

The agent starts no workers (`--no-start`): it owns the node's flash memory and the hook
socket, torchrun starts the workers and restarts them after the kill (`--max-restarts`),
and they restore from the agent's memory. Every example prints `step N loss X` on rank 0.
`in_job_keeps_the_healthy_rank` runs an example under unbroken's own driver and agents
instead, where its loop is in `recovery_loop` (in-job recovery).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests import jobs
from tests.jobs import Job
from unbroken.cli.cluster import until as until_job
from unbroken.diagnostics.check import free_port
from unbroken.recovery.flashcopy import list_copies
from unbroken.recovery.flashowner import FlashConfig, FlashOwner

JOB = "adapters"
# The ranks share torchrun's stdout, and a block-buffered line of one can end inside
# another's ("... step=39" + "2026-11-29 08:27:13 [info ..." before its newline, or
# "4.15231" + "[titan] 2026-..."): a value ends at whitespace, the end of a line, a "[",
# or where another line's timestamp begins.
VALUE_END = r"(?=\s|$|\[|\d{4}-\d{2}-\d{2} )"
LOSS = re.compile(r"step (\d+) loss (\S+?)" + VALUE_END, re.M)
RESTORED = re.compile(r"flash\.restored.*?source=(\w+).*?step=(\d+?)" + VALUE_END)
RUN_DEADLINE_S = 600.0
# Each step sleeps this long: on a quiet host a tiny model's 40 steps took under a second,
# so training ended before the kill, and the save pacer (a share of the step time) saved
# only 8 of them.
STEP_DELAY_S = 0.05


def torchrun(module: str, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        *extra, "-m", module, "--steps", str(steps), "--persist-every-s", "0.05",
        "--step-delay-s", str(STEP_DELAY_S),
    ]  # fmt: skip


def env(socket_path: Path) -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_AGENT_SOCKET": str(socket_path)}
    e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # torch 2.13 c10d restarts (pytorch#135712)
    e["TOKENIZERS_PARALLELISM"] = "false"
    for k in ("UNBROKEN_FLASH_ROOT", "UNBROKEN_AGENT_PID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        e.pop(k, None)
    return e


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stop a process started in its own session, with everything it started."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def until(what: str, cond: Callable[[], bool], deadline_s: float, log: Path) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}\n{tail}")
        time.sleep(0.05)


def losses(out: str) -> list[tuple[int, str]]:
    """Every `step N loss X` line, in order (a restarted run repeats steps)."""
    return [(int(s), x) for s, x in LOSS.findall(out)]


def reference(module: str, steps: int, tmp: Path) -> dict[int, str]:
    """The example under plain torchrun with no agent: step -> loss (repr)."""
    out = subprocess.run(
        torchrun(module, steps),
        env=env(tmp / "no-agent.sock"),
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=RUN_DEADLINE_S,
        check=False,
    )
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-3000:]
    got = dict(losses(text))
    assert sorted(got) == list(range(1, steps + 1)), text[-3000:]
    return got


@dataclass
class Agent:
    sock: Path
    owner: FlashOwner
    log: Path
    persist: Path


@contextlib.contextmanager
def agent(tmp: Path) -> Iterator[Agent]:
    """A real node agent that starts no workers."""
    sock, log = tmp / "agent.sock", tmp / "agent.log"
    args = [
        "--driver", f"127.0.0.1:{free_port()}",  # no driver: the agent retries in the background
        "--node-id", "n0",
        "--worker-cmd", "true",  # never started (--no-start); torchrun starts the workers
        "--nproc-per-node", "2",
        "--no-start",
        "--socket", str(sock),
        "--log-dir", str(tmp / "logs"),
        "--flash-dir", str(tmp / "shm"),
        "--flash-job", JOB,
        "--persist-url", str(tmp / "persist"),
    ]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken.cli", "agent", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        until("the agent's flash store", lambda: "flash.ready" in log.read_text(), 120, log)
        owner = FlashOwner(FlashConfig(root=str(tmp / "shm"), job=JOB))
        yield Agent(sock, owner, log, tmp / "persist")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(AssertionError):
            until(
                "the agent's clean stop",
                lambda: proc.poll() is not None or "flash.cleaned" in log.read_text(),
                30,
                log,
            )
        stop(proc, grace_s=1.0)


@dataclass
class Killed:
    out: str
    seen: int  # rank 1's newest flash copy when it was killed
    restored: list[tuple[str, int]]  # (source, step) per restarted rank


def run_killed(module: str, steps: int, kill_after: int, ag: Agent, tmp: Path) -> Killed:
    """Run under torchrun with the agent; SIGKILL local rank 1 once it saved `kill_after`."""
    log = tmp / "torchrun.log"

    def newest(rank: int) -> int:
        refs = list_copies(ag.owner.rank_dir(rank))
        return refs[0].manifest.step if refs else -1

    with open(log, "wb") as f:
        run = subprocess.Popen(
            torchrun(module, steps, "--max-restarts", "2"),
            env=env(ag.sock),
            cwd=tmp,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        until(
            f"rank 1 to flash-save step {kill_after}",
            lambda: newest(1) >= kill_after or run.poll() is not None,
            300,
            log,
        )
        assert run.poll() is None, "training ended before the kill: raise the steps or the delay"
        workers = [
            p
            for p in psutil.Process(run.pid).children(recursive=True)
            if module in " ".join(p.cmdline()) and p.environ().get("LOCAL_RANK") == "1"
        ]
        assert len(workers) == 1, workers
        seen = newest(1)
        workers[0].send_signal(signal.SIGKILL)
        assert seen < steps, "training ended before the kill; raise the steps"
        rc = run.wait(RUN_DEADLINE_S)
    finally:
        stop(run)
    out = log.read_text(errors="replace")
    assert rc == 0, out[-4000:]
    restored = [(s, int(n)) for s, n in RESTORED.findall(out)]
    return Killed(out=out, seen=seen, restored=restored)


def check_resumed(k: Killed, ref: dict[int, str], steps: int) -> int:
    """The restarted ranks restored the newest copy from memory, and every step after it
    has the reference's loss, bit for bit (repr of the float). Returns the restored step."""
    assert len(k.restored) == 2, k.out[-4000:]  # both restarted ranks, once each
    sources = {s for s, _ in k.restored}
    steps_restored = {n for _, n in k.restored}
    assert sources == {"memory"}, k.restored
    assert len(steps_restored) == 1, k.restored
    step = steps_restored.pop()
    assert 0 < step < steps, (k.seen, k.restored)  # a saved step, not a fresh start
    after = losses(k.out.split("flash.restored", 1)[1])
    assert [s for s, _ in after] == list(range(step + 1, steps + 1)), after
    for s, x in after:
        assert x == ref[s], (s, x, ref[s])
    return step


def check_persisted_dcp(persist: Path, key: str, prefix: str = "") -> int:
    """The newest step the agent persisted as a whole DCP checkpoint loads into a fresh
    tiny GPT-2 with `dcp.load`, and its weights are not the fresh model's. Returns it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from unbroken.trainer.examples.accelerate_unbroken import tiny_gpt2

    end = time.monotonic() + 60  # the agent persists in the background
    while not (whole := sorted(p.parent for p in persist.glob("step-*/.metadata"))):
        assert time.monotonic() < end, sorted(str(p) for p in persist.rglob("*"))[:50]
        time.sleep(0.2)
    model = tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state: dict[str, Any] = {}
    node = state
    *outer, last = key.split(".")
    for part in outer:
        node = node.setdefault(part, {})
    # a module's weights under `prefix` (a LightningModule's attribute name)
    node[last] = {prefix + k: v for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(whole[-1]), no_dist=True)
    model.load_state_dict({k[len(prefix) :]: v for k, v in node[last].items()})
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the persisted weights equal a fresh model's"
    return int(whole[-1].name.removeprefix("step-"))


STEPS = 40  # an epoch is 32 steps: the run crosses one
KILL_AFTER = 12


def killed_worker_resumes_bitwise(module: str, tmp: Path, key: str, prefix: str = "") -> None:
    """The example without an agent (the reference), then with one while local rank 1 is
    SIGKILLed: the resume is exact, and the newest persisted step loads with `dcp.load`."""
    ref = reference(module, STEPS, tmp)
    with agent(tmp) as ag:
        killed = run_killed(module, STEPS, KILL_AFTER, ag, tmp)
        check_resumed(killed, ref, STEPS)
        check_persisted_dcp(ag.persist, key, prefix=prefix)


def in_job_keeps_the_healthy_rank(
    job: Job,
    module: str,
    steps: int = 120,
    extra: tuple[str, ...] = (),
    reference_extra: tuple[str, ...] = (),
) -> None:
    """`module` started by unbroken's agents (a driver, two nodes, one rank each): n1's
    worker is SIGKILLed; n0's worker keeps its pid (the example's `recovery_loop` builds its
    library's state again in the new world), restores the agreed step from its agent's
    memory, and every step's loss equals an uninterrupted run's (`extra`, `reference_extra`:
    the example's flags in the job and in the uninterrupted run)."""
    script = ["-m", module, *extra]
    cmd = [sys.executable, *script, "--steps", str(steps), "--metrics-out", str(job.metrics)]
    job.start_driver("--worker-cmd", " ".join(cmd), "--trainer", "ddp-script")
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until_job(lambda: job.max_step() >= 10, 300, "training to start", job)

    job.kill_peer_keep_survivor(past=10, timeout_s=300)
    resumed = [e.training_resumed for e in job.events() if e.HasField("training_resumed")]
    assert resumed[-1].mode == "in_job", resumed

    until_job(lambda: job.max_step() >= steps, 600, "training to its last step", job)
    got = job.steps()
    assert sorted(got) == list(range(1, steps + 1)), sorted(got)
    train = ["-m", module, *reference_extra]
    ref = jobs.reference(job.tmp / "reference", steps, train=train, total_steps=steps)
    for step, values in got.items():
        for v in values:
            assert v == ref[step], (step, v, ref[step])
