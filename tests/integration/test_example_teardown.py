"""The DDP examples and the engine's worker free their process group, and its threads,
before the interpreter ends.

Under load a gloo worker thread can still be releasing its last collective when Python shuts
down; it then wants the GIL and the process aborts ("terminate called without an active
exception", exit -6): CI saw the reference run of tests/integration/test_sdk_torchrun.py end
so, and a core dump under stress-ng showed the thread. The examples' teardown frees the
group while Python runs, so no such thread is left. Each example runs here as `__main__` in a
world of one rank (a fresh process) and names the threads left after its teardown; before
the fix the gloo group's threads were all still there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from unbroken.diagnostics.check import free_port

pytestmark = pytest.mark.integration

RUN = """
import json, os, runpy, sys
sys.argv = [sys.argv[1], "--steps", "3"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
tasks = os.listdir("/proc/self/task")
print(json.dumps([open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]))
"""


@pytest.mark.parametrize(
    "module",
    [
        "unbroken.trainer.examples.ddp_plain",
        "unbroken.trainer.examples.ddp_unbroken",
        "unbroken.trainer.run",
    ],
    ids=["ddp_plain", "ddp_unbroken", "engine"],
)
def test_the_script_leaves_no_thread_of_its_group(module: str, tmp_path: object) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "UNBROKEN_AGENT_SOCKET": os.path.join(str(tmp_path), "no-agent.sock"),
    }
    out = subprocess.run(
        [sys.executable, "-c", RUN, module],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    threads = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(threads) == 1, threads  # the main thread alone: the group's threads joined
