"""Flash checkpoint against torch.save and DCP, on the same state in the same run.

For 100 MB, 1 GB and 4 GB of float32 state this measures:
- the blocking time of a flash save (steady state, as at every step), the one-off
  `prepare` at start-up (allocating and faulting in both shared-memory slots), and the
  background finish (the manifest, not blocking; a copy is hashed only when it is
  sealed to leave the node);
- the blocking time of `torch.save` to a local-disk file, with and without fsync (a
  checkpoint that is not on disk does not survive the node), and of a DCP save
  (`dcp.save`, which fsyncs its files);
- restore from memory (checksum + copy into the model's tensors) against
  `torch.load` from disk with the file evicted from the page cache, and DCP load;
- the flash copy's bandwidth as a fraction of this machine's memcpy bandwidth;
- inside a training loop (an MLP + AdamW at 100 MB / 1 GB of state, whose forward/backward
  takes longer than the copy): step time and blocking time with no save, a synchronous
  `save`, and an overlapped `save_async` (the mode the trainer uses: the copy runs during
  the next forward/backward, the optimizer guard waits for it), against torch.save + fsync
  of the same state; `flash_vs_torch_save_ratio_1gb` comes from the overlapped mode;
- the step-time overhead of a flash save at every step on the tiny gpt3d model
  (pp1×dp2×tp1 and tp2 by default, mp.spawn + gloo), same run, modes interleaved; with
  `--device cuda` (nccl, state on the GPU) also the snapshot save with its device-to-host
  copies enqueued by the writer's thread (`flash.CUDA_COPY_ON_WRITER`) instead of the
  training thread.

Writes bench/results/checkpoint.json and prints a markdown table. Run:
`OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint.py [--sizes-mb 100 1024 4096]`
(about 12 minutes here; `--loop-sizes-mb`, `--tiny3d-layouts` select the other parts).
Cleans its shared memory and files up, also on failure.
"""

from __future__ import annotations

import argparse
import json
import logging
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
import structlog
import torch
import torch.distributed.checkpoint as dcp

from unbroken.recovery import cudacopy, flashring
from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.flashplan import Snapshot

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint.json"
TENSOR_MB = 64


