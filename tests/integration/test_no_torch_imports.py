"""The driver and the node agent never import torch.

torch costs 1-5 s and hundreds of MB per process on a loaded machine: a driver that
imports it takes that long to start (or to take over), and every GPU node pays it in the
agent. Only workers (trainer/, the check workload's child process) import torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "module",
    ["unbroken.driver.main", "unbroken.cli.main", "unbroken.agent.main", "unbroken.agent.daemon"],
)
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False", f"{module} imports torch (python -X importtime tells who)"
