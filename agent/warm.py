"""Warm standby workers: a Python with torch already imported, waiting for its rank.

A fresh Python that imports torch costs 1-5 s on a loaded 2-core machine, most of a worker
crash's resume time. The agent therefore keeps standbys: processes started exactly like a
worker (same interpreter and options, same exec wrapper, same stdout/stderr pipes, same
session, same environment minus the per-start variables) that import the heavy modules
(`preload`) and then wait on a socketpair. Starting a worker hands one the worker's
environment and argv; it replaces its environment, then runs the worker's module or script
as `__main__` through `runpy`, in the process the agent already watches. Its pid, process
group, parent, pipes, niceness and exit code are the ones a cold start would have had, so
supervision, the pdeathsig tie to the agent, hang detection, stack dumps and killing the
process group are unchanged.

Only commands of the form `PYTHON [-u|-B|-O|-s|-E|-I|-X opt|-W opt...] (-m MODULE | SCRIPT)
ARGS` can be warm, and only when the environment at hand-off differs from the standby's
only in per-start variables (`LATE_KEYS`, `UNBROKEN_*`): anything else that a Python or
torch reads at start-up (OMP_NUM_THREADS, PYTHON*, LD_*) must be the same. Otherwise, or
when no live standby is left, the worker starts cold. A standby that is still importing
is handed off anyway: it is always further along than a process started now.

A standby may wait at a lower priority than the workers (`--warm-nice`, e.g. 19, so its
imports take only idle CPU); the hand-off then sets every thread back to the niceness a cold
worker gets. That needs the right to raise a priority (root / CAP_SYS_NICE, or RLIMIT_NICE); an
agent without it starts standbys at the workers' niceness.

On by default where the node has spare cores (`unbroken agent`: at least 4 per local
worker, as a GPU node has), off on smaller hosts such as this project's 2-core machine,
where the standbys' imports compete with training; `--warm-workers` / `--no-warm-workers`
decide either way. Measured (bench/recovery.py, `worker_crash_resume_s`): a worker crash
resumed training in 0.6 s warm on an idle 2-core host, against several seconds cold. A worker
started this way shows the standby's command line in `ps` (`python -m unbroken.agent.warm
...`), not the worker's.

The standby side (`python -m unbroken.agent.warm --fd N --preload a,b`) imports modules by
name only (nothing of the agent's, no logging set-up) so the worker's code runs in a clean
interpreter; it exits when the agent's end of the socket closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import json
import os
import resource
import runpy
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from unbroken.common import aio

log = structlog.get_logger(__name__)

#: Environment variables that may differ between a standby's start and its hand-off.
LATE_KEYS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
    }
)
LATE_PREFIX = "UNBROKEN_"

#: What a standby imports by default: torch, its distributed stack and the embedded engine.
DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "unbroken.trainer.run",
    "unbroken.trainer.gpt3d",
    "unbroken.trainer.flashckpt",
    "unbroken.trainer.hooks",
    "unbroken.trainer.checkpoint",
    "unbroken.trainer.data",
    "unbroken.trainer.warmup",
)
#: A preloaded module may define this function: the standby calls it after the imports, to
#: prepare what every worker would otherwise do on its resume path (the trainer's data
#: module reads and tokenizes the default corpus).
WARM_HOOK = "__unbroken_warm__"

# Interpreter options a standby can share with the command (none changes how -m/argv work).
_FLAG_OPTIONS = frozenset({"-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-q", "-b", "-bb"})
_ARG_OPTIONS = frozenset({"-X", "-W"})
_READY = b"ready\n"
_MAX_JOB_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Target:
    """A Python worker command split into what a standby needs."""

    python: str
    options: tuple[str, ...]
    module: str  # "-m MODULE", or "" for a script
    script: str  # the script path, or "" for a module
    args: tuple[str, ...]

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        """Standbys are interchangeable between commands with the same interpreter+options."""
        return (self.python, self.options)


def parse_target(cmd: Sequence[str]) -> Target | None:
    """The warm-startable form of a worker command, or None when it must start cold.

    Args:
        cmd: the worker command (`WorkerSpec.cmd`).

    Returns:
        A `Target` for `PYTHON [options] -m MODULE ...` and `PYTHON [options] SCRIPT ...`.
    """
    if not cmd or not Path(cmd[0]).name.startswith("python"):
        return None
    i, opts = 1, []
    while i < len(cmd):
        a = cmd[i]
        if a in _FLAG_OPTIONS:
            opts.append(a)
            i += 1
        elif a in _ARG_OPTIONS and i + 1 < len(cmd):
            opts += [a, cmd[i + 1]]
            i += 2
        else:
            break
    if i >= len(cmd):
        return None
    if cmd[i] == "-m" and i + 1 < len(cmd):
        return Target(cmd[0], tuple(opts), cmd[i + 1], "", tuple(cmd[i + 2 :]))
    if cmd[i].startswith("-"):  # -c, -, or an option we do not vouch for
        return None
    return Target(cmd[0], tuple(opts), "", cmd[i], tuple(cmd[i + 1 :]))


def compatible(standby_env: dict[str, str], env: dict[str, str]) -> str:
    """Why a standby started with `standby_env` cannot run with `env` ("" when it can)."""
    for k in standby_env.keys() | env.keys():
        if k in LATE_KEYS or k.startswith(LATE_PREFIX):
            continue
        if standby_env.get(k) != env.get(k):
            return f"environment variable {k} changed since the standby started"
    return ""


def may_raise_priority(target: int) -> bool:
    """Whether this process's children may lower their niceness to `target`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - soft <= target:
        return True
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 23 & 1)  # CAP_SYS_NICE
    except (OSError, ValueError):
        pass
    return False


