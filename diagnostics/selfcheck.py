"""Node self-checks that need no peer, reported at registration and on demand.

* ``matmul``: a small matmul with an exactly known checksum on every device (the same
  exact-integer scheme as the group check), which catches silently corrupt devices.
* ``gpu_memory``: a device with >= 30 % of its memory already in use is failed (a
  leftover process would make the job run out of memory; DLRover uses the same limit).
* ``mig``: MIG mode enabled splits a GPU into slices the job does not expect (OPT-175B
  met one).
* ``ecc``: volatile uncorrected ECC errors, and retired/remapped memory rows pending.
* ``disk``: free space where checkpoints are persisted.

GPU checks use nvidia-ml-py (``pip install unbroken[gpu]``); without it or without a GPU
they are reported as skipped, not failed. Xid errors have no NVML counter: the agent's
log scanner reports them (LogAlert) from the kernel log.

``python -m unbroken.diagnostics.selfcheck [--node-id N] [--fault SPEC]`` runs them and
prints the report as one JSON line (exit 0 when every check passed, 1 otherwise). The agent
runs it that way, as a child process, so the agent itself never imports torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from unbroken.proto import events_pb2 as ev

#: The names of the items these checks report (`CheckItem.name`, the part of a failure
#: before ":"), GPU items without their ``[i]`` index. A crashed group of checks is failed
#: under its group's name ("matmul", "disk", "gpu") with a "check crashed: ..." detail.
ITEM_NAMES = frozenset({"matmul", "disk", "gpu_memory", "mig", "ecc"})
CRASHED = "check crashed"  # the detail of a check that raised instead of reporting


def failure_item(failure: str) -> tuple[str, str]:
    """(item name without its ``[i]`` index, detail) of one ``"name: detail"`` failure.

    ``"ecc[0]: 3 uncorrected ECC errors, ..."`` gives ``("ecc", "3 uncorrected ...")``.
    """
    name, _, detail = failure.partition(":")
    return name.strip().split("[", 1)[0], detail.strip()


@dataclass(kw_only=True, slots=True)
class SelfCheckConfig:
    """Limits of the self-checks.

    Attributes:
        max_gpu_memory_used: fraction of device memory already in use that fails a GPU.
        min_free_disk_gb: free space needed at ``disk_path``.
        disk_path: where checkpoints are persisted.
        matmul_n: size of the checksum matmul.
    """

    max_gpu_memory_used: float = 0.30
    min_free_disk_gb: float = 10.0
    disk_path: str = "/"
    matmul_n: int = 256

    def __post_init__(self) -> None:
        if not 0 < self.max_gpu_memory_used <= 1:
            raise ValueError(
                f"max_gpu_memory_used must be in (0, 1], got {self.max_gpu_memory_used}"
            )
        if self.min_free_disk_gb < 0:
            raise ValueError(f"min_free_disk_gb must be >= 0, got {self.min_free_disk_gb}")
        if self.matmul_n < 1:
            raise ValueError(f"matmul_n must be >= 1, got {self.matmul_n}")


@dataclass(kw_only=True, slots=True)
class CheckItem:
    """One self-check: passed, failed or skipped (not applicable here), and why."""

    name: str
    ok: bool
    skipped: bool = False
    detail: str = ""


@dataclass(kw_only=True, slots=True)
class SelfCheckReport:
    """All self-checks of one node."""

    node_id: str
    items: list[CheckItem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped ones do not count)."""
        return all(i.ok for i in self.items)

    @property
    def failures(self) -> list[str]:
        """``"name: detail"`` of every failed check."""
        return [f"{i.name}: {i.detail}" for i in self.items if not i.ok]

    def to_event(self) -> ev.SelfCheckReported:
        """The SelfCheckReported event payload."""
        return ev.SelfCheckReported(
            node_id=self.node_id,
            ok=self.ok,
            failures=self.failures,
            details_json=json.dumps([asdict(i) for i in self.items]),
        )

    def to_json(self) -> str:
        """One JSON line: node_id, ok, failures and every item."""
        return json.dumps(
            {
                "node_id": self.node_id,
                "ok": self.ok,
                "failures": self.failures,
                "items": [asdict(i) for i in self.items],
            }
        )


def check_matmul(n: int = 256, *, fault: str = "") -> CheckItem:
    """Multiply small-integer matrices on each device and compare exact row sums."""
    import torch

    from unbroken.common.faults import FaultSpec

    f = FaultSpec.parse(fault)
    gen = torch.Generator().manual_seed(1234)
    a = torch.randint(-2, 3, (n, n), generator=gen, dtype=torch.int64)
    b = torch.randint(-2, 3, (n, n), generator=gen, dtype=torch.int64)
    expected = (a @ b.sum(dim=1)).to(torch.float64)
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    bad: list[str] = []
    for dev in devices:
        c = a.to(dev, torch.float32) @ b.to(dev, torch.float32)
        if f.wrong_matmul:
            c[0, 0] += 1.0
        if f.nan:
            c[0, 0] = float("nan")
        rows = c.to(torch.float64).sum(dim=1).cpu()
        if not bool(torch.isfinite(rows).all()) or not torch.equal(rows, expected):
            bad.append(dev)
    if bad:
        return CheckItem(name="matmul", ok=False, detail=f"wrong matmul result on {bad}")
    return CheckItem(name="matmul", ok=True, detail=f"exact on {devices}")