def _quiet_logs() -> None:
    """No per-save debug lines (they would also cost time inside the measured loops)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


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
        # Once, at start-up. The baseline first: a worker alone on a freshly allocated
        # ring (rank 1) maps it and pays the first touch of every page (tmpfs zeroes it;
        # a VM's host backs it). Then as under an agent that knows the state's size
        # (StartWorkers.flash_bytes_per_rank): the agent allocates the ring (fallocate),
        # pre-faults it (MADV_POPULATE_WRITE in parallel chunks), and the worker maps
        # touched pages. flash_prepare_s is what the worker and the agent pay together.
        need = sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in state.values())
        owner.reserve(1, need)
        owner.grown.clear()  # not pre-faulted: the baseline
        alone = FlashWriter(1, owner)
        out["worker_prepare_unfaulted_s"] = _timed(lambda: alone.prepare(state))
        alone.wait_ring()
        out["worker_ring_ready_unfaulted_s"] = alone.ring_ready_s
        alone.close()
        owner.delete_rank(1)
        out["agent_reserve_s"] = _timed(lambda: owner.reserve(0, need))
        out["agent_prefault_s"] = owner.prefault()
        out["worker_prepare_s"] = _timed(lambda: writer.prepare(state))
        out["flash_prepare_s"] = (
            out["agent_reserve_s"] + out["agent_prefault_s"] + out["worker_prepare_s"]
        )
        out["ring_copies"] = writer.copies
        # The worker maps EAGER_SLOTS slots before its first step, the rest in the
        # background: how long the whole ring took. That first mapping touches fresh tmpfs
        # pages (zeroed at their first fault); a restarted worker maps the same, warm pages:
        # its prepare now against (the baseline, same run, alternated) mapping every slot
        # before it returns, as a restart did before.
        writer.wait_ring()
        out["worker_ring_ready_s"] = writer.ring_ready_s
        restart: dict[str, list[float]] = {"lazy": [], "all": []}
        for _ in range(3):
            for mode in ("all", "lazy"):
                again = FlashWriter(0, owner)
                saved = flashring.EAGER_SLOTS
                if mode == "all":
                    flashring.EAGER_SLOTS = 1 << 20
                try:
                    restart[mode].append(_timed(lambda w=again: w.prepare(state)))
                finally:
                    flashring.EAGER_SLOTS = saved
                    again.close()
        out["worker_restart_prepare_s"] = statistics.median(restart["lazy"])
        out["worker_restart_prepare_all_slots_s"] = statistics.median(restart["all"])
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


# ---------------------------------------------------------------- inside a training loop

LOOP_WIDTH = {100: 1024, 1024: 2048}  # hidden size of the benchmark MLP per state size
LOOP_BATCH = 64
STEPS_PER_PHASE = 3
TINY3D_STEPS_PER_PHASE = 8


def _loop_model(mb: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP whose parameters plus AdamW's two moments make `mb` MB of state."""
    width = LOOP_WIDTH.get(mb, 2048)
    per_layer = width * width * 4 * 3  # weight + exp_avg + exp_avg_sq
    layers = max(1, round(mb * (1 << 20) / per_layer))
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width, bias=False), torch.nn.Tanh()]
    model = torch.nn.Sequential(*mods).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def bench_loop(
    mb: int, shm_root: str, disk_root: Path, rounds: int, device: str = "cpu", batch: int = 0
) -> dict[str, Any]:
    """Blocking time and step time of flash saves at every step of a real training loop.

    Four modes on the same model, interleaved in rounds: no save, a synchronous `save`
    after each optimizer step, an overlapped `save_async` of the full state dict whose copy
    runs while the next step's forward/backward computes (the writer's optimizer guard
    waits for it before the next `optimizer.step`), and the same with a `Snapshot` (the
    embedded trainer's per-step path: plan and tensor references cached, only the small
    values taken; the ring never waits for the previous copy's manifest). Blocking = time inside
    the save call + time the guard waited. torch.save (+ fsync) of the same state is
    measured in the same rounds.

    On a GPU (`device="cuda"`) the state lives on the device: a save enqueues the copy
    into the pinned slot on a side stream and blocks the host for no copy; each step's
    time is taken after `torch.cuda.synchronize()`, so a copy the device did not overlap
    with the next forward and backward shows as step time. `batch` sets the step's
    compute (default: 64 on the CPU, 8192 on a GPU, where 64 would be microseconds).
    """
    dev = torch.device(device)
    batch = batch or (8192 if dev.type == "cuda" else LOOP_BATCH)
    model, opt = _loop_model(mb, dev)
    width = model[0].in_features  # type: ignore[index]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g).to(dev)
    position = {"sample_index": 0}

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        position["sample_index"] += batch

    def sync() -> None:
        # The training stream only: a device-wide synchronize would also wait for the
        # save's copy on its side stream, which the next step is meant to overlap.
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def state(step: int) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "step": step,
            "data": dict(position),
            "rng": torch.get_rng_state(),
        }

    def fresh(step: int) -> dict[str, Any]:
        return {
            "optim": {"param_groups": opt.state_dict()["param_groups"]},
            "step": step,
            "data": dict(position),
            "rng": torch.get_rng_state(),
        }

    train_step()  # materialise AdamW's state
    owner = FlashOwner(FlashConfig(root=shm_root, job=f"loop-{mb}"))
    writer = FlashWriter(0, owner)
    guards = writer.guard([opt])
    path = disk_root / f"loop-{mb}.pt"
    times: dict[str, list[float]] = {}
    blocking: dict[str, list[float]] = {"sync": [], "async": [], "snapshot": []}
    step = 0

    def torch_save(step: int) -> None:
        with open(path, "wb") as f:
            torch.save(state(step), f)
            f.flush()
            os.fsync(f.fileno())

    try:
        t_prep = time.perf_counter()
        nbytes = writer.prepare(state(0))  # on a GPU: registers the slots as pinned memory
        prepare_s = time.perf_counter() - t_prep
        for _ in range(rounds):
            for mode in ("none", "sync", "async", "snapshot"):
                handles = []
                os.sync()  # start every phase from a quiet disk
                for i in range(STEPS_PER_PHASE + 1):
                    t0 = time.perf_counter()
                    train_step()
                    step += 1
                    if mode == "sync":
                        handles.append(writer.save(state(step), step))
                    elif mode == "async":
                        handles.append(writer.save_async(state(step), step))
                    elif mode == "snapshot":
                        snap = Snapshot(
                            key=("loop", len(opt.state)),
                            full=lambda s=step: state(s),
                            fresh=lambda s=step: fresh(s),
                        )
                        h = writer.save_async(snap, step, meta={"persist": False})
                        handles.append(h)
                    sync()
                    dt = time.perf_counter() - t0
                    if i > 0:  # the first step of a phase still carries the last one's save
                        times.setdefault(mode, []).append(dt)
                # The last save's copy overlapped no step of this phase: not counted.
                for h in handles[:-1]:
                    if h is not None:  # a snapshot skipped (no free slot) blocked nothing
                        blocking[mode].append(h.blocked_s)
                if handles and handles[-1] is not None:
                    handles[-1].wait()

            times.setdefault("torch_save_fsync", []).append(_timed(lambda s=step: torch_save(s)))
    finally:
        for h in guards:
            h.remove()
        writer.close()
        owner.cleanup()
        path.unlink(missing_ok=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "writer_prepare_s": prepare_s,
        "bytes": nbytes,
        "batch": batch,
        "width": width,
        "layers": len(model) // 2,
        "step_no_save_s": med["none"],
        "step_sync_save_s": med["sync"],
        "step_async_save_s": med["async"],
        "flash_sync_blocking_s": statistics.median(blocking["sync"]),
        "flash_async_blocking_s": statistics.median(blocking["async"]),
        "flash_async_blocking_max_s": max(blocking["async"]),
        "step_snapshot_save_s": med["snapshot"],
        "flash_snapshot_blocking_s": statistics.median(blocking["snapshot"]),
        "snapshot_blocking_over_step": statistics.median(blocking["snapshot"]) / med["none"],
        "snapshot_step_overhead_s": med["snapshot"] - med["none"],
        "snapshot_skipped_busy": writer.skipped_busy,
        "async_step_overhead_s": med["async"] - med["none"],
        "sync_step_overhead_s": med["sync"] - med["none"],
        "torch_save_fsync_s": med["torch_save_fsync"],
    }


