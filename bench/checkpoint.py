"""Flash checkpoint against torch.save and DCP, on the same state in the same run.

For 100 MB, 1 GB and 4 GB of float32 state this measures:
- the blocking time of a flash save (steady state, as at every step), the one-off
  `prepare` at start-up (allocating and faulting in both shared-memory slots), and the
  background finish (checksum + manifest, not blocking);
- the blocking time of `torch.save` to a local-disk file, with and without fsync (a
  checkpoint that is not on disk does not survive the node), and of a DCP save
  (`dcp.save`, which fsyncs its files);
- restore from memory (verify checksum + copy into the model's tensors) against
  `torch.load` from disk with the file evicted from the page cache, and DCP load;
- the flash copy's bandwidth as a fraction of this machine's memcpy bandwidth.

Writes bench/results/checkpoint.json and prints a markdown table. Run:
`OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint.py [--sizes-mb 100 1024 4096]`.
Cleans its shared memory and files up, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed.checkpoint as dcp

from unbroken.recovery.flash import FlashConfig, FlashOwner, FlashWriter

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint.json"
TENSOR_MB = 64


def _state(total_mb: int) -> dict[str, torch.Tensor]:
    n = max(1, total_mb // TENSOR_MB)
    per = total_mb * (1 << 20) // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(per, generator=g) for i in range(n)}


def _evict(path: Path) -> None:
    for p in [path] if path.is_file() else list(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _memcpy_gbps(nbytes: int) -> float:
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)  # fault the pages in
    best = min(_timed(lambda: b.copy_(a)) for _ in range(3))
    return nbytes / best / 1e9


def _timed(fn: Any) -> float:
    # Start every timed operation from a quiet disk: without this, the writeback of the
    # previous method's gigabytes competes for memory bandwidth with the next one.
    os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_size(mb: int, shm_root: str, disk_root: Path, repeats: int) -> dict[str, float]:
    """Every method on the same state; rounds interleave the methods so that a change in
    the machine's load (it is shared) hits them alike. Medians over the rounds."""
    state = _state(mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, float] = {"bytes": nbytes}
    path = disk_root / f"torch-{mb}.pt"
    owner = FlashOwner(FlashConfig(root=shm_root, job=f"bench-{mb}"))
    writer = FlashWriter(0, owner)

    def torch_save(sync: bool) -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def torch_restore() -> None:
        # Like the flash restore: into the live tensors.
        loaded = torch.load(path, weights_only=True)
        for k, v in loaded.items():
            state[k].copy_(v)

    t: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        t.setdefault(key, []).append(value)

    try:
        out["flash_prepare_s"] = _timed(lambda: writer.prepare(state))  # once, at start-up
        h = writer.save(state, 0)
        assert h is not None
        out["flash_first_save_s"] = h.blocked_s
        h.wait()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            for step in range(1, repeats + 1):
                t0 = time.perf_counter()
                h = writer.save(state, step)
                assert h is not None
                add("flash_save_blocking_s", h.blocked_s)
                h.wait()
                add("flash_background_finish_s", time.perf_counter() - t0 - h.blocked_s)
                add("torch_save_s", _timed(lambda: torch_save(False)))
                add("torch_save_fsync_s", _timed(lambda: torch_save(True)))
                d = disk_root / f"dcp-{mb}-{step}"
                add(
                    "dcp_save_s", _timed(lambda d=d: dcp.save(state, checkpoint_id=d, no_dist=True))
                )
                add("restore_memory_s", _timed(lambda: writer.load(state)))
                _evict(path)
                add("restore_disk_s", _timed(torch_restore))
                _evict(d)
                add(
                    "restore_dcp_s",
                    _timed(lambda d=d: dcp.load(state, checkpoint_id=d, no_dist=True)),
                )
                shutil.rmtree(d)
    finally:
        writer.close()
        owner.cleanup()
        path.unlink(missing_ok=True)
    for key, values in t.items():
        out[key] = statistics.median(values)
    out["flash_copy_gbps"] = nbytes / out["flash_save_blocking_s"] / 1e9
    return out


