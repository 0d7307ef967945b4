"""A new worker's first GPU calls, made on a side thread while the world is joined.

A worker process that has never used its GPU pays for it on its resume path: the CUDA
context, cuBLAS's handles and workspace, and the lazy loading of every kernel the first
time it is launched (the first matmul, norm, softmax, cross entropy, optimizer step and
host-to-device copy). On one H200 (bench/results/recovery-gpu.json, 2026-12-04), a replaced
rank's restore spent 0.5 s in its first state dict and first copy to the device where the
surviving rank spent 0.04 s, and the first step after a recovery took 0.7 s, in the
in-job mode and in a restart alike.

Much of that can overlap with what the worker waits for anyway: the rendezvous, the
process group's set-up and NCCL's communicator set-up (0.4-0.5 s at the restore's first
collective). `start` therefore runs, on a daemon thread, one forward, backward and
optimizer step of a one-block model of the job's shape (its width, heads, vocabulary,
sequence length, the compute dtype and the optimizer's kernels), and copies a buffer to
the device from pageable and from pinned memory. It is not the job's model (no FSDP, no
DTensor: those need the world), so the kernels it loads are the ones of the same ops at
the same shapes, not always the same ones.

It draws no random numbers (the model's init is a function of its seed and names, the
batch is an arange), so the worker's seeded RNG streams are those of a process that did
not run it. It runs once per process: a surviving rank that rejoins a new world has loaded
everything already. It stays off on the CPU, when a block of the job's model is larger
than `MAX_WARM_PARAMS` (then only the context, a matmul and the copies are warmed), and
when `UNBROKEN_DEVICE_WARM=0`. A failure is logged and ignored: the worker then pays the
first calls itself, as before.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import structlog

from unbroken.trainer.config import TrainConfig
from unbroken.trainer.rtrace import mark

log = structlog.get_logger()

#: Set to "0" to turn the warm-up off (bench/gpu-recovery.sh compares both).
ENV = "UNBROKEN_DEVICE_WARM"
#: A one-block model larger than this is not built (its memory is taken while the real
#: model is built beside it); the context, cuBLAS and the copies are warmed anyway.
MAX_WARM_PARAMS = 50_000_000
#: Bytes copied host to device, from pageable and from pinned memory.
COPY_BYTES = 1 << 20

_started = False


def start(config: TrainConfig, device_index: int) -> threading.Thread | None:
    """Start the warm-up of `device_index` for `config`'s job on a daemon thread (None:
    not on a GPU, turned off, or already run in this process)."""
    global _started
    if _started or os.environ.get(ENV, "1") == "0":
        return None
    import torch

    if not config.uses_cuda():
        return None
    _started = True
    device = torch.device("cuda", device_index)
    t = threading.Thread(target=_run, args=(config, device), name="unbroken-device-warm")
    t.daemon = True
    t.start()
    return t


def _run(config: TrainConfig, device: object) -> None:
    t0 = time.perf_counter()
    try:
        warm(config, device)
    except Exception as e:  # the worker then pays its first calls itself
        log.warning("device warm-up failed", error=f"{type(e).__name__}: {e}")
        return
    mark("device_warm", s=round(time.perf_counter() - t0, 4))


def warm(config: TrainConfig, device: object) -> None:
    """One step of a one-block model of the job's shape on `device`, and two copies to it
    (any device: the tests run it on the CPU)."""
    import torch

    from unbroken.trainer.init import materialize
    from unbroken.trainer.model import Transformer, cross_entropy

    dev = torch.device(str(device))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # this thread's device; the worker's own is set apart
    host = torch.empty(COPY_BYTES // 4, dtype=torch.float32)
    host.to(dev)
    if dev.type == "cuda":
        host.pin_memory().to(dev, non_blocking=True)
    c = config
    bf16 = c.dtype == "bf16" or (c.dtype == "auto" and dev.type == "cuda")
    dtype = torch.bfloat16 if bf16 else torch.float32
    block = dataclasses.replace(c.model, n_layers=1)
    seq = min(c.data.seq_len, block.max_seq_len)
    batch = max(1, c.step_batch // max(1, c.parallel.dp * c.parallel.microbatches))
    if block.n_params() > MAX_WARM_PARAMS:
        a = torch.ones((batch * seq, block.dim), device=dev, dtype=dtype, requires_grad=True)
        (a @ a.T).sum().backward()
        _sync(dev)
        return
    with torch.device("meta"):  # nn's default init would draw from the global RNG
        model = Transformer(block, seed=c.seed)
    materialize(model, dev)  # by name, from private generators
    fp32: list[torch.Tensor] = list(model.parameters())
    model_c = model.to(dtype) if dtype != torch.float32 else model
    ids = torch.arange(batch * seq, device=dev).remainder(block.vocab_size).reshape(batch, seq)
    loss = cross_entropy(model_c(ids), ids)
    loss.backward()
    if dtype != torch.float32:  # the optimizer's fp32 parameters, as FSDP keeps them
        master = [p.detach().float().requires_grad_() for p in model_c.parameters()]
        for m, p in zip(master, model_c.parameters(), strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        fp32 = master
    opt = torch.optim.AdamW(
        fp32,
        lr=c.optim.lr,
        foreach=c.optim.impl == "foreach",
        fused=True if c.optim.impl == "fused" else None,
    )
    torch.nn.utils.clip_grad_norm_(fp32, 1.0)
    opt.step()
    float(loss.detach())
    _sync(dev)


def _sync(dev: object) -> None:
    import torch

    if getattr(dev, "type", "") == "cuda":
        torch.cuda.synchronize(dev)  # type: ignore[arg-type]
