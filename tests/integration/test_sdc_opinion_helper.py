"""The SDC buddy's opinions in an agent: formed in a helper process, never in the agent's own
(recovery/sdcbuddy.py), and a helper's death costs one opinion."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.sdcharness import Trainer, save_fingerprinted, shm_owner
from unbroken.recovery import sdcbuddy
from unbroken.recovery.flashowner import FlashOwner
from unbroken.recovery.sdcbuddy import BuddyOpinions

pytestmark = pytest.mark.integration


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    with shm_owner() as o:
        yield o


# An agent's side, in a process of its own (no torch imported, as in an agent): the helper
# forms the opinion, a helper killed mid-job costs one opinion and the next helper forms the
# next one.
_AGENT_SIDE = """
import json, os, signal, sys
from pathlib import Path
from unbroken.recovery.flashcopy import find_copy
from unbroken.recovery.sdcbuddy import BuddyOpinions
ref = find_copy(Path(sys.argv[1]), int(sys.argv[2]))
b = BuddyOpinions(helper=True)
first = b.form("n0", ref)
for p in list(b._pool._processes.values()):
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
broken = b.form("n0", ref)
again = b.form("n0", ref)
b.close()
print(json.dumps({"torch": "torch" in sys.modules, "first": first.fingerprints,
                  "broken": broken.error, "again": again.fingerprints}))
"""


def _agent_side(owner: FlashOwner, script: str) -> tuple[dict[str, int], dict[str, Any]]:
    """A fingerprinted copy's opinion formed in this process, and what `script` (an agent's
    side, in a process of its own, given the copy's rank directory and step) printed last."""
    _, ref = save_fingerprinted(owner, Trainer(), 10)
    inline = BuddyOpinions().form("n0", ref)
    assert inline is not None and not inline.error
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script, str(owner.rank_dir(0)), "10"],
        capture_output=True, text=True, timeout=840, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return inline.fingerprints, json.loads(out.stdout.strip().splitlines()[-1])


# at nice 19 beside CPU hogs each helper's torch import (two here) took over a minute
@pytest.mark.timeout(900)
def test_an_agents_opinions_come_from_a_helper_process_and_outlive_its_death(
    owner: FlashOwner,
) -> None:
    """The agent imports no torch: its first opinion used to import it in one of its
    threads, holding the interpreter's lock long enough to stop its heartbeats for 0.5-1.1 s
    (a promoted spare, at every node loss of a bench run)."""
    inline, got = _agent_side(owner, _AGENT_SIDE)
    assert got["torch"] is False  # nothing in the agent's process imported it
    assert got["first"] == inline
    assert "the opinion helper failed" in got["broken"], got["broken"]
    assert got["again"] == got["first"]


def test_a_slow_helper_is_waited_for_and_a_hung_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper that works past the timeout (CPU time growing: a busy host's nice-19 helper)
    gives its result; one that uses no CPU for the timeout is hung: TimeoutError."""
    monkeypatch.setattr(sdcbuddy, "HELPER_TIMEOUT_S", 0.3)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        n = 100_000_000  # a second or more of one core: several timeouts
        assert sdcbuddy._result(pool, pool.submit(sum, range(n))) == n * (n - 1) // 2
        t0 = time.monotonic()
        with pytest.raises(concurrent.futures.TimeoutError):
            sdcbuddy._result(pool, pool.submit(time.sleep, 30))
        assert time.monotonic() - t0 < 20
        sdcbuddy._stop(pool)


# An agent's prestart (with its standbys): the helper imports torch before any copy comes,
# and the first copy's opinion is formed by that same process.
_PRESTART = """
import json, sys, time
from pathlib import Path
from unbroken.recovery.flashcopy import find_copy
from unbroken.recovery.sdcbuddy import BuddyOpinions
b = BuddyOpinions(helper=True)
started, again = b.prestart(), b.prestart()
pids = sorted(p.pid for p in b._pool._processes.values())
def loaded(pid):
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()
deadline = time.monotonic() + 600
while not all(loaded(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
before_copy = all(loaded(p) for p in pids)
op = b.form("n0", find_copy(Path(sys.argv[1]), int(sys.argv[2])))
after = sorted(p.pid for p in b._pool._processes.values())
b.close()
print(json.dumps({"torch": "torch" in sys.modules, "started": started, "again": again,
                  "pids": pids, "after": after, "before_copy": before_copy,
                  "fingerprints": op.fingerprints, "error": op.error}))
"""


@pytest.mark.timeout(900)
def test_a_prestarted_helper_has_torch_before_the_first_copy_and_forms_its_opinion(
    owner: FlashOwner,
) -> None:
    """A spare's agent starts its helper with its standbys: the helper's torch import
    used to run beside a promoted spare's first step (its first copies arrive then)."""
    inline, got = _agent_side(owner, _PRESTART)
    assert got["torch"] is False  # still none in the agent's own process
    assert (got["started"], got["again"]) == (True, False)  # one helper, started once
    assert len(got["pids"]) == 1 and got["after"] == got["pids"]
    assert got["before_copy"] is True
    assert not got["error"] and got["fingerprints"] == inline


def test_prestart_is_a_no_op_without_a_helper() -> None:
    """Tools and tests form opinions in their own process: nothing to start."""
    assert BuddyOpinions().prestart() is False


_ORPHANED = """
import sys, time
from unbroken.recovery.sdcbuddy import BuddyOpinions
if __name__ == "__main__":
    b = BuddyOpinions(helper=True)
    b.prestart()
    print("helper", *[p.pid for p in b._pool._processes.values()], flush=True)
    time.sleep(300)
"""


def test_a_helper_whose_agent_was_sigkilled_exits(tmp_path: Path) -> None:
    """No reaper, no shutdown: the helper notices it was re-parented and exits."""
    script = tmp_path / "agent_side.py"  # spawn re-imports the main module: a file
    script.write_text(_ORPHANED)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert agent.stdout is not None
    line = ""
    while not line.startswith("helper "):  # (its log lines come first)
        line = agent.stdout.readline()
        assert line, "the agent's side exited before its helper started"
    (helper,) = (int(x) for x in line.split()[1:])
    agent.kill()
    agent.wait(10)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:  # gone, or a zombie of whichever process reaps orphans here
            if psutil.Process(helper).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.2)
    os.kill(helper, 9)
    raise AssertionError("the orphaned helper still ran 60 s after its agent's SIGKILL")