def renice_process(pid: int, nice: int) -> None:
    """Set every thread of process `pid` (0: this one) to `nice` (Linux niceness is per
    thread)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid or 'self'}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)


# ---------------------------------------------------------------- the agent's side
class Standby:
    """One waiting process and the agent's end of its socketpair."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        sock: socket.socket,
        env: dict[str, str],
        key: Any,
        nice: int | None = None,
    ) -> None:
        self.nice = nice  # the niceness to take at hand-off (None: it already has it)
        self.proc = proc
        self.sock = sock
        self.env = env
        self.key = key
        self.ready = False
        self.started = time.monotonic()
        self.ready_s = 0.0
        self.watch: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and self.sock.fileno() >= 0

    async def _watch_ready(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            data = await loop.sock_recv(self.sock, len(_READY))
            if data == _READY:
                self.ready = True
                self.ready_s = time.monotonic() - self.started
                log.info("standby ready", pid=self.proc.pid, import_s=round(self.ready_s, 2))

    async def hand_off(self, target: Target, env: dict[str, str]) -> asyncio.subprocess.Process:
        """Send the worker's environment and argv; the standby becomes the worker.

        A standby waiting at a lower priority takes the worker's now, from this side: one
        still importing reads its job only once its imports are done, and those imports are
        now the worker's start (a waited-for rank's, at nice 19 behind the job's own work).
        """
        if self.nice is not None and not self.ready:
            renice_process(self.proc.pid, self.nice)
        job: dict[str, Any] = {"env": env, "module": target.module, "script": target.script}
        job["args"] = list(target.args)
        job["nice"] = self.nice
        loop = asyncio.get_running_loop()
        await aio.wait_for(loop.sock_sendall(self.sock, json.dumps(job).encode() + b"\n"), 5)
        self.close_socket()
        return self.proc

    def close_socket(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
        self.sock.close()

    async def kill(self) -> None:
        """Close the socket (the standby exits on EOF) and kill its group to be sure."""
        self.close_socket()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await aio.wait_for(self.proc.wait(), 5)


async def spawn_standby(
    target: Target,
    env: dict[str, str],
    *,
    wrapper: list[str],
    preload: Sequence[str],
    nice: int | None = None,
) -> Standby:
    """Start one standby for commands like `target` (same wrapper, pipes and session).

    Args:
        target: any command the standby may later run (only its interpreter and options
            are used now).
        env: the environment a worker started now would get.
        wrapper: the exec wrapper workers start under (`exec_wrapper`).
        preload: modules to import while waiting.
        nice: the absolute niceness to take at hand-off, when `wrapper` starts the standby
            at a lower priority than a worker (None: it already runs at the worker's).
    """
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = await asyncio.create_subprocess_exec(
            *wrapper,
            target.python,
            *target.options,
            "-m",
            "unbroken.agent.warm",
            "--fd",
            str(theirs.fileno()),
            "--preload",
            ",".join(preload),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            process_group=0,  # the agent's session: its priorities apply (agent/workers.py)
            pass_fds=(theirs.fileno(),),
        )
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    mine.setblocking(False)
    s = Standby(proc, mine, dict(env), target.key, nice)
    s.watch = asyncio.create_task(s._watch_ready())
    return s


# ---------------------------------------------------------------- the standby's side
def _recv_job(sock: socket.socket) -> dict[str, Any] | None:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return None  # the agent closed our socket: nothing to run
        buf += chunk
        if len(buf) > _MAX_JOB_BYTES:
            raise ValueError(f"hand-off message larger than {_MAX_JOB_BYTES} bytes")
    job: dict[str, Any] = json.loads(buf)
    return job


def _preload(names: Sequence[str]) -> None:
    for name in names:
        # A module that fails here fails again, with the same error, when the worker runs.
        with contextlib.suppress(Exception):
            warm = getattr(importlib.import_module(name), WARM_HOOK, None)
            if callable(warm):
                warm()
    # Everything imported so far lives as long as the process: out of the collector's
    # sight, a full collection (the worker's recovery path runs some) scans only what the
    # worker makes, about 1 ms instead of 1.6-2 s at load 40 (300,000 objects). The warm
    # hooks' garbage goes first: frozen, a dry run's cycles (its trainer, its meshes, a
    # failed step's frames) would never be freed, and DTensor's planners, keyed by a weak
    # reference to a mesh, would match the worker's equal meshes with the dry run's.
    gc.collect()
    gc.freeze()


def standby_main(argv: Sequence[str] | None = None) -> int:
    """Import, wait for a job, become the worker. Returns only when there was no job."""
    p = argparse.ArgumentParser(prog="python -m unbroken.agent.warm")
    p.add_argument("--fd", type=int, required=True, help="our end of the agent's socketpair")
    p.add_argument("--preload", default="", help="comma-separated modules to import")
    ns = p.parse_args(argv)
    sock = socket.socket(fileno=ns.fd)
    _preload([m for m in ns.preload.split(",") if m])
    # The agent may have handed us a job (and closed its end) while we were importing: the
    # job is still in our receive buffer even though "ready" can no longer be sent.
    with contextlib.suppress(OSError):
        sock.sendall(_READY)
    try:
        job = _recv_job(sock)
    except OSError:
        job = None
    finally:
        sock.close()
    if job is None:
        return 0
    env: dict[str, str] = job["env"]
    if job.get("nice") is not None:
        renice_process(0, int(job["nice"]))
    os.environ.clear()
    os.environ.update(env)
    from unbroken.trainer.rtrace import mark  # (json, os and time only)

    mark("handoff")
    module, script, args = str(job["module"]), str(job["script"]), list(job["args"])
    if module:
        # Imported as a plain module by the preload: run it afresh as __main__, as -m would.
        sys.modules.pop(module, None)
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(standby_main())
