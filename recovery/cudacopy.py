"""A flash save's device-to-host copies: GPU tensors into the slots' pinned shared memory.

Each slot's mapping is registered with CUDA as pinned memory once (`CudaCopier.register`),
so the copies are asynchronous DMA on a side stream per device; the training stream waits
for them on the device (`SaveHandle.wait_copied`), and the host waits only in the writer's
thread, before the manifest (`CudaCopier.wait`). Nothing here runs without a GPU
(tests/gpu covers it).
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Mapping
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)

# Overlapped saves of GPU state: the training thread enqueues the device-to-host copies
# inside `save_async` (False), or the writer's thread does (True). bench/checkpoint.py
# measures both in one run; on an H200 (gpt3d 125m, 1 GB of state, 82 ms steps) the
# throughput with a save every step was 0.916 of none enqueued by the training thread and
# 0.875 by the writer's (bench/results/checkpoint-cuda-3.json), 0.875 and 0.863 before the
# trainer prefetched its batches (checkpoint-cuda-2.json).
CUDA_COPY_ON_WRITER = False
# The manifest waits for those copies by polling their event (True) or in
# cudaEventSynchronize (False); bench/flash_gpu_probe.py measures both.
CUDA_WAIT_POLL = True


class CudaCopier:  # pragma: no cover - needs a GPU
    """One rank's device-to-host copies into its ring's slots.

    Args:
        rank: the rank whose state this is (for the warning when pinning is refused).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.registered: set[int] = set()  # slots registered as pinned memory
        self._lock = threading.Lock()  # the ring's mapper thread registers its slots too
        self._side_streams: dict[torch.device, Any] = {}  # device -> the copies' stream

    def register(self, slot: int, buf: mmap.mmap) -> None:
        """Register the slot's whole mapping as pinned memory once (async DMA into it).

        If CUDA refuses (e.g. a locked-memory limit), the copies still work, from pageable
        memory: the driver stages them, and each blocks the host for its length.
        """
        with self._lock:
            if slot in self.registered:
                return
            ptr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
            err = torch.cuda.cudart().cudaHostRegister(ptr, len(buf), 0)
            if int(err) != 0:
                log.warning(
                    "flash.pin_failed",
                    rank=self.rank,
                    slot=slot,
                    bytes=len(buf),
                    cuda_error=int(err),
                    effect="device-to-host copies into this slot block the training thread",
                    fix="raise the locked-memory limit (ulimit -l) of the worker",
                )
                return
            self.registered.add(slot)

    def unregister(self, maps: Mapping[int, mmap.mmap]) -> None:
        """Undo `register` before the mappings go (a new mapping may reuse the range)."""
        with self._lock:
            for slot in sorted(self.registered):
                m = maps.get(slot)
                if m is not None:
                    ptr = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
                    torch.cuda.cudart().cudaHostUnregister(ptr)
            self.registered.clear()

    def copy(
        self,
        slot: int,
        buf: mmap.mmap,
        device: torch.device,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        ready: Any = None,
    ) -> Any:
        """Enqueue the copies of `srcs` on the device's side stream into the slot's pinned
        views `dsts`, after `ready` (an event the caller recorded at the save; None: after
        the work already on the calling thread's stream).

        Returns the event recorded after them: the caller's stream waits for it before it
        may change `srcs` (`SaveHandle.wait_copied`, the optimizer guard); the host waits
        only in the writer's thread, before the manifest (`wait`).
        """
        self.register(slot, buf)
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device)
        if ready is not None:
            side.wait_event(ready)
        else:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
        return event

    @staticmethod
    def wait(event: Any) -> None:
        """Block the calling thread (the writer's, before a manifest) until `event` is done.

        Polled, not `event.synchronize()`: on an H200 (bench/flash_gpu_probe.py;
        prefetched batches, one run) the 125m preset with a save every step ran at 0.929
        of no saves while the writer's thread sat in cudaEventSynchronize and at 0.963
        polling (0.939 and 0.979 with the writer's thread enqueuing).
        """
        if not CUDA_WAIT_POLL:
            event.synchronize()
        while not event.query():
            time.sleep(0.0005)

    @staticmethod
    def ready_events(sources: list[torch.Tensor]) -> dict[torch.device, Any]:
        """An event per device of `sources`, recorded on its current stream now: copies
        enqueued later (by the writer's thread) start after the work queued so far."""
        ready: dict[torch.device, Any] = {}
        for src in sources:
            if src.is_cuda and src.device not in ready:
                ready[src.device] = torch.cuda.Event()
                ready[src.device].record(torch.cuda.current_stream(src.device))
        return ready
