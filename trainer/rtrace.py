"""Where a recovery's time goes, inside the worker: timestamped marks in a JSON-lines file.

Off unless `UNBROKEN_RECOVERY_TRACE` names a file (bench/recovery.py sets it). Each mark is
one line, `{"t_ns": wall ns, "pid", "rank", "phase", ...}`, appended with one `write` (short
lines on an O_APPEND file are not interleaved between processes). The phases a worker marks:

- ``handoff``: a warm standby got its worker's environment (agent/warm.py);
- ``start``: the worker's entry point runs (a cold process after its imports, a warm standby
  at its hand-off);
- ``left``: a survivor left its step (the agent's hold, or a peer's failed collective);
- ``flash_closed``: a leaving worker finished its flash copy in flight;
- ``severed``: it shut the old world's connections down (`sockets`: how many);
- ``collected``: the leaving rank's collection freed the old world's trainer;
- ``held``: it dropped its process groups and told the agent so;
- ``dropped``: a side thread freed the old gloo world's groups (trainer/ncclguard.py);
- ``rejoin``: the agent's Rejoin (the new world) arrived;
- ``pg_init``: torch.distributed joined the new world;
- ``setup``: the trainer is built (or kept, `kept=1`);
- ``r_begin``, ``r_survey``, ``r_gathered``, ``r_opened``, ``r_agreed``, ``r_state_dict``,
  ``r_copied``, ``r_loaded``: inside a flash restore (trainer/flashckpt.py), the steps of a
  same-layout load: the copies surveyed, every rank's gathered, this rank's opened, every
  rank's read agreed, the trainer's state dict taken, the copy put into it, and loaded;
- ``loaded``: the restore returned;
- ``prepared``: the flash ring is sized and mapped for the restored state;
- ``restored``: the agreed step is in place (`how`: ring, kept, none);
- ``s_batch``, ``s_fwd_bwd``, ``s_optim``, ``s_reduced`` (the embedded engine, after the
  device's work so far): inside that first step, its batch on the device, forward and
  backward (FSDP's collectives in them), the optimizer's step, the loss's all-reduce;
- ``first_step``: the first step in this world finished;
- ``device_warm``: a new worker's GPU warm-up (trainer/devicewarm.py) finished (`s`: took).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

TRACE = "UNBROKEN_RECOVERY_TRACE"


def mark(phase: str, **fields: Any) -> None:
    """Append one mark to the trace file, when one is named (never raises)."""
    path = os.environ.get(TRACE)
    if not path:
        return
    line = {
        "t_ns": time.time_ns(),
        "pid": os.getpid(),
        "rank": os.environ.get("RANK", ""),
        "phase": phase,
        **fields,
    }
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass
