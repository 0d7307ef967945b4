"""The check workload: one member of a group check, run as its own process.

``python -m unbroken.diagnostics.check --spec '<json>'`` is what a node agent runs when
the driver sends "run check". All members of a group start with the same spec except
``node_id`` and ``rank``; group rank 0 hosts the rendezvous (a TCPStore) at
``store_host:store_port``. Each member then:

1. joins the group (gloo on CPU, NCCL on a GPU);
2. multiplies two matrices ``matmul_iters`` times and checks every result against the
   expected checksum. The inputs are small integers drawn from ``seed``, so in float32
   (TF32 off) every product is exact on every device and BLAS, and the expected row sums
   come from an exact int64 matrix-vector product: a silently corrupt device is caught
   by a wrong number, not a tolerance. NaN/inf anywhere is its own failure;
3. all-gathers a known pattern (``allgather_iters`` times) and checks every chunk;
4. prints ONE JSON result line on stdout and exits 0. The exit code is non-zero only
   for bad usage (2: unparsable or invalid spec). A watchdog prints a ``timeout`` result
   and exits when ``timeout_s`` (counted from process start, so it covers the import of
   torch and the rendezvous) passes, or ``phase_timeout_s`` after every member arrived.

Times are *device* times: CPU time of the process on CPU, synchronized time on a GPU.
Checks sharing a machine's cores (tests, the bench) then make each other look slow far
less than in wall time (caches and hyperthread siblings still add noise); a slow device
still looks slow, because it needs more device time for the same work.

Spec (JSON object; ``CheckSpec`` in unbroken.diagnostics.schema):

=================  ========  =============================================================
check_id           str       unique id of this group check (same for all members)
node_id            str       this member's node id
group              [str]     the group's node ids in rank order
rank               int       index of node_id in group; rank 0 hosts the store
store_host         str       where rank 0's TCPStore listens (rank 0's address)
store_port         int       its port
timeout_s          float     whole-check deadline from process start (default 60)
phase_timeout_s    float     once all members have arrived, the rest (group setup,
                             matmul, all-gather) must finish within this; 0 = no extra
                             limit (default). Start-up can be slow (torch import, a busy
                             node), a hung collective should still be caught in seconds
matmul_n           int       matrix size; 0 = sized to the device (768 CPU, 8192 GPU)
matmul_iters       int       timed matmuls (default 16)
allgather_numel    int       int64 elements each member contributes (default 65536)
allgather_iters    int       timed all-gathers (default 4)
seed               int       input seed (default 0)
device             str       "auto" (default), "cpu" or "cuda"
fault              str       optional simulated fault (unbroken.common.faults);
                             absent from specs the driver sends, so an agent started with
                             ``--inject-fault`` adds its own
=================  ========  =============================================================

Result (one JSON object; ``CheckResult``): ``schema`` (1), ``check_id``, ``node_id``,
``rank``, ``group``, ``ok``, ``failure`` ("" | "matmul" | "nan" | "allgather" |
"timeout" | "rendezvous" | "error"), ``detail`` (human-readable), ``device``,
``backend``, ``fault``, ``rendezvous_ms``, ``matmul_ms`` (median device ms per matmul),
``matmul_wall_ms``, ``matmul_samples_ms``, ``matmul_tflops``, ``allgather_ms`` (median),
``allgather_samples_ms``, ``total_ms``.

``run_group_local`` runs a whole group as local processes (tests, the bench, and the
local ``run_group`` of unbroken.diagnostics.runner).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from unbroken.common import aio
from unbroken.common.faults import FaultSpec
from unbroken.diagnostics.schema import CheckResult, CheckSpec

EXIT_OK, EXIT_USAGE = 0, 2
CPU_MATMUL_N, GPU_MATMUL_N = 768, 8192
_PATTERN_MUL = 1_000_003


class _Emitter:
    """Prints exactly one result line, whether the check or the watchdog gets there first."""

    def __init__(self, spec: CheckSpec, t0: float) -> None:
        self._lock = threading.Lock()
        self._done = False
        self.t0 = t0
        self.deadline = t0 + spec.timeout_s  # monotonic; only ever moves earlier
        self.phase = "start"
        self.partial = CheckResult.missing(spec, "")
        self.partial.failure = ""

    def emit(self, result: CheckResult) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
            result.total_ms = (time.monotonic() - self.t0) * 1e3
            sys.stdout.write(result.to_json() + "\n")
            sys.stdout.flush()
            return True

    def watch(self) -> None:
        """Watchdog thread body: at the deadline, print a timeout result and exit."""
        while (left := self.deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
        r = self.partial
        r.ok, r.failure = False, "timeout"
        r.detail = f"deadline passed in phase {self.phase!r}"
        if self.emit(r):
            os._exit(EXIT_OK)


def _classify(exc: BaseException) -> str:
    text = str(exc).lower()
    return "timeout" if ("timed out" in text or "timeout" in text) else "allgather"


def _device_clock(device: str) -> Callable[[], float]:
    import torch

    if device == "cuda":

        def gpu_clock() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return gpu_clock
    return time.process_time


def _matmul_phase(spec: CheckSpec, fault: FaultSpec, device: str, r: CheckResult) -> None:
    import torch

    n = spec.matmul_n or (GPU_MATMUL_N if device == "cuda" else CPU_MATMUL_N)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(spec.seed)
    a = torch.randint(-2, 3, (n, n), generator=gen, dtype=torch.int64)
    b = torch.randint(-2, 3, (n, n), generator=gen, dtype=torch.int64)
    expected = (a @ b.sum(dim=1)).to(torch.float64)
    af, bf = a.to(device, torch.float32), b.to(device, torch.float32)
    m = max(8, n // 4)  # the spin matmul of a slow fault: 1/64 of the work, fine-grained
    sa, sb = af[:m, :m].contiguous(), bf[:m, :m].contiguous()
    clock = _device_clock(device)
    dev_ms: list[float] = []
    wall_ms: list[float] = []
    torch.mm(af, bf)  # warm-up: first-touch and kernel selection are not the device's speed
    torch.mm(sa, sb)
    for _ in range(spec.matmul_iters):
        w0, d0 = time.perf_counter(), clock()
        c = af @ bf
        if fault.wrong_matmul:
            c[0, 0] += 1.0
        if fault.nan:
            c[n // 2, n // 3] = float("nan")
        d1 = clock()
        if fault.slow_factor > 1.0:
            extra = (fault.slow_factor - 1.0) * (d1 - d0)
            while clock() - d1 < extra:
                torch.mm(sa, sb)
        dev_ms.append((clock() - d0) * 1e3)
        wall_ms.append((time.perf_counter() - w0) * 1e3)
        if not bool(torch.isfinite(c).all()):
            r.ok, r.failure = False, "nan"
            r.detail = "matmul result holds NaN/inf"
            break
        rows = c.to(torch.float64).sum(dim=1).cpu()
        wrong = (rows != expected).nonzero().flatten()
        if wrong.numel():
            r.ok, r.failure = False, "matmul"
            r.detail = f"matmul checksum wrong in {wrong.numel()} of {n} rows (first {wrong[0]})"
            break
    r.matmul_samples_ms = [round(x, 4) for x in dev_ms]
    r.matmul_ms = statistics.median(dev_ms)
    r.matmul_wall_ms = statistics.median(wall_ms)
    r.matmul_tflops = 2.0 * n**3 / (r.matmul_ms * 1e-3) / 1e12 if r.matmul_ms > 0 else 0.0


def _pattern(rank: int, numel: int) -> Any:
    import torch

    return torch.arange(numel, dtype=torch.int64) * _PATTERN_MUL + rank


def _allgather_phase(
    spec: CheckSpec, fault: FaultSpec, device: str, r: CheckResult, deadline: float
) -> None:
    import torch
    import torch.distributed as dist

    world = len(spec.group)
    numel = max(1, spec.allgather_numel)
    mine = _pattern(spec.rank, numel)
    if fault.wrong_allgather:
        mine[numel // 2] += 1
    mine = mine.to(device)
    if fault.hang_allgather:
        time.sleep(max(0.0, deadline - time.monotonic()) + 30.0)  # the watchdog ends us
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.barrier()
    samples: list[float] = []
    for _ in range(spec.allgather_iters):
        t = time.perf_counter()
        dist.all_gather(out, mine)
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e3)
    r.allgather_samples_ms = [round(x, 4) for x in samples]
    r.allgather_ms = statistics.median(samples)
    bad = [i for i in range(world) if not torch.equal(out[i].cpu(), _pattern(i, numel))]
    if bad and r.ok:
        r.ok, r.failure = False, "allgather"
        r.detail = f"all-gather chunks of ranks {bad} were wrong"


def run_check(
    spec: CheckSpec, *, t0: float | None = None, emitter: _Emitter | None = None
) -> CheckResult:
    """Run one member of a group check in this process and return its result.

    Args:
        spec: the validated spec.
        t0: monotonic start time the deadline counts from (default: now).
        emitter: the watchdog-side holder of the partial result (used by ``main``).

    Returns:
        The result; failures are reported in it, never raised.
    """
    t0 = time.monotonic() if t0 is None else t0
    em = emitter or _Emitter(spec, t0)
    deadline = em.deadline
    r = em.partial
    r.ok, r.failure, r.detail = True, "", ""
    fault = FaultSpec.parse(spec.fault)
    r.fault = str(fault)

    import torch
    import torch.distributed as dist

    device = spec.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
    r.device = device if device == "cpu" else torch.cuda.get_device_name(0)
    r.backend = "nccl" if device == "cuda" else "gloo"
    world = len(spec.group)

    em.phase = "rendezvous"
    t = time.monotonic()
    try:
        store = dist.TCPStore(
            spec.store_host,
            spec.store_port,
            world_size=world,
            is_master=spec.rank == 0,
            timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
        )
        # Everyone arrives (however long their start-up took) before the phase clock runs.
        store.set(f"arrived/{spec.rank}", "1")
        store.wait(
            [f"arrived/{i}" for i in range(world)],
            timedelta(seconds=max(1.0, deadline - time.monotonic())),
        )
        if spec.phase_timeout_s:
            deadline = em.deadline = min(deadline, time.monotonic() + spec.phase_timeout_s)
        pg_timeout = timedelta(seconds=max(1.0, deadline - time.monotonic() - 1.0))
        dist.init_process_group(
            r.backend, store=store, rank=spec.rank, world_size=world, timeout=pg_timeout
        )
        dist.barrier()
    except Exception as e:  # a peer never came, or the store was unreachable
        r.ok, r.failure, r.detail = False, "rendezvous", f"rendezvous failed: {e}"[:500]
        return r
    r.rendezvous_ms = (time.monotonic() - t) * 1e3

    try:
        em.phase = "matmul"
        _matmul_phase(spec, fault, device, r)
        em.phase = "allgather"
        _allgather_phase(spec, fault, device, r, deadline)
    except Exception as e:  # a collective timed out or a peer vanished
        if r.ok:
            r.ok, r.failure = False, _classify(e)
            r.detail = f"{em.phase} failed: {e}"[:500]
    em.phase = "finish"
    # Rank 0 hosts the store: let the others finish with it before this process exits.
    with contextlib.suppress(Exception):
        store.set(f"done/{spec.rank}", "1")
        if spec.rank == 0:
            left = max(0.1, min(5.0, deadline - time.monotonic()))
            store.wait([f"done/{i}" for i in range(world)], timedelta(seconds=left))
    return r


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``--spec``, run the check, print one JSON line. Returns the exit code."""
    t0 = time.monotonic()
    parser = argparse.ArgumentParser(
        prog="python -m unbroken.diagnostics.check",
        description="Run one member of a diagnostic group check and print one JSON line.",
    )
    parser.add_argument("--spec", required=True, help="the check spec as a JSON object")
    args = parser.parse_args(argv)
    try:
        spec = CheckSpec.from_json(args.spec)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    em = _Emitter(spec, t0)
    threading.Thread(target=em.watch, name="check-watchdog", daemon=True).start()
    try:
        result = run_check(spec, t0=t0, emitter=em)
    except Exception as e:
        result = em.partial
        result.ok, result.failure, result.detail = False, "error", f"{type(e).__name__}: {e}"[:500]
    em.emit(result)
    return EXIT_OK