def main() -> None:
    """Run the benchmark and write bench/results/checkpoint.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--disk-dir", default=None, help="local-disk directory (default: a tmp dir)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # A SIGTERM must still run the clean-up below (gigabytes of /dev/shm).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    shm_root = tempfile.mkdtemp(prefix="ub-bench-", dir="/dev/shm")
    disk_root = Path(tempfile.mkdtemp(prefix="ub-bench-", dir=args.disk_dir))
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_avg_1m_at_start": os.getloadavg()[0],
        },
        "memcpy_gbps": _memcpy_gbps(1 << 30),
        "sizes": {},
    }
    try:
        for mb in args.sizes_mb:
            need = 4 * mb * (1 << 20)  # state + 2 slots + a loaded copy
            if psutil.virtual_memory().available < need:
                results["sizes"][f"{mb}mb"] = {"skipped": "not enough free memory"}
                continue
            repeats = args.repeats if mb <= 1024 else max(1, args.repeats - 2)
            r = bench_size(mb, shm_root, disk_root, repeats)
            results["sizes"][f"{mb}mb"] = r
            print(f"{mb} MB done: {json.dumps(r)}", flush=True)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)

    for key, r in results["sizes"].items():
        if "skipped" in r:
            continue
        tag = key.replace("1024mb", "1gb").replace("4096mb", "4gb")
        results[f"flash_vs_torch_save_ratio_{tag}"] = (
            r["torch_save_fsync_s"] / r["flash_save_blocking_s"]
        )
        results[f"flash_vs_torch_save_nofsync_ratio_{tag}"] = (
            r["torch_save_s"] / r["flash_save_blocking_s"]
        )
        results[f"flash_vs_dcp_save_ratio_{tag}"] = r["dcp_save_s"] / r["flash_save_blocking_s"]
        results[f"restore_memory_vs_disk_ratio_{tag}"] = r["restore_disk_s"] / r["restore_memory_s"]
        results[f"flash_copy_fraction_of_memcpy_{tag}"] = (
            r["flash_copy_gbps"] / results["memcpy_gbps"]
        )
    results["step_time_overhead_tiny_3d_model"] = "TODO: needs the 3D trainer (issue 4)"
    results["notes"] = (
        "ratios are baseline_time / flash_time (how many times less flash blocks); "
        "flash_vs_torch_save_ratio_* uses torch.save + fsync, *_nofsync_* without fsync; "
        "restore_disk uses torch.load with the file evicted from the page cache"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def table(results: dict[str, Any]) -> str:
    """The markdown table of the results."""
    rows = [
        "| state | flash save (blocks) | torch.save | torch.save+fsync | DCP save | "
        "flash vs torch.save+fsync | restore mem | restore disk | mem vs disk | "
        "flash copy / memcpy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results["sizes"].items():
        if "skipped" in r:
            rows.append(f"| {key} | skipped: {r['skipped']} |" + " |" * 8)
            continue
        tag = key.replace("1024mb", "1gb").replace("4096mb", "4gb")
        rows.append(
            f"| {r['bytes'] / 1e9:.2f} GB | {r['flash_save_blocking_s']:.3f} s | "
            f"{r['torch_save_s']:.2f} s | {r['torch_save_fsync_s']:.2f} s | "
            f"{r['dcp_save_s']:.2f} s | {results[f'flash_vs_torch_save_ratio_{tag}']:.1f}x | "
            f"{r['restore_memory_s']:.3f} s | {r['restore_disk_s']:.2f} s | "
            f"{results[f'restore_memory_vs_disk_ratio_{tag}']:.1f}x | "
            f"{results[f'flash_copy_fraction_of_memcpy_{tag}']:.2f} |"
        )
    rows.append(f"\nmemcpy bandwidth: {results['memcpy_gbps']:.2f} GB/s")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
