"""The agent -> worker environment contract: what a node agent tells the processes it starts.

The agent starts every worker with the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, ...)
plus the `UNBROKEN_*` variables below; the trainer, the hooks SDK and the flash checkpointer
read them. Both sides go through `WorkerEnv`: the agent builds one and writes `to_env()`,
a worker reads `WorkerEnv.from_env(os.environ)`, so a name or a format exists once.

=========================  ==========================================================
``UNBROKEN_AGENT_SOCKET``  the agent's hook socket (trainer/hooks.py)
``UNBROKEN_AGENT_PID``     the agent's pid: a worker whose agent died exits at once
``UNBROKEN_FAULT``         the node's simulated check fault spec (common/faults.py)
``UNBROKEN_FAULT_FILE``    the file injected worker faults are written to (nan, loss-spike)
``UNBROKEN_RESTORE_STEP``  after a rollback: restore the newest step at or before this
``UNBROKEN_SKIP_BATCHES``  ``<from_step>:<count>``: skip count batches before from_step
``UNBROKEN_TIMELINE``      the job's rollbacks so far, stamped on every flash copy
``UNBROKEN_FLASH_ROOT``    the agent's flash store: root directory,
``UNBROKEN_FLASH_JOB``     job,
``UNBROKEN_FLASH_NODE``    and the ring slot the node fills (a replaced node's after a swap)
``UNBROKEN_PERSIST_URL``   where persisted copies go (fsspec URL)
``UNBROKEN_PERSIST_EVERY_S``  about how often a copy is persisted (seconds)
``UNBROKEN_FLASH_COPIES``  the ring: copies per rank in shared memory
``UNBROKEN_DP/PP/TP``      the driver's layout after an elastic resize (wins over flags)
``UNBROKEN_WARM_ARGV``     a warm standby's only: the worker's flags (JSON list), which its
                           dry run builds the trainer from (trainer/warmup.py)
=========================  ==========================================================

A variable that is unset reads as the field's default; one that is set but malformed is a
`ValueError` naming it (the agent wrote it, so that is a bug to see, not to guess around).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

AGENT_SOCKET = "UNBROKEN_AGENT_SOCKET"
AGENT_PID = "UNBROKEN_AGENT_PID"
FAULT = "UNBROKEN_FAULT"
FAULT_FILE = "UNBROKEN_FAULT_FILE"
RESTORE_STEP = "UNBROKEN_RESTORE_STEP"
SKIP_BATCHES = "UNBROKEN_SKIP_BATCHES"
TIMELINE = "UNBROKEN_TIMELINE"
FLASH_ROOT = "UNBROKEN_FLASH_ROOT"
FLASH_JOB = "UNBROKEN_FLASH_JOB"
FLASH_NODE = "UNBROKEN_FLASH_NODE"
PERSIST_URL = "UNBROKEN_PERSIST_URL"
PERSIST_EVERY_S = "UNBROKEN_PERSIST_EVERY_S"
FLASH_COPIES = "UNBROKEN_FLASH_COPIES"
DP = "UNBROKEN_DP"
PP = "UNBROKEN_PP"
TP = "UNBROKEN_TP"
#: Not a worker's variable (no `WorkerEnv` field): set in a warm standby's environment only.
WARM_ARGV = "UNBROKEN_WARM_ARGV"

#: Not a variable: the line a stopped worker's SIGUSR2 handler writes to stderr after its
#: stack dump (trainer/hookchannel.py), so the agent takes the dump as soon as it is whole
#: rather than after its output has been quiet a while (agent/workers.py).
STACKS_END = "-- unbroken: end of stacks --"
#: Which variable holds each field.
VARIABLES: dict[str, str] = {
    "agent_socket": AGENT_SOCKET,
    "agent_pid": AGENT_PID,
    "fault": FAULT,
    "fault_file": FAULT_FILE,
    "restore_step": RESTORE_STEP,
    "skip_batches": SKIP_BATCHES,
    "timeline": TIMELINE,
    "flash_root": FLASH_ROOT,
    "flash_job": FLASH_JOB,
    "flash_node": FLASH_NODE,
    "persist_url": PERSIST_URL,
    "persist_every_s": PERSIST_EVERY_S,
    "flash_copies": FLASH_COPIES,
    "dp": DP,
    "pp": PP,
    "tp": TP,
}
#: The variables of a rollback's restore point (cleared before a new one is set).
RESTORE_VARIABLES = (RESTORE_STEP, SKIP_BATCHES)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnv:
    """The `UNBROKEN_*` part of a worker's environment (unset fields are not written).

    Attributes:
        agent_socket: the agent's hook socket ("" : none).
        agent_pid: the agent's pid (None: not under an agent).
        fault: the node's simulated check fault spec ("" : none).
        fault_file: where injected worker faults are written ("" : none).
        restore_step: restore the newest step at or before this (None: the newest).
        skip_batches: (from_step, count): skip count batches before from_step runs.
        timeline: the job's rollbacks so far (None: unset, read as 0).
        flash_root, flash_job, flash_node: the agent's flash store ("" : none).
        persist_url: where persisted copies go.
        persist_every_s: about how often a copy is persisted (None: the default).
        flash_copies: copies per rank in the ring (0: sized by the agent; None: the default).
        dp, pp, tp: the driver's layout (None: the flags decide).
    """

    agent_socket: str = ""
    agent_pid: int | None = None
    fault: str = ""
    fault_file: str = ""
    restore_step: int | None = None
    skip_batches: tuple[int, int] | None = None
    timeline: int | None = None
    flash_root: str = ""
    flash_job: str = ""
    flash_node: str = ""
    persist_url: str = ""
    persist_every_s: float | None = None
    flash_copies: int | None = None
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None

    def __post_init__(self) -> None:
        for name in ("restore_step", "timeline", "flash_copies"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{VARIABLES[name]}={v}: expected an integer >= 0")
        for name in ("agent_pid", "dp", "pp", "tp"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{VARIABLES[name]}={v}: expected a positive integer")
        if self.skip_batches is not None and min(self.skip_batches) < 0:
            raise ValueError(f"{SKIP_BATCHES}={self.skip_batches}: expected counts >= 0")
        p = self.persist_every_s
        if p is not None and not (math.isfinite(p) and p > 0):
            raise ValueError(f"{PERSIST_EVERY_S}={p!r}: expected a finite number of seconds > 0")

    def to_env(self) -> dict[str, str]:
        """The variables of the fields that are set."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or v == "":
                continue
            if f.name == "skip_batches":
                out[SKIP_BATCHES] = f"{v[0]}:{v[1]}"
            elif isinstance(v, float):
                out[VARIABLES[f.name]] = repr(v)
            else:
                out[VARIABLES[f.name]] = str(v)
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerEnv:
        """Parse the `UNBROKEN_*` variables of `env` (others are ignored).

        Raises:
            ValueError: a variable is set but malformed (the message names it).
        """
        kw: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            var = VARIABLES[f.name]
            raw = env.get(var, "").strip()
            if not raw:
                continue
            if f.name == "skip_batches":
                head, sep, tail = raw.partition(":")
                if not (sep and head.isdigit() and tail.isdigit()):
                    raise ValueError(
                        f"{var}={raw!r}: expected '<from_step>:<count>', e.g. '120:200'"
                    )
                kw[f.name] = (int(head), int(tail))
            elif f.name == "persist_every_s":
                try:
                    kw[f.name] = float(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r}: expected a number of seconds") from None
            elif f.type in ("int | None",):
                if not raw.isdigit():
                    raise ValueError(f"{var}={raw!r}: expected an integer >= 0 (set by the agent)")
                kw[f.name] = int(raw)
            else:
                kw[f.name] = raw
        return cls(**kw)  # type: ignore[arg-type]
