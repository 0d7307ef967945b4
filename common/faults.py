"""Simulated hardware faults for the check workload, so every diagnosis path runs without
broken hardware (tests, drills, `unbroken agent --inject-fault SPEC`).

A spec is a comma- or plus-separated list of terms; the same spec always does the same
thing (no randomness):

==================  =============================================================
``wrong_matmul``    one element of every matmul result is off by one (a silently
                    corrupt GPU: no error, a wrong number)
``nan``             one element of every matmul result is NaN (Falcon's bad GPUs)
``wrong_allgather`` this node's all-gather contribution carries a wrong value
``hang_allgather``  this node never enters the all-gather (a hung collective)
``slow:F``          every matmul takes F times its device time (F >= 1; ``slow:1.2``
                    is 20 % slow). The extra time is spent computing, not sleeping,
                    so it shows up in device time exactly like a throttled GPU.
``none`` / ``""``   no fault
==================  =============================================================

Example: ``FaultSpec.parse("wrong_matmul+slow:2.0")``.

Faults can also be injected into a running node (``unbroken inject FAULT --node N``, the
drill): `RuntimeFault` validates one of `RUNTIME_FAULTS`. The check-level ones
(wrong-matmul, slow) change the agent's `FaultSpec` from then on; the others act on the
node's workers or on the agent itself (agent/commands.py applies them).

The worker faults (`WORKER_FILE_FAULTS`) reach the trainer through a file, not a signal:
the agent writes a `WorkerFault` atomically as JSON, ``{"kind": "nan" | "loss-spike",
"step": N, "id": "..."}``, to the file its workers find in ``UNBROKEN_FAULT_FILE``
(`FAULT_FILE` in the worker log directory), and the trainer reads it each step
(trainer/run.py). A lasting compute slowdown (``slow-train``) is ``{"factor": F}`` in
`SLOW_FILE` beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FLAGS = ("wrong_matmul", "nan", "wrong_allgather", "hang_allgather")
_HELP = "known terms: wrong_matmul, nan, wrong_allgather, hang_allgather, slow:F (F >= 1), none"


@dataclass(kw_only=True, slots=True, frozen=True)
class FaultSpec:
    """Which faults a node simulates. All off by default.

    Attributes:
        wrong_matmul: corrupt one element of each matmul result.
        nan: put a NaN into each matmul result.
        wrong_allgather: send a wrong value in the all-gather.
        hang_allgather: never enter the all-gather.
        slow_factor: multiply each matmul's device time by this (>= 1.0).
    """

    wrong_matmul: bool = False
    nan: bool = False
    wrong_allgather: bool = False
    hang_allgather: bool = False
    slow_factor: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.slow_factor) and self.slow_factor >= 1.0):
            raise ValueError(f"slow_factor must be a finite number >= 1.0, got {self.slow_factor}")

    @classmethod
    def parse(cls, text: str | None) -> FaultSpec:
        """Parse a spec such as ``"nan"``, ``"slow:1.5"`` or ``"wrong_matmul+slow:2"``.

        Raises:
            ValueError: on an unknown term or a bad slow factor, naming the known terms.
        """
        flags: dict[str, bool] = {}
        slow = 1.0
        for raw in (text or "").replace("+", ",").split(","):
            term = raw.strip().lower()
            if term in ("", "none"):
                continue
            if term in _FLAGS:
                flags[term] = True
            elif term.startswith("slow:"):
                try:
                    slow = float(term.split(":", 1)[1])
                except ValueError as e:
                    raise ValueError(f"bad fault term {raw!r}: slow:F needs a number") from e
                if not (math.isfinite(slow) and slow >= 1.0):
                    raise ValueError(f"bad fault term {raw!r}: the slow factor must be >= 1.0")
            else:
                raise ValueError(f"unknown fault term {raw!r}; {_HELP}")
        return cls(slow_factor=slow, **flags)

    @property
    def any(self) -> bool:
        """True when at least one fault is on."""
        return self != FaultSpec()

    def __str__(self) -> str:
        terms = [name for name in _FLAGS if getattr(self, name)]
        if self.slow_factor != 1.0:
            terms.append(f"slow:{self.slow_factor:g}")
        return "+".join(terms) or "none"


# ---------------------------------------------------------------- faults injected at runtime
#: `unbroken inject FAULT`: what each kind does (the agent applies it, agent/commands.py).
RUNTIME_FAULTS: dict[str, str] = {
    "wrong-matmul": "the node's checks and self-check compute wrong results (a corrupt GPU)",
    "slow": "the node's checks run FACTOR times slower (--factor, >= 1)",
    "slow-train": "the node's workers compute FACTOR times slower (--factor, >= 1; 1 ends it)",
    "crash": "SIGKILL the worker of local rank R (--rank)",
    "crash-suspect": "SIGSEGV the worker of local rank R (--rank): a crash inside the process "
    "(an extension), which makes the incident suspect: every worker process restarts",
    "hang": "SIGSTOP the worker of local rank R (--rank): no exit, no progress",
    "node-loss": "the agent SIGKILLs its workers and exits without a goodbye",
    "nan": "the workers see a NaN loss at step S (--step; 0: the next step)",
    "loss-spike": "the workers see a loss spike at step S (--step; 0: the next step)",
    "sdc": "flip one bit of one worker's state after step S (--rank, --random-rank, --tensor, "
    "--bit, --target param|optim|copy; random when not given): silent data corruption",
    "sdc-matmul": "every matmul of one worker is off by a relative SIZE from step S "
    "(--rank, --size; --size 0 ends it): a silently wrong GPU in training",
}
NAN, LOSS_SPIKE, SDC, SDC_MATMUL = "nan", "loss-spike", "sdc", "sdc-matmul"
SDC_FAULTS = (SDC, SDC_MATMUL)
WORKER_FILE_FAULTS = (NAN, LOSS_SPIKE, *SDC_FAULTS)  # written to UNBROKEN_FAULT_FILE
FAULT_FILE = "fault.json"  # the worker fault file's name in the workers' log directory
SLOW_FILE = "slow-train.json"  # beside it: the node's lasting compute slowdown


@dataclass(kw_only=True, slots=True, frozen=True)
class RuntimeFault:
    """A fault injected into a running node (`unbroken inject`, the drill).

    Attributes:
        kind: one of `RUNTIME_FAULTS` (``_`` is accepted for ``-``).
        local_rank: the worker hit by crash / hang.
        factor: the slowdown of ``slow`` (>= 1; 0 means 2).
        step: the step of nan / loss-spike (0: the next step).
    """

    kind: str
    local_rank: int = 0
    factor: float = 0.0
    step: int = 0
    sdc: SdcDetail | None = None  # sdc / sdc-matmul: what to corrupt

    def __post_init__(self) -> None:
        if self.kind not in RUNTIME_FAULTS:
            raise ValueError(
                f"unknown fault {self.kind!r}; choose one of {', '.join(RUNTIME_FAULTS)}"
            )
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if self.factor and not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"factor must be a finite number >= 1, got {self.factor}")
        if self.factor and self.kind not in ("slow", "slow-train"):
            raise ValueError(f"factor applies to the 'slow' fault only, not {self.kind!r}")

    @classmethod
    def of(
        cls,
        kind: str,
        local_rank: int = 0,
        factor: float = 0.0,
        step: int = 0,
        sdc: SdcDetail | None = None,
    ) -> RuntimeFault:
        """Normalise ``kind`` (case, ``_`` for ``-``) and validate (ValueError naming the field)."""
        return cls(
            kind=kind.strip().lower().replace("_", "-"),
            local_rank=local_rank,
            factor=factor,
            step=step,
            sdc=sdc,
        )

    def apply_to(self, spec: FaultSpec) -> FaultSpec:
        """The check-level fault spec once this fault is on (unchanged for worker faults)."""
        if self.kind == "wrong-matmul":
            return dataclasses.replace(spec, wrong_matmul=True)
        if self.kind == "slow":
            return dataclasses.replace(spec, slow_factor=self.factor or 2.0)
        return spec


@dataclass(frozen=True, slots=True)
class SdcDetail:
    """What an `sdc` / `sdc-matmul` fault corrupts (trainer/sdc.py applies it).

    Attributes:
        local_rank: the worker's local rank (-1: every worker of the node reads the fault,
            and only `local_rank` applies it; -1 here means the agent did not choose).
        tensor: a state tensor's name or part of it ("" random).
        bit: the bit of the 32-bit word to flip (-1 random).
        target: "param", "optim" or "" (either) for a random tensor; "copy": either, flipped
            in the rank's flash copy of the next fingerprinted step at or after the fault's
            step alone (the live state stays right), as a host-memory or copy-path error
            would.
        size: sdc-matmul's relative error (0 ends it).
    """

    local_rank: int = -1
    tensor: str = ""
    bit: int = -1
    target: str = ""
    size: float = 0.0

    def __post_init__(self) -> None:
        if not -1 <= self.bit < 32:
            raise ValueError(f"bit must be 0-31 (or -1: random), got {self.bit}")
        if self.target not in ("", "param", "optim", "copy"):
            raise ValueError(
                f"target must be 'param', 'optim', 'copy' or empty, got {self.target!r}"
            )
        if not (math.isfinite(self.size) and self.size >= 0.0):
            raise ValueError(f"size must be a finite number >= 0, got {self.size}")

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def of_message(cls, msg: Any, local_rank: int, ranks: Sequence[int]) -> SdcDetail:
        """From an `InjectFault.sdc` message (proto SdcFault): the local rank is
        `local_rank`, or one of `ranks` at random when the message says `random_rank`."""
        if msg.random_rank and ranks:
            local_rank = random.choice(list(ranks))
        return cls(
            local_rank=local_rank,
            tensor=msg.tensor,
            bit=msg.bit if msg.HasField("bit") else -1,
            target=msg.target,
            size=msg.size,
        )

    @classmethod
    def from_json(cls, d: object) -> SdcDetail:
        if not isinstance(d, dict):
            raise ValueError("the fault's sdc detail must be a JSON object")
        try:
            return cls(
                local_rank=int(d.get("local_rank", -1)),
                tensor=str(d.get("tensor", "")),
                bit=int(d.get("bit", -1)),
                target=str(d.get("target", "")),
                size=float(d.get("size", 0.0)),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad sdc detail {d!r}: {e}") from e


# ---------------------------------------------------------------- the worker fault file
@dataclass(frozen=True, slots=True)
class WorkerFault:
    """One fault for the trainer, as written to the worker fault file."""

    kind: str  # one of WORKER_FILE_FAULTS
    step: int  # apply at this step (0 or past: the next step)
    id: str  # applied once per id, also across worker restarts
    sdc: SdcDetail | None = None  # sdc kinds: what to corrupt, on which local rank

    def __post_init__(self) -> None:
        if self.kind not in WORKER_FILE_FAULTS:
            raise ValueError(
                f"fault kind {self.kind!r} unknown; the trainer applies {WORKER_FILE_FAULTS}"
            )
        if not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0:
            raise ValueError(f"fault step {self.step!r} must be an integer >= 0")
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("fault id must be a non-empty string")

    @classmethod
    def parse(cls, text: str) -> WorkerFault:
        """A fault from the file's JSON text.

        Raises:
            ValueError: not JSON, or a field is missing or wrong (the message names it).
        """
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"fault file is not JSON: {e}") from e
        if not isinstance(d, dict):
            raise ValueError("fault file must hold a JSON object {kind, step, id}")
        sdc = SdcDetail.from_json(d["sdc"]) if d.get("sdc") is not None else None
        return cls(kind=d.get("kind", ""), step=d.get("step", 0), id=d.get("id", ""), sdc=sdc)

    def write(self, path: Path) -> None:
        """Write atomically to `path`: a worker never reads half a file."""
        data: dict[str, object] = {"kind": self.kind, "step": self.step, "id": self.id}
        if self.sdc is not None:
            data["sdc"] = self.sdc.to_json()
        write_atomic(path, data)


def write_slow_factor(path: Path, factor: float) -> None:
    """Write the lasting compute slowdown (1.0 ends it) atomically to `path`."""
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"factor {factor} must be a finite number >= 1")
    write_atomic(path, {"factor": factor})


def parse_slow_factor(text: str) -> float:
    """The factor of a slow file's JSON text (ValueError when malformed or below 1)."""
    try:
        f = float(json.loads(text)["factor"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f'slow file must hold {{"factor": F}}: {e}') from e
    if not (math.isfinite(f) and f >= 1.0):
        raise ValueError(f"factor {f} must be a finite number >= 1")
    return f


def write_atomic(path: Path, data: object) -> None:
    """`data` as JSON to `path` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
