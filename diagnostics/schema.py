"""The JSON spec a check process reads and the JSON result line it prints.

This is the contract between the driver (which plans groups), the agent (which runs
``python -m unbroken.diagnostics.check --spec '<json>'`` and sends the printed line back)
and the judge. No torch here, so the driver and agent can import it cheaply. The fields
are documented in unbroken.diagnostics.check.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from unbroken.common.faults import FaultSpec

RESULT_SCHEMA = 1
FAILURES = ("", "matmul", "nan", "allgather", "timeout", "rendezvous", "error", "missing")


@dataclass(kw_only=True, slots=True)
class CheckSpec:
    """What one member of a group check does (see unbroken.diagnostics.check)."""

    check_id: str
    node_id: str
    group: list[str]
    rank: int
    store_host: str
    store_port: int
    timeout_s: float = 60.0
    phase_timeout_s: float = 0.0  # 0: only timeout_s
    matmul_n: int = 0  # 0: sized to the device (768 on CPU, 8192 on a GPU)
    matmul_iters: int = 16
    allgather_numel: int = 1 << 16
    allgather_iters: int = 4
    seed: int = 0
    device: str = "auto"  # "auto", "cpu" or "cuda"
    fault: str = ""

    def __post_init__(self) -> None:
        if not self.check_id:
            raise ValueError("check_id must be a non-empty string")
        if not self.group or len(set(self.group)) != len(self.group):
            raise ValueError(f"group must be a non-empty list of unique node ids: {self.group}")
        if self.node_id not in self.group:
            raise ValueError(f"node_id {self.node_id!r} is not in group {self.group}")
        if not 0 <= self.rank < len(self.group) or self.group[self.rank] != self.node_id:
            raise ValueError(
                f"rank {self.rank} must be the index of node_id {self.node_id!r} in group"
            )
        if not 0 <= self.store_port < 65536:
            raise ValueError(f"store_port must be in 0..65535, got {self.store_port}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not (math.isfinite(self.phase_timeout_s) and self.phase_timeout_s >= 0):
            raise ValueError(f"phase_timeout_s must be >= 0, got {self.phase_timeout_s}")
        for name in ("matmul_n", "allgather_numel"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("matmul_iters", "allgather_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        FaultSpec.parse(self.fault)  # raises ValueError naming the bad term

    @classmethod
    def from_json(cls, text: str) -> CheckSpec:
        """Parse and validate a spec.

        Raises:
            ValueError: on bad JSON, unknown or missing fields, or bad values.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--spec is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError("--spec must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown spec fields {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"bad spec: {e}") from e

    def to_json(self) -> str:
        """The spec as one JSON line; no ``fault`` key when there is none, so an agent
        started with ``--inject-fault`` can add its own."""
        data = asdict(self)
        if not data["fault"]:
            del data["fault"]
        return json.dumps(data, separators=(",", ":"))


@dataclass(kw_only=True, slots=True)
class CheckResult:
    """One member's result line (see unbroken.diagnostics.check for the fields)."""

    check_id: str
    node_id: str
    rank: int
    group: list[str]
    ok: bool
    failure: str = ""
    detail: str = ""
    device: str = ""
    backend: str = ""
    fault: str = "none"
    rendezvous_ms: float = 0.0
    matmul_ms: float = 0.0  # median device time per matmul
    matmul_wall_ms: float = 0.0
    matmul_samples_ms: list[float] = field(default_factory=list)
    matmul_tflops: float = 0.0
    allgather_ms: float = 0.0
    allgather_samples_ms: list[float] = field(default_factory=list)
    total_ms: float = 0.0
    schema: int = RESULT_SCHEMA

    def to_json(self) -> str:
        """The result as one JSON line."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> CheckResult:
        """Parse a result line, ignoring fields this version does not know.

        Raises:
            ValueError: when the line is not a JSON object with the required fields.
        """
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"check result is not JSON: {text[:200]!r}") from e
        if not isinstance(data, dict):
            raise ValueError(f"check result is not a JSON object: {text[:200]!r}")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise ValueError(f"check result misses fields: {e}") from e

    @classmethod
    def missing(cls, spec: CheckSpec, detail: str) -> CheckResult:
        """The result to record when a member printed nothing usable."""
        return cls(
            check_id=spec.check_id,
            node_id=spec.node_id,
            rank=spec.rank,
            group=list(spec.group),
            ok=False,
            failure="missing",
            detail=detail,
            fault=str(FaultSpec.parse(spec.fault)),
        )
