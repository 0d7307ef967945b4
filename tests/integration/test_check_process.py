"""The check workload as a process: usage errors, one JSON line, solo and group faults."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from unbroken.diagnostics.check import run_group_local

pytestmark = pytest.mark.integration


def test_bad_usage_exits_2_with_a_clear_message() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "unbroken.diagnostics.check", "--spec", '{"check_id": "x"}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "bad spec" in p.stderr and p.stdout == ""
    p = subprocess.run(
        [sys.executable, "-m", "unbroken.diagnostics.check", "--spec", "not json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "not valid JSON" in p.stderr


def test_solo_nan_and_group_wrong_allgather() -> None:
    async def both() -> tuple[dict, dict]:
        return await asyncio.gather(
            run_group_local("solo", ["a"], faults={"a": "nan"}, timeout_s=40, matmul_iters=2),
            run_group_local(
                "pair", ["b", "c"], faults={"c": "wrong_allgather"}, timeout_s=40, matmul_iters=2
            ),
        )

    solo, pair = asyncio.run(both())
    a = solo["a"]
    assert not a.ok and a.failure == "nan" and a.fault == "nan" and a.backend == "gloo"
    assert json.loads(a.to_json())["schema"] == 1
    for node in ("b", "c"):
        r = pair[node]
        assert not r.ok and r.failure == "allgather" and "[1]" in r.detail, r
        assert r.matmul_ms > 0 and len(r.matmul_samples_ms) == 2 and r.allgather_ms > 0
