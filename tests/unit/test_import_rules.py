"""The top-level folders are the architecture: each part imports only the parts below it.

The table is docs/architecture.md's "may import" column. Imports are read from the source with
`ast`, static ones and dynamic ones alike: `importlib.import_module("unbroken.x")`,
`__import__("unbroken.x")` and any string constant naming a module of ours ("unbroken.agent.main",
an entry point "unbroken.trainer.gpt3d:GPT3DTrainer") count, because a dispatcher that keeps
module names in a table imports them all the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.astparse import parse

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# part -> the parts it may import (itself always allowed).
MAY_IMPORT: dict[str, set[str]] = {
    "proto": set(),
    "common": {"proto"},
    "diagnostics": {"proto", "common"},
    "recovery": {"proto", "common"},
    "trainer": {"proto", "common", "recovery"},
    "driver": {"proto", "common", "diagnostics", "recovery"},
    "agent": {"proto", "common", "diagnostics", "recovery"},
    "cli": {"proto", "common", "diagnostics", "recovery", "trainer", "driver", "agent"},
}
PARTS = set(MAY_IMPORT)
# (file, part) -> why the file may name that part anyway.
EXEMPT: dict[tuple[str, str], str] = {
    ("agent/warm.py", "trainer"): "a warm standby is a worker process: the module names are "
    "preloaded in the child interpreter, never imported by the agent",
}
MODULE_STRING = re.compile(r"^unbroken\.([a-z_]+)(\.[A-Za-z_][\w]*)*(:[A-Za-z_]\w*)?$")


def referenced_parts(path: Path) -> dict[str, int]:
    """Every part of ours the file imports or names as a module string -> the first line."""
    tree = parse(path.read_text(), str(path))
    found: dict[str, int] = {}

    def note(module: str, line: int) -> None:
        parts = module.split(".")
        if len(parts) >= 2 and parts[0] == "unbroken" and parts[1] in PARTS:
            found.setdefault(parts[1], line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                note(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "unbroken":
                for alias in node.names:
                    note(f"unbroken.{alias.name}", node.lineno)
            else:
                note(node.module, node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if MODULE_STRING.match(node.value):
                note(node.value.split(":")[0], node.lineno)
    return found


def sources(part: str) -> list[Path]:
    return sorted(
        p for p in (ROOT / part).rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    )


@pytest.mark.parametrize("part", sorted(PARTS))
def test_part_imports_only_what_the_design_allows(part: str) -> None:
    allowed = MAY_IMPORT[part] | {part}
    bad = [
        f"{path.relative_to(ROOT)}:{line} uses unbroken.{other}"
        for path in sources(part)
        for other, line in referenced_parts(path).items()
        if other not in allowed and (str(path.relative_to(ROOT)), other) not in EXEMPT
    ]
    assert not bad, f"{part}/ may import only {sorted(allowed)}:\n" + "\n".join(bad)


def test_the_rule_sees_dynamic_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import importlib\n"
        "TABLE = {'a': ('unbroken.agent.main', 'help')}\n"
        "importlib.import_module(TABLE['a'][0])\n"
        "__import__('unbroken.trainer.gpt3d')\n"
        "EP = 'unbroken.cli.main:main'\n"
    )
    assert set(referenced_parts(src)) == {"agent", "trainer", "cli"}


#: A test module another may import: the event-log contract suite, run against both backends.
SHARED_TEST_MODULES = {"tests.unit.test_eventlog_contract"}


def test_no_test_imports_a_harness_from_another_test_module() -> None:
    """Harnesses live in support modules (tests/jobs.py, tests/procs.py, tests/inproc.py, ...),
    not in test modules, so a test file's helpers are not a second harness others grow on."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                last = name.rsplit(".", 1)[-1]
                if name.startswith("tests.") and last.startswith("test_"):
                    if name not in SHARED_TEST_MODULES:
                        bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
