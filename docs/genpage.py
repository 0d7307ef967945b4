"""What the docs' page generators share: write the page, or with --check say it is stale."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def main(
    doc: str | None, out: Path, root: Path, render: Callable[[], str], target: str,
    argv: list[str] | None = None,
) -> int:  # fmt: skip
    """`render()` into `out`; with --check, exit 1 (naming `make target`) when it differs."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out.relative_to(root)} is stale: run `make {target}`", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out.relative_to(root)}")
    return 0
