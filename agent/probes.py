"""Host and GPU probes for heartbeats and the registration inventory.

Host counters come from psutil; RDMA counters from /sys/class/infiniband when present;
GPUs through nvidia-ml-py (`pynvml`) when it is installed and a driver answers. Probes
are sampled about once a second (not per heartbeat): they cost more than a heartbeat.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import psutil

from unbroken.proto import driver_pb2 as dpb

IB_ROOT = Path("/sys/class/infiniband")


def rdma_devices(root: Path = IB_ROOT) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def rdma_counters(root: Path = IB_ROOT) -> dict[str, int]:
    """`<dev>/<port>/<counter>` -> value for every readable RDMA port counter."""
    out: dict[str, int] = {}
    if not root.is_dir():
        return out
    for f in root.glob("*/ports/*/counters/*"):
        with contextlib.suppress(OSError, ValueError):
            out[f"{f.parts[-5]}/{f.parts[-3]}/{f.name}"] = int(f.read_text().strip())
    return out


class Gpus:
    """NVML access when available; every method is a cheap no-op otherwise."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
        except Exception:  # no package, no driver, no GPU: run without GPU probes
            self.nvml = None
            self.handles = []

    def inventory(self) -> list[dpb.GpuInfo]:
        out = []
        for i, h in enumerate(self.handles):
            with contextlib.suppress(Exception):
                name = self.nvml.nvmlDeviceGetName(h)
                out.append(
                    dpb.GpuInfo(
                        index=i,
                        name=name if isinstance(name, str) else name.decode(),
                        uuid=str(self.nvml.nvmlDeviceGetUUID(h)),
                        memory_total_bytes=int(self.nvml.nvmlDeviceGetMemoryInfo(h).total),
                    )
                )
        return out

    def stats(self) -> list[dpb.GpuStats]:
        out = []
        nv = self.nvml
        for i, h in enumerate(self.handles):
            g = dpb.GpuStats(index=i)
            with contextlib.suppress(Exception):
                g.utilization_percent = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                g.memory_used_bytes = int(nv.nvmlDeviceGetMemoryInfo(h).used)
            with contextlib.suppress(Exception):
                g.ecc_errors = int(
                    nv.nvmlDeviceGetTotalEccErrors(
                        h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                    )
                )
            out.append(g)
        return out


def inventory(gpus: Gpus) -> dpb.HardwareInventory:
    """What the node has, sent once at registration."""
    inv = dpb.HardwareInventory(
        cpu_count=psutil.cpu_count() or 0, memory_total_bytes=psutil.virtual_memory().total
    )
    inv.gpus.extend(gpus.inventory())
    inv.rdma_devices.extend(rdma_devices())
    return inv


def host_stats(disk_path: str = "/") -> dpb.HostStats:
    """CPU, memory, disk, network and RDMA counters right now."""
    vm = psutil.virtual_memory()
    hs = dpb.HostStats(
        cpu_percent=psutil.cpu_percent(None), mem_used_bytes=vm.used, mem_total_bytes=vm.total
    )
    with contextlib.suppress(OSError):
        du = psutil.disk_usage(disk_path)
        hs.disk_used_bytes, hs.disk_total_bytes = du.used, du.total
    net = psutil.net_io_counters()
    if net is not None:
        hs.net_bytes_sent, hs.net_bytes_recv = net.bytes_sent, net.bytes_recv
    for k, v in rdma_counters().items():
        hs.rdma_counters[k] = v
    return hs
