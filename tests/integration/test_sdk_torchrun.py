"""The hooks SDK under plain torchrun: a killed worker resumes from the agent's memory.

The example `unbroken.trainer.examples.ddp_unbroken` (a plain DDP script plus < 10 lines of
`unbroken.trainer.hooks`) runs under `torchrun --standalone --nproc-per-node 2`, twice:
1. With no agent on the node (its socket path names nothing): each worker warns once, and
   training finishes. This run is also the reference (the SDK is a no-op there).
2. With a real `unbroken agent` (`--no-start`: it starts no workers of its own, it only owns
   the node's flash memory and the hook socket; no driver is needed for this, the agent
   keeps retrying the driver in the background). The workers attach to it and flash-save
   every step; once rank 1 has saved step KILL_AFTER it is SIGKILLed, torchrun restarts both
   workers (`--max-restarts 2`), they restore the newest step both ranks hold from the
   agent's memory (not step 0) and finish; the final loss must equal the reference's
   exactly (same data, same state, same gloo reductions).
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
from pathlib import Path

import psutil
import pytest

from tests.integration.adapterrun import RESTORED, VALUE_END
from unbroken.diagnostics.check import free_port
from unbroken.recovery.flashcopy import list_copies
from unbroken.recovery.flashowner import FlashConfig, FlashOwner

pytestmark = pytest.mark.integration

# Enough steps that the kill lands mid-run: a step with its flash save takes ~2-3 ms here, so
# 300 steps left the polling test (a starved process under load) ~0.6 s to see step 80, and
# under stress-ng it saw the run end first.
STEPS = 2000
KILL_AFTER = 80  # rank 1's newest flash copy at least this step when it is killed
JOB = "sdk"
EXAMPLE = ["-m", "unbroken.trainer.examples.ddp_unbroken", "--steps", str(STEPS)]
# The ranks share torchrun's stdout: a value ends where another rank's line may begin
# ("step=478" + "2026-11-29 ..." once read 4782026).
FINAL = re.compile(r"final loss (\S+?)" + VALUE_END, re.M)
NO_AGENT = "unbroken.hooks: no agent at"
RUN_DEADLINE_S = 600.0  # torchrun start-ups took 100+ s each at load average 50


def _torchrun(*extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        *extra, *EXAMPLE,
    ]  # fmt: skip


def _env(socket_path: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_AGENT_SOCKET": str(socket_path)}
    # torch 2.13's c10d rendezvous shares one TCPStore with the workers across restarts, so
    # restarted workers can read the dead ones' addresses and hang in init_process_group
    # (pytorch#135712). Its documented switch gives every round a fresh store.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    for k in ("UNBROKEN_FLASH_ROOT", "UNBROKEN_AGENT_PID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    return env


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
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


def _until(what: str, cond: Callable[[], bool], deadline_s: float, log: Path) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}\n{tail}")
        time.sleep(0.05)


def _final_loss(out: str) -> float:
    found = FINAL.findall(out)
    assert len(found) == 1, f"expected one final loss line, got {found}\n{out[-3000:]}"
    return float(found[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[float, str]:
    """The example under plain torchrun with no agent: (final loss, output)."""
    tmp = tmp_path_factory.mktemp("sdk-noagent")
    out = subprocess.run(
        _torchrun(),
        env=_env(tmp / "no-agent.sock"),
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=RUN_DEADLINE_S,
        check=False,
    )
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-3000:]
    return _final_loss(text), text


@pytest.mark.timeout(600)  # includes the reference run (the fixture)
def test_no_agent_warns_once_and_finishes(reference: tuple[float, str]) -> None:
    _, out = reference
    assert out.count(NO_AGENT) == 2, out[-3000:]  # once per worker process, not per call
    assert "flash.restored" not in out and "flash.save" not in out


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Path, FlashOwner, Path]]:
    """A real node agent that starts no workers: (socket, its flash store, its log)."""
    sock, log = tmp_path / "agent.sock", tmp_path / "agent.log"
    args = [
        "--driver", f"127.0.0.1:{free_port()}",  # no driver: the agent retries in the background
        "--node-id", "n0",
        "--worker-cmd", "true",  # never started (--no-start); torchrun starts the workers
        "--nproc-per-node", "2",
        "--no-start",
        "--socket", str(sock),
        "--log-dir", str(tmp_path / "logs"),
        "--flash-dir", str(tmp_path / "shm"),
        "--flash-job", JOB,
        "--persist-url", str(tmp_path / "persist"),
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
        _until("the agent's flash store", lambda: "flash.ready" in log.read_text(), 60, log)
        assert sock.exists()
        yield sock, FlashOwner(FlashConfig(root=str(tmp_path / "shm"), job=JOB)), log
    finally:
        # A clean stop frees the flash memory ("flash.cleaned"); the interpreter's exit after
        # that takes ~13 s here (not this test's subject), so it is cut short.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(AssertionError):
            _until(
                "the agent's clean stop",
                lambda: proc.poll() is not None or "flash.cleaned" in log.read_text(),
                30,
                log,
            )
        _stop(proc, grace_s=1.0)


@pytest.mark.timeout(900)  # three torch start-ups and an agent's: minutes on a loaded host
def test_killed_worker_resumes_from_agent_memory(
    reference: tuple[float, str], agent: tuple[Path, FlashOwner, Path], tmp_path: Path
) -> None:
    sock, owner, agent_log = agent
    log = tmp_path / "torchrun.log"

    def newest(rank: int) -> int:
        refs = list_copies(owner.rank_dir(rank))
        return refs[0].manifest.step if refs else -1

    with open(log, "wb") as f:
        run = subprocess.Popen(
            _torchrun("--max-restarts", "2"),
            env=_env(sock),
            cwd=tmp_path,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _until(f"rank 1 to flash-save step {KILL_AFTER}", lambda: newest(1) >= KILL_AFTER, 180, log)
        workers = [
            p
            for p in psutil.Process(run.pid).children(recursive=True)
            if "unbroken.trainer.examples.ddp_unbroken" in " ".join(p.cmdline())
            and p.environ().get("LOCAL_RANK") == "1"
        ]
        assert len(workers) == 1, workers
        seen = newest(1)
        workers[0].send_signal(signal.SIGKILL)
        assert seen < STEPS, "training ended before the kill; raise STEPS"
        rc = run.wait(RUN_DEADLINE_S)
    finally:
        _stop(run)
    out = log.read_text(errors="replace")
    assert rc == 0, out[-4000:]
    restored = RESTORED.findall(out)
    assert len(restored) == 2, out[-4000:]  # both restarted ranks, once each
    for source, step in restored:
        assert source == "memory", restored
        assert seen <= int(step) < STEPS, (seen, restored)  # the newest copy, not step 0
    assert _final_loss(out) == reference[0]
    # the agent saw both workers attach, then both restarted ones
    assert agent_log.read_text().count("hooks.attached") == 4
