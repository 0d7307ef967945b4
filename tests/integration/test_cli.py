"""The operator CLI against a real driver (on the session's etcd) and real agents.

One driver process and four agent processes per module: n1 runs checks with an injected
wrong-matmul fault; n3 runs one "training" worker (a hooks-SDK loop that records every
command it receives) so `unbroken diagnose` must pause it before checking and resume it
after. Every command is run as `python -m unbroken.cli ...` and judged by its exit
code and output; a last test points each command at a port nobody listens on (exit 3).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.procs import Procs, start_agent, start_driver
from unbroken.cli.cluster import stop_groups
from unbroken.diagnostics.check import free_port
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "unbroken.cli"]
AGENTS = {"n0": "", "n1": "wrong_matmul", "n2": "", "n3": ""}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_DRIVER": "127.0.0.1:1"}

WORKER = """
import os, sys, time
from unbroken.trainer.hooks import install
h = install(stack_signal=False)
out = open(sys.argv[1], "a", buffering=1)
step = 0
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    step += 1
    h.step(step, loss=1.0)
    for c in h.commands():
        out.write(f"{c.WhichOneof('kind')} {step}\\n")
    time.sleep(0.1)
"""


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV, check=False
    )


@pytest.fixture(scope="module")
def cluster(etcd_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("cli")
    procs = Procs(tmp)
    try:
        job = f"cli-{uuid.uuid4().hex[:8]}"
        # liveness is not under test: check processes importing torch on two shared cores
        # can starve a 100 ms heartbeat past the default limit
        args = ("--etcd", etcd_server.endpoint, "--job-id", job, "--miss-limit", "100")
        driver, _ = start_driver(procs, tmp, *args)
        commands = tmp / "worker-commands.txt"
        script = tmp / "worker.py"
        script.write_text(WORKER)
        agents = {}
        for node, fault in AGENTS.items():
            cmd = f"{sys.executable} {script} {commands}"
            extra = ["--worker-cmd", cmd] if node == "n3" else []
            agents[node] = start_agent(
                procs, driver, node, "--inject-fault", fault, *extra, selfcheck=True
            )
        c = {"driver": driver, "commands": commands, "tmp": tmp, "agents": agents}
        _wait_ready(c)  # every test starts on a connected cluster, whichever runs first
        yield c
    finally:
        procs.stop_all()


def _nodes(driver: str) -> list[dict[str, Any]]:
    r = cli("nodes", "--driver", driver, "--json")
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout))


def _wait_ready(cluster: dict[str, Any]) -> None:
    """Every agent connected, and n3's worker stepping."""
    deadline = time.monotonic() + 60
    while True:
        nodes = {n["node_id"]: n for n in _nodes(cluster["driver"])}
        if set(AGENTS) <= {k for k, n in nodes.items() if n["alive"] and n["connected"]} and (
            int(nodes["n3"]["step"]) > 0
        ):
            return
        assert time.monotonic() < deadline, f"cluster not ready in 60 s: {nodes}"
        time.sleep(0.3)


