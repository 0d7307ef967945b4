"""One bench at two commits, in the same run: is a change within noise of what came before?

A refactor must not slow the heartbeat plane or recovery; absolute figures on a shared 2-core
host move with its load, so the comparison is a same-run ratio. Both commits are checked out
as detached git worktrees under a temporary folder; each runs the bench script from its own
tree with its own code (a `PYTHONPATH` folder whose `unbroken` links to that tree, so the
main checkout's editable install is not used), in alternating order round by round (base,
head; head, base; ...). After each run the named metrics are read from the result file that
tree's bench wrote. Nothing in the main checkout's bench/results is touched but the output.

    python bench/ab.py --base d9dde2b --result heartbeat \\
        --metric levels.0.driver_cpu_us_per_heartbeat --metric detect_p50_ms \\
        -- heartbeat.py --levels 1000

`make bench-ab ARGS="..."`. Writes bench/results/ab_<result>.json (`--out` to change):
every run's values and load, the median per side, and `ratio` = head median / base median
per metric (1.0: no change; above 1 for a time or a cost: head is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def pick(doc: Any, path: str) -> float | None:
    """The value at a dotted path (`levels.0.handler_p50_us`: list indexes are numbers)."""
    cur = doc
    for part in path.split("."):
        if isinstance(cur, list):
            try:
                cur = cur[int(part)]
            except (ValueError, IndexError):
                return None
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return None
    return float(cur) if isinstance(cur, int | float) and not isinstance(cur, bool) else None


class Side:
    """One commit checked out, and how to run a bench in it."""

    def __init__(self, name: str, rev: str, tmp: Path) -> None:
        self.name, self.rev = name, git("rev-parse", rev)
        self.tree = tmp / name
        git("worktree", "add", "--detach", str(self.tree), self.rev)
        self.path = tmp / f"{name}-path"
        self.path.mkdir()
        (self.path / "unbroken").symlink_to(self.tree)

    def run(self, script: list[str], result: str, timeout_s: float) -> dict[str, Any]:
        out = self.tree / "bench" / "results" / f"{result}.json"
        out.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(self.path), "OMP_NUM_THREADS": "1"}
        load0, t0 = os.getloadavg()[0], time.monotonic()
        p = subprocess.run(
            [sys.executable, str(self.tree / "bench" / script[0]), *script[1:]],
            cwd=self.tree,
            env=env,
            timeout=timeout_s,
            capture_output=True,
            text=True,
        )
        run: dict[str, Any] = {
            "rc": p.returncode,
            "seconds": round(time.monotonic() - t0, 1),
            "load1_start": round(load0, 2),
            "load1_end": round(os.getloadavg()[0], 2),
        }
        if p.returncode != 0 or not out.exists():
            run["error"] = (p.stderr or p.stdout)[-2000:]
            return run
        run["doc"] = json.loads(out.read_text())
        return run

    def close(self) -> None:
        subprocess.run(["git", "worktree", "remove", "--force", str(self.tree)], cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="everything after -- is the bench script (under bench/) and its arguments",
    )
    ap.add_argument("--base", required=True, help="the commit before the change")
    ap.add_argument("--head", default="HEAD", help="the commit with it (default HEAD)")
    ap.add_argument("--result", required=True, help="the bench's result name (heartbeat)")
    ap.add_argument("--metric", action="append", required=True, help="dotted path, repeatable")
    ap.add_argument("--rounds", type=int, default=2, help="runs per side (default 2)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("script", nargs=argparse.REMAINDER)
    ns = ap.parse_args(argv)
    script = ns.script[1:] if ns.script[:1] == ["--"] else ns.script
    if not script or not (HERE / script[0]).is_file():
        print("error: name the bench script after --, e.g. -- heartbeat.py --levels 1000",
              file=sys.stderr)  # fmt: skip
        return 2
    if ns.rounds < 1:
        print("error: --rounds must be >= 1", file=sys.stderr)
        return 2
    out_path = ns.out or HERE / "results" / f"ab_{ns.result}.json"
    with tempfile.TemporaryDirectory(prefix="unbroken-ab-") as tmp:
        sides = [Side("base", ns.base, Path(tmp)), Side("head", ns.head, Path(tmp))]
        runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
        try:
            for r in range(ns.rounds):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    run = side.run(script, ns.result, ns.timeout_s)
                    doc = run.pop("doc", None)
                    run["values"] = {m: pick(doc, m) for m in ns.metric} if doc else {}
                    runs[side.name].append(run)
                    print(side.name, json.dumps(run)[:400], flush=True)
        finally:
            for side in sides:
                side.close()
    medians: dict[str, dict[str, float | None]] = {}
    for name, rs in runs.items():
        medians[name] = {}
        for m in ns.metric:
            vals = [v for r in rs if (v := r["values"].get(m)) is not None]
            medians[name][m] = statistics.median(vals) if vals else None
    ratio = {
        m: round(h / b, 3) if (h := medians["head"][m]) is not None and (b := medians["base"][m])
        else None
        for m in ns.metric
    }  # fmt: skip
    doc = {
        "command": "python bench/ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "base": sides[0].rev,
        "head": sides[1].rev,
        "script": script,
        "rounds": ns.rounds,
        "cores": os.cpu_count(),
        "runs": runs,
        "median": medians,
        "ratio": ratio,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    for m in ns.metric:
        print(f"{m}: base {medians['base'][m]} head {medians['head'][m]} ratio {ratio[m]}")
    print(f"wrote {out_path}")
    failed = [r for rs in runs.values() for r in rs if r["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