def _tiny3d_rank(
    layout: dict[str, int], shm_root: str, rounds: int, model: str = "tiny", seq_len: int = 64
) -> dict[str, Any]:
    """One rank of a gpt3d model (the tiny preset by default): step times with no / sync /
    overlapped flash saves."""
    import torch.distributed as dist

    from unbroken.trainer.config import DataConfig, ParallelConfig, TrainConfig, preset
    from unbroken.trainer.flashckpt import KEY, flat_fresh
    from unbroken.trainer.gpt3d import GPT3DTrainer

    cfg = TrainConfig(
        model=preset(model),
        parallel=ParallelConfig(**layout),
        data=DataConfig(seq_len=seq_len, global_batch=8, max_corpus_bytes=1 << 20),
        steps=1 << 30,
    )
    _quiet_logs()
    trainer = GPT3DTrainer()
    trainer.setup(cfg)
    rank = dist.get_rank()
    owner = FlashOwner(FlashConfig(root=shm_root, job="tiny3d"))
    writer = FlashWriter(rank, owner)
    guards = writer.guard(trainer.optimizers)
    times: dict[str, list[float]] = {}
    blocking: list[float] = []
    snap_blocking: list[float] = []
    writer_blocking: list[float] = []
    modes = ["none", "sync", "async", "snapshot"]
    try:
        state = trainer.state_dict()
        on_gpu = next(trainer.parts[0].parameters()).is_cuda
        if on_gpu:  # the other place to enqueue the copies (`flash.CUDA_COPY_ON_WRITER`)
            modes.append("snapshot_writer")
        nbytes = writer.prepare(state)
        del state
        writer.wait_ring()  # the whole ring mapped (and pinned on a GPU) before timing
        for _ in range(3):
            trainer.train_step()  # warm-up
        for _ in range(rounds):
            for mode in modes:
                cudacopy.CUDA_COPY_ON_WRITER = mode == "snapshot_writer"
                handles = []
                for i in range(TINY3D_STEPS_PER_PHASE + 1):
                    t0 = time.perf_counter()
                    step = int(trainer.train_step()["step"])
                    if mode == "sync":
                        handles.append(writer.save(trainer.state_dict(), step))
                    elif mode == "async":
                        handles.append(writer.save_async(trainer.state_dict(), step))
                    elif mode.startswith("snapshot"):  # what the embedded trainer does
                        snap = Snapshot(  # as trainer/flashckpt.py takes it (flat values)
                            key=trainer.snapshot_key(),
                            full=lambda: {KEY: trainer},
                            fresh=lambda: flat_fresh(trainer),
                            flat=True,
                        )
                        handles.append(
                            writer.save_async(
                                snap, step, meta={"persist": False}, skip_if_busy=True
                            )
                        )
                    if i > 0:
                        times.setdefault(mode, []).append(time.perf_counter() - t0)
                if mode != "none" and mode != "sync":
                    into = {"async": blocking, "snapshot": snap_blocking}.get(mode, writer_blocking)
                    into += [h.blocked_s for h in handles[:-1] if h is not None]
                if handles and handles[-1] is not None:
                    handles[-1].wait()
    finally:
        cudacopy.CUDA_COPY_ON_WRITER = False
        for g in guards:
            g.remove()
        writer.close()
        trainer.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    extra: dict[str, Any] = {}
    if snap_blocking:
        q = statistics.quantiles(snap_blocking, n=10)
        extra["flash_snapshot_blocking_p10_p90_s"] = [q[0], q[-1]]
    if writer_blocking:  # GPU state: the copies enqueued by the writer's thread instead
        q = statistics.quantiles(writer_blocking, n=10)
        extra |= {
            "step_snapshot_writer_save_s": med["snapshot_writer"],
            "flash_snapshot_writer_blocking_s": statistics.median(writer_blocking),
            "flash_snapshot_writer_blocking_p10_p90_s": [q[0], q[-1]],
            "snapshot_writer_throughput_vs_no_save": med["none"] / med["snapshot_writer"],
        }
    return extra | {
        "bytes_per_rank": nbytes,
        "step_no_save_s": med["none"],
        "step_sync_save_s": med["sync"],
        "step_async_save_s": med["async"],
        "flash_async_blocking_s": statistics.median(blocking),
        "async_overhead_ratio": med["async"] / med["none"],
        "sync_overhead_ratio": med["sync"] / med["none"],
        "step_snapshot_save_s": med["snapshot"],
        "flash_snapshot_blocking_s": statistics.median(snap_blocking) if snap_blocking else 0.0,
        "snapshot_overhead_ratio": med["snapshot"] / med["none"],
        "snapshot_throughput_vs_no_save": med["none"] / med["snapshot"],
        "snapshot_skipped_busy": writer.skipped_busy,
    }


