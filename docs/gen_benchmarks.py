"""Generate docs/benchmarks.md from the benchmark results in bench/results/*.json.

`make docs-bench` runs this; tests/unit/test_docs_generated.py regenerates the page in memory
and fails when the committed one differs, so a bench's figures reach the docs only through
its JSON. One table per bench (the file name up to its first "-" names the bench:
`recovery-ab-3.json` is a run of bench/recovery.py), one row per result file, newest first,
each with the command that made it, its date and the host's load, and its headline figures
(the numbers of the JSON's first levels, ratios first).

Where a row's facts come from, in order: the JSON's own `date` / `command` keys and its first
load-average key; for results that predate those keys, `bench/results/dates.tsv` (the commit
that last changed the file) and `make bench-NAME` for the file a plain run writes. A bench
should write `date`, `command` and `load1` into its JSON.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "benchmarks.md"
DATES = "dates.tsv"
MAX_FIGURES = 12
#: Keys that describe a run rather than measure it, and bulky per-sample detail.
_SKIP = ("raw", "runs", "wall_ns", "mono", "samples", "logs", "errors", "levels")
#: Words that make a figure a headline: ratios and latencies before counts and settings.
_RANK = ("ratio", "ettr", "vs", "p50", "p99", "median", "_s", "_ms", "_us", "per_s", "gbps")


def _dates(results: Path) -> dict[str, str]:
    path = results / DATES
    if not path.exists():
        return {}
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, date = line.partition("\t")
            out[name.strip()] = date.strip()
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value)


def _load(data: Any) -> str:
    """The first load-average figure of the JSON (breadth first), with its key."""
    level: list[Any] = [data]
    while level:
        nxt: list[Any] = []
        found: list[tuple[str, float]] = []
        for node in level:
            if isinstance(node, dict):
                for k, v in node.items():
                    if "load" in k and isinstance(v, int | float) and not isinstance(v, bool):
                        found.append((k, float(v)))
                    nxt.append(v)
            elif isinstance(node, list):
                nxt.extend(node[:3])
        if found:  # the load when the run started, where the JSON says it
            k, v = min(found, key=lambda kv: not any(w in kv[0] for w in ("start", "before")))
            return f"{v:.2f} ({k})"
        level = nxt
    return "not recorded"


def _figures(data: Any, prefix: str = "", depth: int = 0) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if not isinstance(data, dict) or depth > 2:
        return out
    for k, v in data.items():
        if k in ("date", "command") or "load" in k or any(s == k for s in _SKIP):
            continue
        name = f"{prefix}{k}"
        if isinstance(v, bool | int | float) or (
            isinstance(v, str) and depth == 0 and len(v) <= 60
        ):
            out.append((name, v))
        elif isinstance(v, dict):
            out.extend(_figures(v, f"{name}.", depth + 1))
    return out


def _headline(data: Any) -> tuple[list[tuple[str, Any]], int]:
    figs = _figures(data)

    def rank(item: tuple[str, Any]) -> tuple[int, int]:
        key = item[0].rsplit(".", 1)[-1]
        word = next((i for i, w in enumerate(_RANK) if w in key), len(_RANK))
        return word, item[0].count(".")  # a top-level figure before a nested one

    ordered = sorted(figs, key=rank)  # stable: the JSON's order within a rank
    return ordered[:MAX_FIGURES], max(0, len(figs) - MAX_FIGURES)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(results: Path = RESULTS) -> str:
    """The page's Markdown for the result files of `results`."""
    dates = _dates(results)
    benches: dict[str, list[Path]] = {}
    for path in sorted(results.glob("*.json")):
        benches.setdefault(path.stem.split("-", 1)[0], []).append(path)
    lines = [
        "# Benchmarks",
        "",
        "Generated from `bench/results/*.json` by `docs/gen_benchmarks.py` (`make docs-bench`);",
        "do not edit by hand. Every bench compares against a baseline in the same run and writes",
        "its figures to `bench/results/NAME.json` (`make bench-NAME`); the ratios matter more",
        "than the absolute figures, which were mostly measured on a shared 2-core VM with other",
        "work beside them (the load column). One table per bench, one row per result file,",
        "newest first; each row shows the figures ranked first (ratios, then latencies) and how",
        "many more its JSON holds. What each session changed and measured, in prose, is in",
        "`bench/results/HISTORY.md`.",
        "",
    ]
    for bench, paths in sorted(benches.items()):
        rows = []
        for path in paths:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {"value": data}
            date = str(data.get("date") or dates.get(path.name) or "not recorded")
            command = data.get("command")
            if not isinstance(command, str) or not command:
                command = (
                    f"make bench-{bench}"
                    if path.stem == bench
                    else f"make bench-{bench} ARGS=... (not recorded; see HISTORY.md)"
                )
            figs, more = _headline(data)
            shown = "<br>".join(f"`{k}` = {_cell(_fmt(v))}" for k, v in figs)
            if more:
                shown += f"<br>(+{more} more in the JSON)"
            rows.append((date, path.name, command, _load(data), shown))
        rows.sort(key=lambda r: (r[0], r[1]), reverse=True)
        script = ROOT / "bench" / f"{bench}.py"
        lines += [f"## {bench}", ""]
        if script.exists():
            lines += [f"`bench/{bench}.py`, `make bench-{bench}`.", ""]
        lines += [
            "| result | date (UTC) | load | command | figures |",
            "|---|---|---|---|---|",
        ]
        for date, name, command, load, shown in rows:
            lines.append(f"| `{name}` | {date} | {load} | `{_cell(command)}` | {shown} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
    import genpage

    return genpage.main(__doc__, OUT, ROOT, render, "docs-bench", argv)


if __name__ == "__main__":
    sys.exit(main())
