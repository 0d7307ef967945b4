"""The house stays small: no product module over 800 lines, no function over 80 lines.

Product modules are every `.py` file of the unbroken packages (proto, common, diagnostics,
recovery, trainer, driver, agent, cli), generated protobuf stubs (`*_pb2*.py`) aside; tests/
and bench/ are not product. A module's size is its line count; a function's is from its
`def` line to its last line (`end_lineno - lineno + 1`), nested functions counted on their
own as well as inside their parent.

`OWED` lists what is over today in files other branches are splitting, each with what is
over; those entries are left out of the two size tests, and the third test fails once an
entry is no longer over, so the listing shrinks to nothing as the branches land.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.astparse import parse

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proto", "common", "diagnostics", "recovery", "trainer", "driver", "agent", "cli")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80

# What is over in files that other branches of this round are splitting (path, or
# path::qualified function name -> its size when listed). Delete an entry when its branch
# lands; test_the_owed_listing_names_only_what_is_still_over says which.
OWED: dict[str, int] = {}


def product_modules() -> list[Path]:
    return sorted(
        p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "_pb2" not in p.name and "__pycache__" not in p.parts
    )


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def module_sizes() -> dict[str, int]:
    """Path -> line count of every product module."""
    return {_rel(p): len(p.read_text().splitlines()) for p in product_modules()}


def function_sizes() -> dict[str, int]:
    """'path::Class.function' -> lines of every function and method of the product."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    out[f"{path}::{name}"] = child.end_lineno - child.lineno + 1
                walk(child, f"{name}.", path)
            else:
                walk(child, prefix, path)

    for p in product_modules():
        walk(parse(p.read_text(), str(p)), "", _rel(p))
    return out


def _over(sizes: dict[str, int], limit: int) -> dict[str, int]:
    return {k: v for k, v in sorted(sizes.items()) if v > limit}


def test_the_product_modules_are_found() -> None:
    names = set(module_sizes())
    assert {"driver/state.py", "agent/main.py", "common/config.py"} <= names
    assert not any("_pb2" in n for n in names)


def test_no_module_over_800_lines() -> None:
    over = {k: v for k, v in _over(module_sizes(), MAX_MODULE_LINES).items() if k not in OWED}
    assert not over, (
        f"modules over {MAX_MODULE_LINES} lines (split each along a seam that has a name): "
        + ", ".join(f"{k} ({v})" for k, v in over.items())
    )


def test_no_function_over_80_lines() -> None:
    over = {k: v for k, v in _over(function_sizes(), MAX_FUNCTION_LINES).items() if k not in OWED}
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines (split each into its phases): "
        + ", ".join(f"{k} ({v})" for k, v in over.items())
    )


def test_the_owed_listing_names_only_what_is_still_over() -> None:
    sizes = {**module_sizes(), **function_sizes()}
    done = [
        k
        for k in OWED
        if sizes.get(k, 0) <= (MAX_FUNCTION_LINES if "::" in k else MAX_MODULE_LINES)
    ]
    assert not done, (
        "no longer over (or gone), delete from OWED in tests/unit/test_house.py: " + ", ".join(done)
    )
