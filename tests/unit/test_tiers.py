"""Every file under tests/unit is a unit test: it carries the `unit` marker and starts no
process (docs/style.md: pure, milliseconds, no processes), so `-m unit` selects exactly the
fast tier. A test that needs a process, etcd or a cluster belongs in tests/integration."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.astparse import parse

pytestmark = pytest.mark.unit

UNIT = Path(__file__).resolve().parent
FILES = sorted(UNIT.glob("test_*.py"))
PROCESS_MODULES = {"subprocess", "multiprocessing"}


def _marks(tree: ast.Module) -> list[str]:
    """The markers named by the module-level `pytestmark` (a mark or a list of marks)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            values = (
                node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            )
            return [ast.unparse(v) for v in values]
    return []


def test_the_unit_folder_is_found() -> None:
    assert len(FILES) > 20 and Path(__file__) in FILES


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_unit_file_carries_the_unit_marker(path: Path) -> None:
    marks = _marks(parse(path.read_text()))
    assert "pytest.mark.unit" in marks, (
        f"{path.name}: add `pytestmark = pytest.mark.unit` after its imports (or move it to "
        "tests/integration if it starts processes or etcd)"
    )
    assert not {"pytest.mark.integration", "pytest.mark.chaos"} & set(marks), marks


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_no_unit_file_starts_processes(path: Path) -> None:
    imported = set()
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & PROCESS_MODULES, (
        f"{path.name} imports {sorted(imported & PROCESS_MODULES)}: a test that starts "
        "processes belongs in tests/integration"
    )