def test_status_and_nodes(cluster: dict[str, Any]) -> None:
    _wait_ready(cluster)
    r = cli("status", "--driver", cluster["driver"], "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["nodes_total"] == 4 and st["nodes_alive"] == 4 and st["nodes_active"] == 4
    assert int(st["last_seq"]) >= 5  # LeaderElected + 4 NodeRegistered
    assert st["job_id"].startswith("cli-") and st["diagnosis_running"] == ""
    table = cli("status", "--driver", cluster["driver"])
    assert table.returncode == 0 and "phase" in table.stdout and "4 total" in table.stdout
    nodes = cli("nodes", "--driver", cluster["driver"])
    assert nodes.returncode == 0
    for n in AGENTS:
        assert n in nodes.stdout
    n3 = next(n for n in _nodes(cluster["driver"]) if n["node_id"] == "n3")
    assert n3["state"] == "active" and n3["workers"][0]["state"] == "WORKER_STATE_RUNNING"


def test_events_since(cluster: dict[str, Any]) -> None:
    r = cli("events", "--driver", cluster["driver"], "--json")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    seqs = [int(e["seq"]) for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    assert sum("node_registered" in e for e in events) >= 4
    tail = cli("events", "--driver", cluster["driver"], "--json", "--since", str(seqs[-2]))
    got = [int(json.loads(x)["seq"]) for x in tail.stdout.splitlines()]
    # events after seqs[-2] only; self-checks may have been appended in between
    assert got == list(range(seqs[-1], seqs[-1] + len(got))) and got, (seqs, got)
    text = cli("events", "--driver", cluster["driver"])
    assert text.returncode == 0 and "leader_elected" in text.stdout
    assert cli("events", "--driver", cluster["driver"], "--since", "-1").returncode == 2


def test_diagnose_pauses_checks_and_resumes(cluster: dict[str, Any]) -> None:
    _wait_ready(cluster)
    r = cli("diagnose", "--driver", cluster["driver"], "--nodes", "n0", "n1", "n2", "--json")
    assert r.returncode == 0, r.stderr
    verdict = json.loads(r.stdout)
    assert verdict["bad_nodes"] == ["n1"], (verdict, r.stderr)
    assert "paused training on n3" in r.stderr
    # the worker saw the pause and then the resume
    deadline = time.monotonic() + 10
    while True:
        kinds = [line.split()[0] for line in cluster["commands"].read_text().splitlines()]
        if kinds[-2:] == ["pause", "resume"]:
            break
        assert time.monotonic() < deadline, kinds
        time.sleep(0.2)
    log = cli("events", "--driver", cluster["driver"], "--json")
    kinds = []
    for line in log.stdout.splitlines():
        e = json.loads(line)
        kind = next(k for k in e if k in PAYLOADS)
        kinds.append(e[kind].get("action", kind) if kind == "operator_action" else kind)
    i = kinds.index("diagnose")
    story = [k for k in kinds[i:] if k not in ("node_registered", "self_check_reported")]
    assert story[:2] == ["diagnose", "pause"] and story[-2:] == ["diagnosis_verdict", "resume"]
    assert "diagnosis_round" in story
    # a node the driver never saw: exit 2 with a message naming it
    bad = cli("diagnose", "--driver", cluster["driver"], "--nodes", "n0", "nope")
    assert bad.returncode == 2 and "nope" in bad.stderr


# A second `unbroken diagnose`, imported and waiting for a line on stdin: started only
# once the first diagnosis shows in status, a fresh CLI process (a second or more of
# imports on loaded cores) could connect after a quick diagnosis had ended.
READY_CLI = """
import sys
import unbroken.cli.diagnose, unbroken.cli.main
print("ready", flush=True)
sys.stdin.readline()
sys.exit(unbroken.cli.main.main(sys.argv[1:]))
"""


def test_diagnose_table_and_one_at_a_time(cluster: dict[str, Any]) -> None:
    _wait_ready(cluster)
    driver = cluster["driver"]
    waiting = subprocess.Popen(
        [sys.executable, "-c", READY_CLI, "diagnose", "--driver", driver],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    procs = [waiting]
    try:
        assert waiting.stdout is not None and waiting.stdout.readline() == "ready\n"
        first = subprocess.Popen(
            [*CLI, "diagnose", "--driver", driver, "--nodes", "n0", "n2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            start_new_session=True,
        )
        procs.append(first)
        deadline = time.monotonic() + 30
        with grpc.insecure_channel(driver) as ch:  # polled in-process: a quick diagnosis
            stub = dgrpc.DriverStub(ch)  # may end between two CLI runs on loaded cores
            while not (running := stub.GetStatus(dpb.GetStatusRequest()).diagnosis_running):
                assert first.poll() is None, first.communicate()
                assert time.monotonic() < deadline, "the diagnosis never showed in status"
                time.sleep(0.02)
        _, second_err = waiting.communicate("go\n", timeout=60)
        assert waiting.returncode == 1, second_err
        assert "already running" in second_err and running in second_err
        out, err = first.communicate(timeout=120)
    finally:
        stop_groups(procs, grace_s=10)  # type: ignore[arg-type]
    assert first.returncode == 0, err
    assert "round 1:" in err and "all passed" in err
    bad_row = next(line for line in out.splitlines() if " bad " in line)
    assert "none" in bad_row, out


PAYLOADS = {f.name for f in ev.Event.DESCRIPTOR.oneofs_by_name["payload"].fields}


def test_evict_is_followed_live(cluster: dict[str, Any]) -> None:
    driver = cluster["driver"]
    last = json.loads(cli("status", "--driver", driver, "--json").stdout)["last_seq"]
    out = open(cluster["tmp"] / "follow.jsonl", "wb")
    follow = subprocess.Popen(
        [*CLI, "events", "--driver", driver, "--json", "--follow", "--since", str(last)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=ENV,
        start_new_session=True,
    )
    out.close()
    try:
        # a loaded CI machine: the recorded eviction and the agent's ack within 60 s, not 10
        r = cli("evict", "n2", "--driver", driver, "--reason", "test", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        assert "evicted n2" in r.stdout and "agent stopped" in r.stdout
        deadline = time.monotonic() + 20
        while True:
            lines = (cluster["tmp"] / "follow.jsonl").read_text().splitlines()
            got = [json.loads(x) for x in lines if x.startswith("{")]
            if any("node_evicted" in e for e in got):
                break
            assert follow.poll() is None, lines
            assert time.monotonic() < deadline, lines
            time.sleep(0.2)
        action = next(e for e in got if "operator_action" in e)["operator_action"]
        assert action["action"] == "evict" and action["target"] == "n2" and "@" in action["who"]
        ev = next(e for e in got if "node_evicted" in e)["node_evicted"]
        assert ev == {"node_id": "n2", "reason": "test", "diagnosis_id": ""}
    finally:
        stop_groups([follow], grace_s=10)
    nodes = {n["node_id"]: n for n in _nodes(driver)}
    assert nodes["n2"]["state"] == "evicted"
    again = cli("evict", "n2", "--driver", driver)
    assert again.returncode == 1 and "already evicted" in again.stderr
    unknown = cli("evict", "nope", "--driver", driver, "--json")
    assert unknown.returncode == 2 and "unbroken nodes" in unknown.stderr


def test_evict_answers_within_the_callers_deadline(cluster: dict[str, Any]) -> None:
    """An agent that never acknowledges (SIGSTOPped, still connected) must not turn a recorded
    eviction into "cannot reach the driver": the driver cuts its wait for the ack to the
    caller's deadline and answers that the agent was not reachable."""
    driver, agent = cluster["driver"], cluster["agents"]["n0"]
    agent.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = cli("evict", "n0", "--driver", driver, "--reason", "stopped", "--timeout", "3")
        took = time.monotonic() - t0
    finally:
        agent.send_signal(signal.SIGCONT)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "evicted n0" in r.stdout and "not reachable" in r.stdout, r.stdout
    assert took < 30, took  # the call itself ended by its 3 s deadline, not the 10 s ack wait
    nodes = {n["node_id"]: n for n in _nodes(driver)}
    assert nodes["n0"]["state"] == "evicted"


@pytest.mark.parametrize(
    "args", [["status"], ["nodes"], ["events"], ["evict", "n0"], ["diagnose"]], ids=str
)
def test_unreachable_driver_exits_3(args: list[str]) -> None:
    port = free_port()  # nothing listens there
    r = cli(*args, "--driver", f"127.0.0.1:{port}", timeout=60)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "cannot reach the driver" in r.stderr and "--driver" in r.stderr