# ---------------------------------------------------------------- local groups


_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=256)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to port 0 and read it back), never one
    handed out recently by this process: the groups of a round ask one after another,
    before any of their stores has bound its port."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
            return port
    raise RuntimeError("no fresh free port after 64 tries")


def group_specs(
    check_id: str,
    group: Sequence[str],
    *,
    store_host: str = "127.0.0.1",
    store_port: int,
    faults: Mapping[str, str] | None = None,
    **options: Any,
) -> list[CheckSpec]:
    """One spec per member of ``group`` (options are CheckSpec fields)."""
    faults = faults or {}
    return [
        CheckSpec(
            check_id=check_id,
            node_id=node,
            group=list(group),
            rank=rank,
            store_host=store_host,
            store_port=store_port,
            fault=faults.get(node, ""),
            **options,
        )
        for rank, node in enumerate(group)
    ]


async def run_spec_process(
    spec: CheckSpec, *, python: str = sys.executable, grace_s: float = 10.0
) -> CheckResult:
    """Run one member as a child process; a member that prints nothing is ``missing``."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = await asyncio.create_subprocess_exec(
        python,
        "-m",
        "unbroken.diagnostics.check",
        "--spec",
        spec.to_json(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await aio.communicate(proc, None, spec.timeout_s + grace_s)
    except TimeoutError:  # (killed and reaped)
        return CheckResult.missing(spec, f"process still running {grace_s:g}s after its deadline")
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.startswith("{")]
    if not lines:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        return CheckResult.missing(spec, f"exit {proc.returncode}, no result; stderr: {tail}")
    return CheckResult.from_json(lines[-1])


async def run_group_local(
    check_id: str,
    group: Sequence[str],
    *,
    faults: Mapping[str, str] | None = None,
    python: str = sys.executable,
    **options: Any,
) -> dict[str, CheckResult]:
    """Run a whole group check as local processes on loopback and collect the results.

    Args:
        check_id: the check's id.
        group: node ids in rank order (each becomes one process).
        faults: node id -> fault spec for the members that simulate one.
        python: the interpreter to run the members with.
        **options: further CheckSpec fields (timeout_s, matmul_n, ...).

    Returns:
        node id -> its result.
    """
    specs = group_specs(check_id, group, store_port=free_port(), faults=faults, **options)
    results = await asyncio.gather(*(run_spec_process(s, python=python) for s in specs))
    return {s.node_id: r for s, r in zip(specs, results, strict=True)}


#: What a warm check process prints once torch is imported and it waits for its spec.
WARM_READY = "unbroken-check: warm"
#: A warm process's stdin line `{"selfcheck_argv": [...]}` runs the node self-checks
#: (`python -m unbroken.diagnostics.selfcheck` with those flags) instead of a check.
WARM_SELFCHECK_KEY = "selfcheck_argv"


def warm_main() -> int:
    """`--warm`: import torch now, print `WARM_READY`, then read one line on stdin: a check
    spec (JSON), run as `--spec` would, or a `WARM_SELFCHECK_KEY` object, the self-checks.
    The agent keeps one such process per node so a diagnosis or an on-demand self-check
    does not pay torch's import (4-5 s on a loaded node); an empty stdin (the agent closed
    it) exits."""
    import json

    import torch
    import torch.distributed

    del torch
    print(WARM_READY, flush=True)
    line = sys.stdin.readline().strip()
    if not line:
        return EXIT_OK
    with contextlib.suppress(ValueError):
        req = json.loads(line)
        if isinstance(req, dict) and isinstance(req.get(WARM_SELFCHECK_KEY), list):
            from unbroken.diagnostics import selfcheck

            return selfcheck.main([str(a) for a in req[WARM_SELFCHECK_KEY]])
    return main(["--spec", line])


if __name__ == "__main__":
    code = warm_main() if sys.argv[1:] == ["--warm"] else main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: gloo threads can block it after a failure