def check_disk(path: str, min_free_gb: float) -> CheckItem:
    """Free space at ``path`` is at least ``min_free_gb``."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    free_gb = shutil.disk_usage(p).free / 1e9
    ok = free_gb >= min_free_gb
    detail = f"{free_gb:.1f} GB free at {p} (need {min_free_gb:g})"
    return CheckItem(name="disk", ok=ok, detail=detail)


def _nvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU
        return None
    return pynvml


def check_gpus(max_used: float) -> list[CheckItem]:
    """Memory in use, MIG mode and ECC counters of every GPU, via NVML."""
    nv = _nvml()
    if nv is None:
        why = "no NVML (no GPU, or nvidia-ml-py not installed)"
        return [
            CheckItem(name=n, ok=True, skipped=True, detail=why)
            for n in ("gpu_memory", "mig", "ecc")
        ]
    items: list[CheckItem] = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            used = mem.used / mem.total if mem.total else 0.0
            items.append(
                CheckItem(
                    name=f"gpu_memory[{i}]",
                    ok=used < max_used,
                    detail=f"{used:.0%} of device memory in use (limit {max_used:.0%})",
                )
            )
            items.append(_guarded(f"mig[{i}]", _mig, nv, h))
            items.append(_guarded(f"ecc[{i}]", _ecc, nv, h))
    finally:
        nv.nvmlShutdown()
    return items


def _guarded(
    name: str, fn: Callable[[Any, Any], tuple[bool, str]], nv: Any, handle: Any
) -> CheckItem:
    try:
        ok, detail = fn(nv, handle)
    except Exception as e:  # NVMLError_NotSupported on consumer GPUs and the like
        return CheckItem(name=name, ok=True, skipped=True, detail=f"not supported: {e}")
    return CheckItem(name=name, ok=ok, detail=detail)


def _mig(nv: Any, h: Any) -> tuple[bool, str]:
    current, _pending = nv.nvmlDeviceGetMigMode(h)
    on = current == nv.NVML_DEVICE_MIG_ENABLE
    return not on, "MIG enabled: the job would see slices" if on else "MIG off"


def _ecc(nv: Any, h: Any) -> tuple[bool, str]:
    errors = nv.nvmlDeviceGetTotalEccErrors(
        h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
    )
    pending = False
    try:
        pending = bool(nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
    except Exception:  # newer GPUs remap rows instead of retiring pages
        remap = nv.nvmlDeviceGetRemappedRows(h)
        pending = bool(remap[2]) or bool(remap[3])  # pending / failure
    ok = errors == 0 and not pending
    return ok, f"{errors} uncorrected ECC errors, retirement pending: {pending}"


def run_selfchecks(
    node_id: str, config: SelfCheckConfig | None = None, *, fault: str = ""
) -> SelfCheckReport:
    """Run every self-check of this node.

    Args:
        node_id: this node's id (for the report and event).
        config: limits.
        fault: a simulated fault (unbroken.common.faults) applied to the matmul.

    Returns:
        The report; a crashed check is a failed item, never an exception.
    """
    cfg = config or SelfCheckConfig()
    report = SelfCheckReport(node_id=node_id)
    for name, fn in (
        ("matmul", lambda: [check_matmul(cfg.matmul_n, fault=fault)]),
        ("disk", lambda: [check_disk(cfg.disk_path, cfg.min_free_disk_gb)]),
        ("gpu", lambda: check_gpus(cfg.max_gpu_memory_used)),
    ):
        try:
            report.items.extend(fn())
        except Exception as e:
            report.items.append(CheckItem(name=name, ok=False, detail=f"{CRASHED}: {e}"))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m unbroken.diagnostics.selfcheck`: print the report as JSON.

    Returns:
        0 when every check passed, 1 when one failed, 2 for bad flags.
    """
    parser = argparse.ArgumentParser(
        prog="python -m unbroken.diagnostics.selfcheck",
        description="Run this node's self-checks and print the report as one JSON line.",
    )
    parser.add_argument("--node-id", default=socket.gethostname(), help="default: hostname")
    parser.add_argument("--fault", default="", help="simulated fault spec (common/faults.py)")
    parser.add_argument("--disk-path", default="/", help="where checkpoints are persisted")
    parser.add_argument("--min-free-disk-gb", type=float, default=10.0)
    parser.add_argument("--matmul-n", type=int, default=256)
    ns = parser.parse_args(argv)
    try:
        from unbroken.common.faults import FaultSpec

        FaultSpec.parse(ns.fault)
        cfg = SelfCheckConfig(
            disk_path=ns.disk_path, min_free_disk_gb=ns.min_free_disk_gb, matmul_n=ns.matmul_n
        )
    except ValueError as e:
        print(f"selfcheck: {e}", file=sys.stderr)
        return 2
    report = run_selfchecks(ns.node_id, cfg, fault=ns.fault)
    print(report.to_json(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
