"""The generated docs pages match their sources: docs/benchmarks.md the results in
bench/results/*.json, docs/api/proto.md the .proto files. Each generator renders its page in
memory here; a stale page fails with the command that regenerates it."""

from __future__ import annotations

import difflib
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same(committed: Path, fresh: str, command: str) -> None:
    assert committed.exists(), f"{committed.relative_to(ROOT)} is missing: run `{command}`"
    old = committed.read_text()
    diff = "".join(
        list(difflib.unified_diff(old.splitlines(True), fresh.splitlines(True), n=0))[:20]
    )
    assert old == fresh, f"{committed.relative_to(ROOT)} is stale: run `{command}`\n{diff}"


def test_the_benchmarks_page_matches_the_results() -> None:
    gen = _load("gen_benchmarks")
    _same(gen.OUT, gen.render(), "make docs-bench")


def test_the_api_page_matches_the_protos() -> None:
    gen = _load("gen_api")
    _same(gen.OUT, gen.render(), "make docs-api")


def test_every_result_file_has_a_row_with_its_command_date_and_load(tmp_path: Path) -> None:
    gen = _load("gen_benchmarks")
    (tmp_path / "toy.json").write_text(
        json.dumps(
            {
                "date": "2026-01-02 03:04",
                "command": "make bench-toy ARGS=--quick",
                "load1_start": 1.5,
                "speed_vs_baseline_ratio": 0.97,
                "raw": [1, 2],
            }
        )
    )
    (tmp_path / "toy-old.json").write_text(json.dumps({"speed_vs_baseline_ratio": 0.9}))
    (tmp_path / "dates.tsv").write_text("# a comment\ntoy-old.json\t2025-12-31 23:00\n")
    page = gen.render(tmp_path)
    rows = [ln for ln in page.splitlines() if ln.startswith("| `toy")]
    assert rows == [
        "| `toy.json` | 2026-01-02 03:04 | 1.50 (load1_start) | `make bench-toy ARGS=--quick` "
        "| `speed_vs_baseline_ratio` = 0.97 |",
        "| `toy-old.json` | 2025-12-31 23:00 | not recorded "
        "| `make bench-toy ARGS=... (not recorded; see HISTORY.md)` "
        "| `speed_vs_baseline_ratio` = 0.9 |",
    ]
    # A changed figure changes the page: the committed page would be stale.
    (tmp_path / "toy.json").write_text(json.dumps({"speed_vs_baseline_ratio": 0.5}))
    assert gen.render(tmp_path) != page
