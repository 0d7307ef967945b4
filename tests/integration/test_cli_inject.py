"""`unbroken inject` and `unbroken selfcheck` against a real driver and real agents.

A driver process on real etcd (no job), agent n0 with one real worker process (a sleeper
that the crash fault kills) and agent n1 without workers. The CLI runs as a subprocess,
as an operator would run it; the asserts are on exit codes, messages, the event log and
the processes. Most commands run in this process through the console script's `main` (the
same code; a Python start costs seconds on a loaded 2-core machine); one runs as a real
subprocess.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.test_selfcheck_report import WAIT_S, Cluster, until
from unbroken.cli import main as cli

pytestmark = pytest.mark.integration

SLEEPER = f"{sys.executable} -c 'import time; time.sleep(600)'"


class Run:
    """The outcome of one command."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

    def __repr__(self) -> str:
        return f"Run({self.returncode}, stdout={self.stdout!r}, stderr={self.stderr!r})"


@pytest.fixture
def unbroken(
    cluster: Cluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Run]:
    """`unbroken ARGS --driver <ours>` through the console script's main, in this process."""
    monkeypatch.setenv("COLUMNS", "200")

    def call(*args: str) -> Run:
        capsys.readouterr()
        rc = cli.main([*args, "--driver", cluster.address])
        out, err = capsys.readouterr()
        return Run(rc, out, err)

    return call


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, etcd_server: object) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("inject"), etcd_server.endpoint)  # type: ignore[attr-defined]
    try:
        c.start_driver()
        c.start_agent("n0", "--worker-cmd", SLEEPER, "--no-flash")
        c.start_agent("n1")
        until(
            "both agents' registration self-checks",
            lambda: {s.node_id for s in c.self_checks()} >= {"n0", "n1"},
            WAIT_S,
            c.logs,
        )
        yield c
    finally:
        c.close()


def test_bad_input_is_refused_with_a_clear_message(unbroken: Callable[..., Run]) -> None:
    r = unbroken("inject", "gpu-on-fire", "--node", "n0")
    assert r.returncode == 2, r
    assert "unknown fault 'gpu-on-fire'" in r.stderr and "wrong-matmul" in r.stderr, r.stderr

    r = unbroken("inject", "crash", "--node", "nosuch")
    assert r.returncode == 2, r
    assert "'nosuch' is not known" in r.stderr and "unbroken nodes" in r.stderr, r.stderr

    r = unbroken("selfcheck", "--node", "nosuch")
    assert r.returncode == 2, r
    assert "'nosuch' is not known" in r.stderr, r.stderr

    # n1 runs no workers: the agent refuses, the command says why and exits 1
    r = unbroken("inject", "crash", "--node", "n1")
    assert r.returncode == 1, r
    assert "runs no workers" in r.stderr, r.stderr


def test_hang_crash_and_nan_reach_the_worker(
    cluster: Cluster, unbroken: Callable[..., Run]
) -> None:
    r = unbroken("inject", "hang", "--node", "n0", "--rank", "0")
    assert r.returncode == 0, r
    m = re.search(r"SIGSTOP to local rank 0 \(pid (\d+)\)", r.stdout)
    assert m, r.stdout
    hung = psutil.Process(int(m[1]))
    until("the worker stopped", lambda: hung.status() == psutil.STATUS_STOPPED, 30, cluster.logs)

    r = unbroken("inject", "crash", "--node", "n0", "--rank", "0")
    assert r.returncode == 0, (r.stdout, r.stderr)
    m = re.search(r"SIGKILL to local rank 0 \(pid (\d+)\)", r.stdout)
    assert m and int(m[1]) == hung.pid, r.stdout
    until("the worker gone", lambda: not psutil.pid_exists(int(m[1])), 30, cluster.logs)
    kids = [c.pid for c in psutil.Process(cluster.procs["n0"].pid).children()]
    assert int(m[1]) not in kids

    r = unbroken("inject", "nan", "--node", "n0", "--step", "7", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert json.loads(r.stdout)["ok"] is True
    fault = json.loads(Path(cluster.tmp / "logs-n0" / "fault.json").read_text())
    assert fault["kind"] == "nan" and fault["step"] == 7 and len(fault["id"]) == 32, fault

    events = cluster.events()
    injects = [e for e in events if e.HasField("operator_action")]
    injects = [e for e in injects if e.operator_action.action == "inject"]
    assert [(e.operator_action.target, e.cause) for e in injects][-3:] == [
        ("n0", "inject hang rank=0"),
        ("n0", "inject crash rank=0"),
        ("n0", "inject nan step=7"),
    ]
    assert all(e.operator_action.who for e in injects)


def test_wrong_matmul_then_selfcheck_fails(cluster: Cluster, unbroken: Callable[..., Run]) -> None:
    r = unbroken("selfcheck", "--json")  # every connected node, all healthy so far
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert {d["node_id"]: d["ok"] for d in json.loads(r.stdout)} == {"n0": True, "n1": True}

    r = unbroken("inject", "wrong_matmul", "--node", "n1")  # `_` is accepted for `-`
    assert r.returncode == 0, (r.stdout, r.stderr)
    # the console script as a real process, as an operator runs it
    r = cluster.cli("selfcheck", "--node", "n1", "--node", "n0")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "FAILED" in r.stdout and "matmul" in r.stdout, r.stdout
    assert "1 node(s) failed: n1" in r.stderr, r.stderr
    last = [s for s in cluster.self_checks() if s.node_id == "n1"][-1]
    assert not last.ok and last.trigger == "on demand", last


def test_node_loss(cluster: Cluster, unbroken: Callable[..., Run]) -> None:
    """Last in the file: n0's agent is gone afterwards."""
    agent = cluster.procs["n0"]
    r = unbroken("inject", "node-loss", "--node", "n0")
    assert r.returncode == 0, r
    assert agent.wait(60) == 137, cluster.logs()  # os._exit: no goodbye, no cleanup

    def lost() -> bool:
        return any(
            e.HasField("node_lost") and e.node_lost.node_id == "n0" for e in cluster.events()
        )

    until("n0 declared lost", lost, WAIT_S, cluster.logs)
