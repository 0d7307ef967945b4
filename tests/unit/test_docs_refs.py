"""Code, .proto files and the README point into this repository, never outside it: no
source file, .proto file or README names the design notes that lived outside the repository
(their content is in docs/architecture.md, docs/style.md and docs/peers.md) or cites an issue
number (the tracker is not part of the repository; the reason goes in the docstring or in a
docs page that the docstring names)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".venv", "build", "dist", "site", ".git", "node_modules"}
OUTSIDE = re.compile(r"\b(?:DESIGN|STYLE|PEERS)\.md\b")
# "issue 16", "issues 13 and 15", "issue #16", "(#42)"; a one-digit "#1" is too often
# something else (a kernel build in `uname -v`, a list item) to flag. Upstream references that
# name their project ("pytorch#158326", "torchft#329") are not ours and are allowed.
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w/#])#\d{2,}\b(?![\w-])", re.IGNORECASE)
THIS = Path(__file__).resolve()


def _files() -> list[Path]:
    out = [ROOT / "README.md"]
    for path in sorted([*ROOT.rglob("*.py"), *ROOT.rglob("*.proto")]):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP_DIRS or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        if path.resolve() != THIS:
            out.append(path)
    return out


def _hits(text: str) -> list[str]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in (*OUTSIDE.finditer(line), *ISSUE.finditer(line)):
            hits.append(f"{n}: {m.group(0)!r} in {line.strip()[:100]}")
    return hits


def test_the_patterns_catch_what_they_should() -> None:
    assert _hits("see DESIGN.md, STYLE.md 15 and PEERS.md")
    assert _hits("Detection (issue 16): ...") and _hits("issues 13 and 15")
    assert _hits("fixed in #42.") and _hits("(see #17)")
    assert not _hits("Linux 6.1 #1 SMP")
    assert not _hits("pytorch#158326 and torchft#329 are upstream")
    assert not _hits("color #ff0000; a comment '# 42 steps'")
    assert not _hits("docs/architecture.md#the-journal")


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_outside_the_repository(path: Path) -> None:
    hits = _hits(path.read_text(errors="replace"))
    assert not hits, (
        f"{path.relative_to(ROOT)} cites a file outside the repository or an issue number; "
        "point to the docs page that holds the reason (e.g. docs/architecture.md#the-journal) "
        "or say the reason in place:\n" + "\n".join(hits)
    )
