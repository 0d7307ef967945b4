"""Run a function on N local processes joined in a gloo/nccl process group (tests, benches).

`torchrun` is the launcher for users; this is the fast path for parity tests and benchmarks
(mp.spawn starts a few processes in seconds on a 2-core machine). Each rank's return value
comes back to the caller; a rank's exception fails the whole call with its traceback; every
run has a deadline and the processes are killed when it passes.
"""

from __future__ import annotations

import gc
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port the OS reports free on 127.0.0.1 (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    backend: str,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            result = fn(*args)
            # Free DDP/FSDP state and let every rank finish its last collective before the
            # group goes away: tearing it down under a live reducer aborts the process.
            gc.collect()
            dist.barrier()
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        raise


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 240.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call `fn(*args)` on `world_size` fresh processes inside a process group.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of processes.
        *args: passed to `fn` on every rank.
        timeout_s: deadline for the whole run; processes are killed when it passes.
        backend: the torch.distributed backend.
        env: extra environment variables for the children (e.g. OMP_NUM_THREADS).

    Returns:
        The return values, indexed by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or the deadline passed.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    child_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} | (env or {})
    pc = mp.start_processes(
        _worker,
        args=(world_size, free_port(), fn, args, queue, backend, child_env),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while True:
            while not queue.empty():
                rank, ok, value = queue.get()
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
            if errors:
                break
            try:
                if pc.join(timeout=0.2):
                    break
            except mp.ProcessRaisedException as e:
                errors.append(str(e))
                break
            except mp.ProcessExitedException as e:
                errors.append(str(e))
                break
            if time.monotonic() > deadline:
                errors.append(f"deadline of {timeout_s:.0f}s passed")
                break
        while not queue.empty():
            rank, ok, value = queue.get()
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for proc in pc.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    if errors:
        raise RuntimeError("spawned run failed: " + "\n".join(errors))
    missing = sorted(set(range(world_size)) - set(results))
    if missing:
        raise RuntimeError(f"spawned run ended without results from ranks {missing}")
    return [results[r] for r in range(world_size)]
