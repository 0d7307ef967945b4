"""Where a GPU training step loses time to a flash save every step (needs CUDA; skips without).

One rank of the gpt3d trainer (the 125m preset by default, seq 1024, one GPU, nccl) steps in
interleaved blocks of these modes, each a way to take the per-step copy of its state:

- `none`, `none_nopf`: no save, with and without the trainer prefetching its next batch
  (`GPT3DTrainer.prefetch_batches`);
- `onecopy`, `onecopy_nopf`: one plain 1 GB device-to-host copy on a side stream after every
  step (no flash machinery, no wait): what any such copy costs the step, and what the
  prefetch changes about it;
- `flash`, `flash_sync`: the trainer's snapshot save (`FlashWriter.save_async` with the
  optimizer guard) with the copies enqueued by the training thread, the manifest thread
  polling the copies' event or sitting in `cudaEventSynchronize` (`flash.CUDA_WAIT_POLL`);
- `writer`, `writer_sync`: the same with the copies enqueued by the writer's thread
  (`flash.CUDA_COPY_ON_WRITER`).

For each: the median step time (host clock, the trainer syncs on the loss every step), its
ratio to `none` in the same run, the host time after the step (the save's call), and the
step's time between two CUDA events on the training stream. A step whose host time exceeds
its device time waited on the host for something the training stream does not show.

Run: `make bench-flash_gpu_probe` (or `.venv/bin/python bench/flash_gpu_probe.py --rounds 4`),
on a machine with a GPU; writes bench/results/flash-gpu-probe.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "flash-gpu-probe.json"
MODES = (
    "none",
    "none_nopf",
    "onecopy",
    "onecopy_nopf",
    "flash",
    "flash_sync",
    "writer",
    "writer_sync",
)


def _rank(shm_root: str, preset_name: str, seq: int, rounds: int, steps: int) -> dict[str, Any]:
    import structlog

    from unbroken.recovery import cudacopy as fm
    from unbroken.recovery.flash import FlashWriter
    from unbroken.recovery.flashowner import FlashConfig, FlashOwner
    from unbroken.recovery.flashplan import Snapshot
    from unbroken.trainer.config import DataConfig, ParallelConfig, TrainConfig, preset
    from unbroken.trainer.flashckpt import KEY, flat_fresh
    from unbroken.trainer.gpt3d import GPT3DTrainer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    cfg = TrainConfig(
        model=preset(preset_name),
        parallel=ParallelConfig(dp=1),
        data=DataConfig(seq_len=seq, global_batch=8, max_corpus_bytes=1 << 20),
        steps=1 << 30,
    )
    tr = GPT3DTrainer()
    tr.setup(cfg)
    writer = FlashWriter(0, FlashOwner(FlashConfig(root=shm_root, job="probe")))
    guards = writer.guard(tr.optimizers)
    dev = next(tr.parts[0].parameters()).device
    nbytes = writer.prepare(tr.state_dict())  # the state's bytes (a slot)
    writer.wait_ring()

    def snapshot() -> Snapshot:
        return Snapshot(
            key=tr.snapshot_key(), full=lambda: {KEY: tr}, fresh=lambda: flat_fresh(tr), flat=True
        )

    for _ in range(3):
        tr.train_step()
    writer.save_async(snapshot(), tr.step, meta={"persist": False}).wait()
    src = torch.empty(nbytes // 4, device=dev)
    dst = torch.empty(nbytes // 4, pin_memory=True)
    side = torch.cuda.Stream(dev)
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    host: dict[str, list[float]] = {m: [] for m in MODES}
    gpu: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for _ in range(rounds):
            for mode in MODES:
                tr.prefetch_batches = not mode.endswith("_nopf")
                fm.CUDA_COPY_ON_WRITER = mode.startswith("writer")
                fm.CUDA_WAIT_POLL = not mode.endswith("_sync")
                events = []
                for i in range(steps + 1):
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    e0.record()
                    tr.train_step()
                    e1.record()
                    th = time.perf_counter()
                    if mode.startswith(("flash", "writer")):
                        writer.save_async(
                            snapshot(), tr.step, meta={"persist": False}, skip_if_busy=True
                        )
                    elif mode.startswith("onecopy"):
                        side.wait_stream(torch.cuda.current_stream(dev))
                        with torch.cuda.stream(side):
                            dst.copy_(src, non_blocking=True)
                    if i > 0:  # the first step of a block follows another mode's
                        end = time.perf_counter()
                        host[mode].append(end - th)
                        wall[mode].append(end - t0)
                        events.append((e0, e1))
                torch.cuda.synchronize()
                gpu[mode] += [a.elapsed_time(b) / 1e3 for a, b in events]
                tr._drop_prefetch()
    finally:
        fm.CUDA_COPY_ON_WRITER = False
        fm.CUDA_WAIT_POLL = True
        tr.prefetch_batches = None
        for g in guards:
            g.remove()
        writer.close()
        tr.close()
    base = statistics.median(wall["none"])
    return {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "state_bytes": nbytes,
        "modes": {
            m: {
                "step_s": statistics.median(wall[m]),
                "throughput_vs_none": base / statistics.median(wall[m]),
                "host_after_step_s": statistics.median(host[m]),
                "device_step_s": statistics.median(gpu[m]),
            }
            for m in MODES
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per mode and round")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("flash_gpu_probe: no CUDA GPU here, nothing measured (run it on a GPU machine)")
        return
    from unbroken.trainer.launch import spawn

    shm = tempfile.mkdtemp(prefix="ub-probe-", dir="/dev/shm")
    try:
        load = os.getloadavg()[0]
        r = spawn(
            _rank,
            1,
            shm,
            args.preset,
            args.seq,
            args.rounds,
            args.steps,
            timeout_s=900,
            backend="nccl",
        )[0]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    r |= {"preset": args.preset, "seq": args.seq, "rounds": args.rounds, "load_avg_1m": load}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(r, indent=2) + "\n")
    print(f"{r['device']}, {args.preset} seq {args.seq}, state {r['state_bytes'] / 1e9:.2f} GB")
    print("| mode | step | / none | host after the step | device step |\n|---|---|---|---|---|")
    for m, v in r["modes"].items():
        print(
            f"| {m} | {v['step_s'] * 1e3:.1f} ms | {v['throughput_vs_none']:.3f} | "
            f"{v['host_after_step_s'] * 1e3:.2f} ms | {v['device_step_s'] * 1e3:.1f} ms |"
        )


if __name__ == "__main__":
    main()
