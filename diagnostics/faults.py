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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