def bench_tiny3d(
    layout: dict[str, int],
    shm_root: str,
    rounds: int,
    backend: str = "gloo",
    model: str = "tiny",
    seq_len: int = 64,
) -> dict[str, Any]:
    """The tiny gpt3d model on `layout` (mp.spawn, gloo; nccl on a GPU), a flash save at
    every step."""
    from unbroken.trainer.launch import spawn

    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)
    ranks = spawn(
        _tiny3d_rank,
        world,
        layout,
        shm_root,
        rounds,
        model,
        seq_len,
        timeout_s=600,
        backend=backend,
    )
    out: dict[str, Any] = {
        "layout": "pp{pp}xdp{dp}xtp{tp}".format(**({"pp": 1, "dp": 1, "tp": 1} | layout))
    }
    if model != "tiny":
        out["layout"] += f" {model} seq {seq_len}"
    out["ranks"] = world
    # Collectives keep the ranks in step; report the slowest rank's medians.
    for key in ranks[0]:
        out[key] = max(r[key] for r in ranks)
    return out


def summarize(results: dict[str, Any]) -> None:
    """Add the ratios (the README's headline figures) to `results` in place."""
    for key, r in results["sizes"].items():
        if "skipped" in r:
            continue
        tag = key.replace("1024mb", "1gb").replace("4096mb", "4gb")
        results[f"flash_sync_vs_torch_save_ratio_{tag}"] = (
            r["torch_save_fsync_s"] / r["flash_save_blocking_s"]
        )
        results[f"flash_vs_torch_save_ratio_{tag}"] = results[
            f"flash_sync_vs_torch_save_ratio_{tag}"
        ]
        results[f"flash_vs_torch_save_nofsync_ratio_{tag}"] = (
            r["torch_save_s"] / r["flash_save_blocking_s"]
        )
        results[f"flash_vs_dcp_save_ratio_{tag}"] = r["dcp_save_s"] / r["flash_save_blocking_s"]
        results[f"restore_memory_vs_disk_ratio_{tag}"] = r["restore_disk_s"] / r["restore_memory_s"]
        results[f"flash_copy_fraction_of_memcpy_{tag}"] = (
            r["flash_copy_gbps"] / results["memcpy_gbps"]
        )
        results[f"agent_reserve_s_{tag}"] = r["agent_reserve_s"]
        results[f"agent_prefault_s_{tag}"] = r.get("agent_prefault_s")
        results[f"worker_prepare_s_{tag}"] = r["worker_prepare_s"]
        if r.get("worker_prepare_unfaulted_s"):
            # the agent's pre-fault against a worker that faults its fresh ring alone
            results[f"worker_prepare_prefaulted_vs_alone_ratio_{tag}"] = (
                r["worker_prepare_s"] / r["worker_prepare_unfaulted_s"]
            )
    for key, r in results.get("loop", {}).items():
        if "skipped" in r:
            continue
        tag = key.replace("1024mb", "1gb")
        # The trainer's mode: save_async + the optimizer guard. Replaces the sync figure.
        results[f"flash_vs_torch_save_ratio_{tag}"] = (
            r["torch_save_fsync_s"] / r["flash_async_blocking_s"]
        )
        results[f"flash_async_step_overhead_ratio_{tag}"] = (
            r["step_async_save_s"] / r["step_no_save_s"]
        )
        # The flash tax (docs/checkpoints.md): the per-step save's cost on the training
        # thread (the snapshot path), in ms and as a share of the step.
        results[f"per_step_save_ms_{tag}"] = 1000.0 * r["flash_snapshot_blocking_s"]
        results[f"per_step_save_over_step_{tag}"] = r["snapshot_blocking_over_step"]
        results[f"snapshot_step_overhead_ratio_{tag}"] = (
            r["step_snapshot_save_s"] / r["step_no_save_s"]
        )
        # What training loses per save, not only what it waits for: on a loaded 2-core
        # machine the overlapped copy slows the compute it overlaps.
        added = r["async_step_overhead_s"]  # None: no step time added beyond the noise
        results[f"flash_vs_torch_save_step_overhead_ratio_{tag}"] = (
            r["torch_save_fsync_s"] / added if added > 0 else None
        )
    tiny = results.get("tiny_3d", {})
    if tiny:
        first = next(iter(tiny.values()))
        results["step_time_overhead_tiny_3d_model"] = first["async_overhead_ratio"]
        results["step_time_overhead_tiny_3d_model_layout"] = first["layout"]
        results["snapshot_throughput_vs_no_save_tiny_3d"] = first.get(
            "snapshot_throughput_vs_no_save"
        )
    results["notes"] = (
        "ratios are baseline_time / flash_time (how many times less flash blocks); "
        "flash_vs_torch_save_ratio_* is the mode the trainer uses: an overlapped save "
        "(save_async; the copy runs on a thread during the next step's forward/backward, the "
        "optimizer guard waits for it before optimizer.step), blocking = time in save_async + "
        "time waited, measured inside a training loop (loop.*) against torch.save + fsync of "
        "the same state in the same rounds; where no loop ran (4gb) it falls back to the "
        "synchronous save (flash_sync_vs_torch_save_ratio_*). *_nofsync_* without fsync; "
        "restore_disk uses torch.load with the file evicted from the page cache; "
        "step_time_overhead_tiny_3d_model = median step time with an overlapped flash save at "
        "every step / without (same run, interleaved rounds), slowest rank; "
        "flash_vs_torch_save_step_overhead_ratio_* = torch.save+fsync time / the step time an "
        "overlapped save adds (the copy competes with the compute for 2 shared cores)"
    )


