"""The committed generated stubs match the .proto files (run `make proto` if this fails)."""

import importlib.util
import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

GEN = Path(__file__).resolve().parents[2] / "proto" / "generate.py"


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="needs grpcio-tools")
def test_generated_stubs_are_fresh() -> None:
    mod = runpy.run_path(str(GEN))
    assert mod["stale"]() == [], "stale stubs: run `make proto` and commit the result"
