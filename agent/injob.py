"""In-job recovery on the agent: hold the healthy workers in their processes, replace the rest.

The driver's machine picks the mode of each incident (driver/machine.py). In the in-job mode
the agent does, for its node:

- `hold` (StopWorkers with `in_job`): SIGKILLs the ranks the driver names as faulty and every
  worker that cannot rejoin (exited, stopped by a signal, or without a reply socket), first,
  so the survivors' collectives with them fail at once; sends every other worker a hold
  command (trainer/run.py leaves its step at a boundary, drops its process groups and says
  it is held); waits until each says so, and kills the ones that did not within the limit
  (they are then replaced like the faulty ones).
- `rejoin` (StartWorkers with `in_job`): sends each held worker its new environment (the new
  world's ranks, rendezvous, restore point), so it re-joins in the same process, and starts
  a process (a warm standby when one is ready) only for the local ranks without one.

Anything that fails here leaves a rank without a live worker, which the restore then waits
for in vain: the driver's restore times out and its machine falls back to a restart of every
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import time
from collections.abc import Iterable

import structlog

from unbroken.agent import procexit
from unbroken.agent.hang import cap_stacks
from unbroken.agent.hookserver import HookServer
from unbroken.agent.workers import Supervisor, Worker, process_stopped
from unbroken.common import aio, workerenv
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import hooks_pb2 as hpb

log = structlog.get_logger(__name__)

#: What the agent sets per launch like torchrun (agent/launch.py `WorkerLaunch.environ`).
TORCHRUN_VARIABLES = frozenset(
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
    }
)
HELD_PHASE = "held"  # the phase a held worker reports (trainer/run.py HELD_PHASE)
#: A worker not held by then is killed and replaced: its step may be long, or it may be
#: stuck in a collective with a peer that is still alive (its gloo timeout is the backstop).
HOLD_TIMEOUT_S = 5.0
#: ...or sooner for a worker whose steps are short: `HOLD_STEPS` of its median step time, not
#: under `HOLD_MIN_S`. Its guard (trainer/ncclguard.py) fails the collective it waits in
#: within 50 ms, so a held rank is out of its step well inside one step; the ranks that were
#: not (a gloo rank blocked in its step's closing all-reduce after its sockets were shut, in
#: four `make run` drills: pp2 x tp2, 0.45 s steps) waited the whole 5 s for their kill.
HOLD_STEPS = 4.0
HOLD_MIN_S = 2.0
#: How long a worker not held in time gets to dump its stacks (py-spy, else its faulthandler)
#: before it is killed: the incident waits this much longer in that case only.
STACKS_TIMEOUT_S = 0.5


def rejoinable(w: Worker) -> bool:
    """Whether `w` is a live worker that can take commands (and is not stopped)."""
    return (
        w.proc is not None
        and w.proc.returncode is None
        and w.state == dpb.WORKER_STATE_RUNNING
        and bool(w.reply_socket)
        and not process_stopped(w.pid)
    )


async def kill(w: Worker, *, reap: bool = True) -> None:
    """SIGKILL `w`'s process group now (no grace: its peers must notice) and, with `reap`,
    wait for its exit.

    The hold does not wait (`reap=False`): from the signal on the process runs no more of its
    own code (the kernel marks its whole thread group exiting when SIGKILL is sent), but
    tearing down its address space (0.5 GB for the bench's tiny worker, a CUDA context on a
    GPU) runs at the worker's niceness, and on the 2-core host at load 7 it took 0.2-4.4 s:
    the evicted node's pause waited all of it. A replacement for the same local rank waits
    for the exit (`rejoin` kills, and reaps, any worker it does not rejoin), so its GPU memory
    is free before the new process starts."""
    if w.proc is None or w.proc.returncode is not None:
        return
    w.state = dpb.WORKER_STATE_STOPPED  # stopped on command: no WorkerFailed for it
    with contextlib.suppress(ProcessLookupError):
        os.killpg(w.pid, signal.SIGKILL)
    if not reap:
        return
    with contextlib.suppress(TimeoutError):
        await aio.wait_for(procexit.exit_code(w.proc), 5.0)
    for t in w.tasks:
        with contextlib.suppress(BaseException):
            await aio.wait_for(t, 2.0)


def hold_limit_s(w: Worker, timeout_s: float = HOLD_TIMEOUT_S) -> float:
    """How long the hold waits for `w`: `timeout_s`, or `HOLD_STEPS` of its median step
    time when that is shorter (never under `HOLD_MIN_S`, nor for a worker with no steps)."""
    if len(w.step_times) < 3:
        return timeout_s
    by_steps = HOLD_STEPS * statistics.median(w.step_times) / 1000.0
    return min(timeout_s, max(HOLD_MIN_S, by_steps))


async def hold(
    sup: Supervisor,
    hooks: HookServer | None,
    replace: Iterable[int],
    timeout_s: float = HOLD_TIMEOUT_S,
) -> str:
    """Kill the faulty local ranks, hold the others in their processes; what was done."""
    replace = set(replace)
    doomed = [
        w for r, w in sup.workers.items() if r in replace or hooks is None or not rejoinable(w)
    ]
    keep = [w for w in sup.workers.values() if w not in doomed]
    await asyncio.gather(*(kill(w, reap=False) for w in doomed))
    assert hooks is not None or not keep
    for w in keep:
        if w.phase != HELD_PHASE:
            hooks.send_to(w, hpb.WorkerCommand(hold="in-job recovery"))  # type: ignore[union-attr]
    t0 = time.monotonic()
    limits = {w.local_rank: hold_limit_s(w, timeout_s) for w in keep}
    pending = list(keep)
    while pending:
        now = time.monotonic()
        pending = [w for w in pending if w.phase != HELD_PHASE and rejoinable(w)]
        if all(now - t0 >= limits[w.local_rank] for w in pending):
            break
        await asyncio.sleep(0.01)
    late = [w for w in keep if w.phase != HELD_PHASE or not rejoinable(w)]
    if late:  # where each was stuck, before the kill (once seen on a GPU, not explained)
        dumps = await asyncio.gather(*(sup.dump_stacks(w, STACKS_TIMEOUT_S) for w in late))
        log.warning(
            "in-job hold: workers not held in time, their stacks before the kill",
            local_ranks=sorted(w.local_rank for w in late),
            stacks=cap_stacks({w.local_rank: d for w, d in zip(late, dumps, strict=True)}),
        )
    await asyncio.gather(*(kill(w, reap=False) for w in late))
    held = [w.local_rank for w in keep if w not in late]
    log.info(
        "in-job hold",
        held=held,
        replaced=sorted(w.local_rank for w in doomed),
        not_held_in_time=sorted(w.local_rank for w in late),
    )
    return f"in-job: held local ranks {held}, stopped {sorted(w.local_rank for w in doomed + late)}"


async def rejoin(sup: Supervisor, hooks: HookServer | None) -> str:
    """Send every held worker its new world (`sup.launch`); start the missing ranks."""
    spec, launch = sup.spec, sup.launch
    rejoined, started = [], []
    base = dict(os.environ)
    for r in range(spec.nproc):
        w = sup.workers.get(r)
        # a held worker rejoins whatever its new rank: its process-wide caches of the old
        # world are forgotten where its place changed (trainer/rejoin.py apply_rejoin), and
        # its state is resharded from the rings like any restore
        if w is not None and hooks is not None and w.phase == HELD_PHASE and rejoinable(w):
            env = launch.environ(spec, r, sup.socket_path)
            # the world's variables and the launch's own, always (the worker's may differ
            # from the agent's environment), plus anything else that differs from it
            ours = TORCHRUN_VARIABLES | set(launch.env) | set(workerenv.VARIABLES.values())
            changed = {k: v for k, v in env.items() if k in ours or base.get(k) != v}
            unset = [k for k in workerenv.VARIABLES.values() if k not in env]
            cmd = hpb.WorkerCommand(rejoin=hpb.Rejoin(env=changed, unset=unset))
            if hooks.send_to(w, cmd):
                w.global_rank = launch.rank_base + r
                w.step = 0  # the driver's restore waits for a step in the new world
                w.restored_step, w.restored_from = None, ""
                w.phase = "startup"
                w.last_progress = time.monotonic()
                w.step_times.clear()
                # its step timings were of its old place (another stage, other peers): the
                # straggler sweep learns its new role from the new world's steps only
                w.compute_times.clear()
                w.wait_times.clear()
                w.rejoins += 1
                rejoined.append(r)
                continue
        if w is not None:
            await kill(w)
        await sup.start(r, refill=False)
        started.append(r)
    sup.schedule_refill()
    log.info("in-job rejoin", rejoined=rejoined, started=started, world=launch.world_size)
    return f"in-job: rejoined local ranks {rejoined} in place, started {started}"
