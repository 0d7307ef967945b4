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

import psutil
import pytest

from tests.jobs import operator_cluster
from unbroken.cli import main as cli
from unbroken.cli.cluster import LocalCluster, until

pytestmark = pytest.mark.integration

WAIT_S = 120.0  # torch imports on 2 shared cores: generous, the asserts are on events
SLEEPER = f"{sys.executable} -c 'import time; time.sleep(600)'"


class Run:
    """The outcome of one command."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

    def __repr__(self) -> str:
        return f"Run({self.returncode}, stdout={self.stdout!r}, stderr={self.stderr!r})"


@pytest.fixture
def unbroken(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Run]:
    """`unbroken ARGS --driver <ours>` through the console script's main, in this process."""
    monkeypatch.setenv("COLUMNS", "200")

    def call(*args: str) -> Run:
        capsys.readouterr()
        rc = cli.main([*args, "--driver", cluster.driver_address()])
        out, err = capsys.readouterr()
        return Run(rc, out, err)

    return call


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, etcd_server: object
) -> Iterator[LocalCluster]:
    """A driver (no job), n0 with one sleeping worker and n1 without workers."""
    with operator_cluster(tmp_path_factory.mktemp("inject"), etcd_server, wait_s=WAIT_S) as c:
        c.start_agent("n0", ["--worker-cmd", SLEEPER, "--no-flash"])
        c.start_agent("n1")
        until(
            lambda: {s.node_id for s in c.payloads("self_check_reported")} >= {"n0", "n1"},
            WAIT_S,
            "both agents' registration self-checks",
            c.logs,
        )
        yield c


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
    cluster: LocalCluster, unbroken: Callable[..., Run]
) -> None:
    r = unbroken("inject", "hang", "--node", "n0", "--rank", "0")
    assert r.returncode == 0, r
    m = re.search(r"SIGSTOP to local rank 0 \(pid (\d+)\)", r.stdout)
    assert m, r.stdout
    hung = psutil.Process(int(m[1]))
    until(lambda: hung.status() == psutil.STATUS_STOPPED, 30, "the worker stopped", cluster.logs)

    r = unbroken("inject", "crash", "--node", "n0", "--rank", "0")
    assert r.returncode == 0, (r.stdout, r.stderr)
    m = re.search(r"SIGKILL to local rank 0 \(pid (\d+)\)", r.stdout)
    assert m and int(m[1]) == hung.pid, r.stdout
    until(lambda: not psutil.pid_exists(int(m[1])), 30, "the worker gone", cluster.logs)
    kids = [c.pid for c in psutil.Process(cluster.procs["n0"].pid).children()]
    assert int(m[1]) not in kids

    r = unbroken("inject", "nan", "--node", "n0", "--step", "7", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert json.loads(r.stdout)["ok"] is True
    fault = json.loads((cluster.worker_dir("n0") / "fault.json").read_text())
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


def test_wrong_matmul_then_selfcheck_fails(
    cluster: LocalCluster, unbroken: Callable[..., Run]
) -> None:
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
    last = [s for s in cluster.payloads("self_check_reported") if s.node_id == "n1"][-1]
    assert not last.ok and last.trigger == "on demand", last


def test_node_loss(cluster: LocalCluster, unbroken: Callable[..., Run]) -> None:
    """Last in the file: n0's agent is gone afterwards."""
    agent = cluster.procs["n0"]
    r = unbroken("inject", "node-loss", "--node", "n0")
    assert r.returncode == 0, r
    assert agent.wait(60) == 137, cluster.logs()  # os._exit: no goodbye, no cleanup

    def lost() -> bool:
        return any(
            e.HasField("node_lost") and e.node_lost.node_id == "n0" for e in cluster.events()
        )

    until(lost, WAIT_S, "n0 declared lost", cluster.logs)