def _parse_layout(name: str) -> dict[str, int]:
    """`dp2`, `tp2`, `pp2dp2` -> ParallelConfig fields."""
    import re

    parts = re.findall(r"(dp|pp|tp)(\d+)", name)
    if not parts or "".join(a + n for a, n in parts) != name:
        raise SystemExit(f"--tiny3d-layouts: cannot parse {name!r}; use e.g. dp2, tp2, pp2dp2")
    layout = {a: int(n) for a, n in parts}
    if layout.get("pp", 1) > 1:
        layout["microbatches"] = layout["pp"]
    return layout


def main() -> None:
    """Run the benchmark and write bench/results/checkpoint.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="*", default=[100, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--disk-dir", default=None, help="local-disk directory (default: a tmp dir)")
    ap.add_argument("--loop-sizes-mb", type=int, nargs="*", default=[100, 1024])
    ap.add_argument("--loop-rounds", type=int, default=3)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the training loop's state lives (cuda: copies from GPU memory)",
    )
    ap.add_argument("--loop-batch", type=int, default=0, help="0: 64 on cpu, 8192 on cuda")
    ap.add_argument(
        "--tiny3d-layouts",
        nargs="*",
        default=["dp2", "tp2"],
        help="layouts of the tiny gpt3d model, e.g. dp2 tp2 pp2 (2-4 processes)",
    )
    ap.add_argument("--tiny3d-rounds", type=int, default=3)
    ap.add_argument("--gpt3d-preset", default="tiny", help="model preset of the gpt3d part")
    ap.add_argument("--gpt3d-seq", type=int, default=64, help="sequence length of that part")
    ap.add_argument("--out", default=str(RESULTS), help="where to write the JSON results")
    args = ap.parse_args()
    _quiet_logs()
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
        results["loop"] = {}
        for mb in args.loop_sizes_mb:
            if psutil.virtual_memory().available < 5 * mb * (1 << 20):
                results["loop"][f"{mb}mb"] = {"skipped": "not enough free memory"}
                continue
            r = bench_loop(mb, shm_root, disk_root, args.loop_rounds, args.device, args.loop_batch)
            results["loop"][f"{mb}mb"] = r
            print(f"loop {mb} MB done: {json.dumps(r)}", flush=True)
        results["tiny_3d"] = {}
        for name in args.tiny3d_layouts:
            layout = _parse_layout(name)
            # On a GPU the trainer puts its state on the device (nccl; one GPU per rank).
            backend = "nccl" if args.device == "cuda" else "gloo"
            r = bench_tiny3d(
                layout, shm_root, args.tiny3d_rounds, backend, args.gpt3d_preset, args.gpt3d_seq
            )
            results["tiny_3d"][r["layout"]] = r
            print(f"tiny 3d {name} done: {json.dumps(r)}", flush=True)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)

    summarize(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def _ratio(value: float | None) -> str:
    return "no step time added" if value is None else f"{value:.1f}x"


def table(results: dict[str, Any]) -> str:
    """The markdown tables of the results."""
    rows = [
        "| state | flash save, sync (blocks) | torch.save | torch.save+fsync | DCP save | "
        "sync flash vs torch.save+fsync | restore mem | restore disk | mem vs disk | "
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
            f"{r['dcp_save_s']:.2f} s | {results[f'flash_sync_vs_torch_save_ratio_{tag}']:.1f}x | "
            f"{r['restore_memory_s']:.3f} s | {r['restore_disk_s']:.2f} s | "
            f"{results[f'restore_memory_vs_disk_ratio_{tag}']:.1f}x | "
            f"{results[f'flash_copy_fraction_of_memcpy_{tag}']:.2f} |"
        )
    rows.append(f"\nmemcpy bandwidth: {results['memcpy_gbps']:.2f} GB/s")
    loop = {k: r for k, r in results.get("loop", {}).items() if "skipped" not in r}
    if loop:
        rows += [
            "",
            "| state (MLP + AdamW) | step, no save | step + sync save | step + overlapped save "
            "| sync blocks | overlapped blocks | torch.save+fsync | "
            "**overlapped flash vs torch.save+fsync (blocking)** | same, by step time added |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, r in loop.items():
            tag = key.replace("1024mb", "1gb")
            rows.append(
                f"| {r['bytes'] / 1e9:.2f} GB | {r['step_no_save_s']:.3f} s | "
                f"{r['step_sync_save_s']:.3f} s | {r['step_async_save_s']:.3f} s | "
                f"{r['flash_sync_blocking_s'] * 1e3:.1f} ms | "
                f"{r['flash_async_blocking_s'] * 1e3:.1f} ms | {r['torch_save_fsync_s']:.2f} s | "
                f"**{results[f'flash_vs_torch_save_ratio_{tag}']:.0f}x** | "
                f"{_ratio(results[f'flash_vs_torch_save_step_overhead_ratio_{tag}'])} |"
            )
    if loop:
        rows += [
            "",
            "| state (MLP + AdamW) | per-step save (snapshot), on the training thread | "
            "/ step | step + snapshot save / step | saves skipped (ring busy) |",
            "|---|---|---|---|---|",
        ]
        for r in loop.values():
            rows.append(
                f"| {r['bytes'] / 1e9:.2f} GB | {r['flash_snapshot_blocking_s'] * 1e3:.2f} ms | "
                f"{r['snapshot_blocking_over_step']:.4f} | "
                f"{r['step_snapshot_save_s'] / r['step_no_save_s']:.3f} | "
                f"{r['snapshot_skipped_busy']} |"
            )
    prep = {k: r for k, r in results["sizes"].items() if "agent_reserve_s" in r}
    if prep:
        rows += [
            "",
            "| state | agent: allocate the ring | agent: pre-fault it | worker prepare (2 "
            "slots mapped) after the pre-fault | the same, a worker alone on a fresh ring "
            "(before) | the rest of the ring, in the background: pre-faulted / alone | a "
            "restart's prepare | the same, mapping every slot first | copies |",
        ]
        rows.append("|---|---|---|---|---|---|---|---|---|")

        def sec(v: float | None) -> str:
            return f"{v:.3f} s" if v is not None else "-"

        for r in prep.values():
            rows.append(
                f"| {r['bytes'] / 1e9:.2f} GB | {r['agent_reserve_s']:.3f} s | "
                f"{sec(r.get('agent_prefault_s'))} | {r['worker_prepare_s']:.3f} s | "
                f"{sec(r.get('worker_prepare_unfaulted_s'))} | "
                f"{sec(r.get('worker_ring_ready_s'))} / "
                f"{sec(r.get('worker_ring_ready_unfaulted_s'))} | "
                f"{sec(r.get('worker_restart_prepare_s'))} | "
                f"{sec(r.get('worker_restart_prepare_all_slots_s'))} | {r['ring_copies']} |"
            )
    tiny = results.get("tiny_3d", {})
    if tiny:
        rows += [
            "",
            "| tiny gpt3d | state/rank | step, no save | step + sync save | "
            "step + overlapped save | overlapped blocks | overhead (overlapped) | "
            "step + snapshot save (the trainer's) | snapshot blocks | "
            "**throughput, snapshot every step / none** |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in tiny.items():
            rows.append(
                f"| {name} | {r['bytes_per_rank'] / 1e6:.1f} MB | "
                f"{r['step_no_save_s'] * 1e3:.1f} ms | "
                f"{r['step_sync_save_s'] * 1e3:.1f} ms | {r['step_async_save_s'] * 1e3:.1f} ms | "
                f"{r['flash_async_blocking_s'] * 1e3:.1f} ms | "
                f"{(r['async_overhead_ratio'] - 1) * 100:+.0f} % | "
                f"{r.get('step_snapshot_save_s', 0) * 1e3:.1f} ms | "
                f"{r.get('flash_snapshot_blocking_s', 0) * 1e3:.2f} ms | "
                f"**{r.get('snapshot_throughput_vs_no_save', 0):.3f}** |"
            )
        for name, r in tiny.items():
            if "flash_snapshot_writer_blocking_s" not in r:
                continue

            def spread(key: str, r: dict[str, Any] = r) -> str:
                lo, hi = r[key]
                return f"p10-p90 {lo * 1e3:.2f}-{hi * 1e3:.2f} ms"

            rows.append(
                f"\n{name}, GPU state, same run: the snapshot save with the copies enqueued by "
                f"the training thread blocks {r['flash_snapshot_blocking_s'] * 1e3:.2f} ms "
                f"({spread('flash_snapshot_blocking_p10_p90_s')}), throughput "
                f"{r['snapshot_throughput_vs_no_save']:.3f}; enqueued by the writer's thread "
                f"(`flash.CUDA_COPY_ON_WRITER`) it blocks "
                f"{r['flash_snapshot_writer_blocking_s'] * 1e3:.2f} ms "
                f"({spread('flash_snapshot_writer_blocking_p10_p90_s')}), throughput "
                f"{r['snapshot_writer_throughput_vs_no_save']:.3f}"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
