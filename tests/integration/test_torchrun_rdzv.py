"""`torchrun --rdzv-backend=unbroken` against a real driver process on a real etcd.

One driver (with a bearer token) per module. The fast tests drive the client pieces
(DriverStore, DriverRendezvousBackend) in this process against it: store semantics,
compare-and-set, the etcd keys, auth, an unreachable driver, an evicted node. The
done-when test runs two real torchrun agents of one worker each, SIGKILLs one worker
mid-run and checks that torch's elastic agents restart both, re-rendezvous through the
driver and finish the job from the script's checkpoint. Scale down/up with a hot spare,
and a refused evicted torchrun, are `slow` (several torchrun start-ups each).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from tests.integration.rdzvscript import TRAIN
from tests.jobs import reference
from tests.procs import native_stacks
from unbroken.agent import rdzv
from unbroken.cli.cluster import read_metrics, stop_groups
from unbroken.diagnostics.check import free_port
from unbroken.driver.etcd import etcd_bin_dir
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

# `alone`: make test runs this file after the others, with nothing beside it. With a second
# test file running beside it (pytest-xdist), the in-job test's kept rank hung twice in about
# ten runs (once before it held, once after its last step: docs/testing.md); one at a time,
# under stress-ng -c 2 too, it did not.
pytestmark = [pytest.mark.integration, pytest.mark.alone]

CLI = [sys.executable, "-m", "unbroken.cli"]
TOKEN = "rdzv-test-token-0123456789"  # the nodes' (torchrun agents') role token
VIEWER = "rdzv-viewer-token-0123456789"
BOUND = "rdzv-bound-token-0123456789"  # + the node id: each evicted node's own token
EVICTED = ("bad-api", "bad-torchrun")  # the nodes the eviction tests register and evict
OPERATOR = "rdzv-operator-token-0123456789"


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def driver(etcd_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("rdzv")
    port_file = tmp / "driver.json"
    job = f"rdzv-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tokens = tmp / "node.tokens"
    # the rendezvous takes the unbound token; Register needs one bound to the node id
    tokens.write_text(TOKEN + "\n" + "".join(f"{BOUND}-{n} {n}\n" for n in EVICTED))
    tokens.chmod(0o600)  # token files must be private
    viewers = tmp / "viewer.tokens"
    viewers.write_text(VIEWER + "\n")
    viewers.chmod(0o600)  # token files must be private
    operators = tmp / "operator.tokens"
    operators.write_text(OPERATOR + "\n")
    operators.chmod(0o600)  # token files must be private
    with open(tmp / "driver.log", "wb") as out:
        cmd = [
            *CLI, "driver", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
            "--etcd", etcd_server.endpoint, "--job-id", job, "--token-file", f"node={tokens}",
            "--token-file", f"viewer={viewers}", "--token-file", f"operator={operators}",
            "--miss-limit", "100",
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None, (tmp / "driver.log").read_text()
            assert time.monotonic() < deadline, "driver did not start within 120 s"
            time.sleep(0.1)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"
        client = _client(address, "probe", "probe")
        client.call("GetState", client._rpb.GetStateRequest(), budget_s=60)  # leading
        client.close()
        yield {"address": address, "job": job, "tmp": tmp, "etcd": etcd_server.endpoint}
    finally:
        stop_groups([proc], grace_s=15)


def _client(
    address: str, run_id: str, node_id: str, token: str | None = TOKEN, **kw: Any
) -> rdzv.DriverClient:
    return rdzv.DriverClient(
        rdzv.RdzvClientConfig(endpoint=address, run_id=run_id, node_id=node_id, token=token, **kw)
    )


def _events(address: str) -> list[ev.Event]:
    with grpc.insecure_channel(address) as ch:
        stub = dgrpc.DriverStub(ch)
        md = (("authorization", f"Bearer {VIEWER}"),)
        return [
            r.event for r in stub.WatchEvents(dpb.WatchEventsRequest(), metadata=md, timeout=30)
        ]


def _rounds(address: str, run_id: str) -> list[ev.RendezvousRound]:
    return [
        e.rendezvous_round
        for e in _events(address)
        if e.WhichOneof("payload") == "rendezvous_round" and e.rendezvous_round.run_id == run_id
    ]


def _wait_for(what: str, cond: Any, timeout_s: float, procs: list[Any] = ()) -> None:  # type: ignore[assignment]
    deadline = time.monotonic() + timeout_s
    while not cond():
        for p in procs:
            assert p.poll() is None or p.returncode == 0, f"a process exited {p.returncode}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


def _etcd_keys(driver: dict[str, Any], run_id: str) -> list[str]:
    """The run's rendezvous keys in etcd, read with etcdctl (what an operator would do)."""
    etcdctl = str(etcd_bin_dir() / "etcdctl")
    prefix = f"/unbroken/{driver['job']}/rdzv/{run_id}/"
    cmd = [etcdctl, "--endpoints", driver["etcd"], "get", "--prefix", prefix, "--keys-only"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    return out.split()


def _torch_state(rnd: int) -> bytes:
    s = _RendezvousState()
    s.round = rnd
    s.participants = {_NodeDesc("h", 1, 0): 0}
    return pickle.dumps(s)


# ---------------------------------------------------------------- the client pieces


def test_store_semantics_through_the_driver(driver: dict[str, Any]) -> None:
    client = _client(driver["address"], f"store-{uuid.uuid4().hex[:6]}", "n-store")
    store = rdzv.DriverStore(client)
    try:
        store.set("a", b"1")
        assert store.get("a") == b"1"
        # what torch's agent does: a PrefixStore over ours
        prefixed = dist.PrefixStore("torch.rendezvous.x.0", store)
        prefixed.set("MASTER_ADDR", "127.0.0.1")
        assert store.get("torch.rendezvous.x.0/MASTER_ADDR") == b"127.0.0.1"
        assert prefixed.multi_get(["MASTER_ADDR"]) == [b"127.0.0.1"]

        # a blocking get returns when another caller sets the key
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(store.get("later")))
        reader.start()
        time.sleep(0.5)
        rdzv.DriverStore(_client(driver["address"], client.config.run_id, "n-other")).set(
            "later", b"x"
        )
        reader.join(30)
        assert got == [b"x"]

        # concurrent adds never lose an increment and each caller sees its own result
        results: list[int] = []
        lock = threading.Lock()

        def adder() -> None:
            s = rdzv.DriverStore(_client(driver["address"], client.config.run_id, "n-add"))
            for _ in range(5):
                v = s.add("counter", 1)
                with lock:
                    results.append(v)

        threads = [threading.Thread(target=adder) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == list(range(1, 21))

        assert store.compare_set("cas", b"", b"v1") == b"v1"
        assert store.compare_set("cas", b"wrong", b"v2") == b"v1"
        assert store.compare_set("cas", b"v1", b"v2") == b"v2"
        assert store.check(["a", "cas"]) and not store.check(["a", "nope"])
        with pytest.raises(dist.DistStoreError, match=r"\['nope'\]"):
            store.wait(["a", "nope"], timedelta(seconds=0.5))
        store.set_timeout(timedelta(seconds=0.5))
        with pytest.raises(dist.DistStoreError, match="waiting for key 'nope'"):
            store.get("nope")
        n = store.num_keys()
        assert n >= 5
        assert store.delete_key("a") and not store.delete_key("a")
        assert store.num_keys() == n - 1
    finally:
        client.close()


def test_backend_compare_and_set_and_the_etcd_keys(driver: dict[str, Any]) -> None:
    run_id = f"cas-{uuid.uuid4().hex[:6]}"
    backend = rdzv.DriverRendezvousBackend(_client(driver["address"], run_id, "n-cas"))
    assert backend.name == "unbroken"
    assert backend.get_state() is None
    first = _torch_state(0)
    state, token, ok = backend.set_state(first, None)
    assert ok and state == first and token > 0
    # token None again: the state exists, so it is returned unchanged
    assert backend.set_state(_torch_state(5), None) == (first, token, False)
    second = _torch_state(1)
    state2, token2, ok2 = backend.set_state(second, token)
    assert ok2 and state2 == second and token2 > token
    # a stale token loses and learns the current state
    assert backend.set_state(_torch_state(9), token) == (second, token2, False)
    assert backend.get_state() == (second, token2)
    # the state sits in etcd v3 under the job's prefix
    assert _etcd_keys(driver, run_id) == [f"/unbroken/{driver['job']}/rdzv/{run_id}/state"]


def test_wrong_token_and_unreachable_driver_say_what_to_do(driver: dict[str, Any]) -> None:
    bad = _client(driver["address"], "auth", "n-auth", token="not-the-token-at-all")
    with pytest.raises(RendezvousConnectionError, match=r"refused our credentials.*UNBROKEN_TOKEN"):
        rdzv.DriverRendezvousBackend(bad).get_state()
    nobody = _client("127.0.0.1:1", "x", "n-x", retry_timeout_s=1.0, rpc_timeout_s=1.0)
    with pytest.raises(RendezvousConnectionError, match=r"driver at 127\.0\.0\.1:1 is unreachable"):
        rdzv.DriverRendezvousBackend(nobody).get_state()
    with pytest.raises(dist.DistNetworkError, match=r"127\.0\.0\.1:1 is unreachable"):
        rdzv.DriverStore(nobody).set("k", b"v")
    # a list of drivers (a leader and its standbys): a dead one is skipped
    several = _client(f"127.0.0.1:1,{driver['address']}", "many", "n-many", retry_timeout_s=30)
    assert rdzv.DriverRendezvousBackend(several).get_state() is None
    assert several.endpoint == driver["address"]


def _register_and_evict(address: str, node_id: str) -> None:
    md = (("authorization", f"Bearer {BOUND}-{node_id}"),)
    with grpc.insecure_channel(address) as ch:
        stub = dgrpc.DriverStub(ch)
        stub.Register(
            dpb.RegisterRequest(node_id=node_id, epoch=time.time_ns(), hostname="h"),
            metadata=md,
            timeout=30,
        )
        stub.Evict(
            dpb.EvictRequest(node_id=node_id, reason="diagnosis: bad all-gather"),
            metadata=(("authorization", f"Bearer {OPERATOR}"),),
            timeout=30,
        )


def test_an_evicted_node_is_refused(driver: dict[str, Any]) -> None:
    run_id = f"evict-{uuid.uuid4().hex[:6]}"
    node = EVICTED[0]
    backend = rdzv.DriverRendezvousBackend(_client(driver["address"], run_id, node))
    assert backend.get_state() is None  # admitted before the eviction
    _register_and_evict(driver["address"], node)
    deadline = time.monotonic() + 30
    with pytest.raises(rdzv.NodeEvictedError, match=f"node {node} was evicted") as info:
        while time.monotonic() < deadline:  # the driver refreshes its evicted set each second
            backend.get_state()
            time.sleep(0.2)
    assert "UNBROKEN_NODE_ID" in str(info.value)
    with pytest.raises(rdzv.NodeEvictedError):  # the store refuses it too
        rdzv.DriverStore(backend.client).set("k", b"v")
    # a healthy node of the same run is still served
    assert (
        rdzv.DriverRendezvousBackend(_client(driver["address"], run_id, "good")).get_state() is None
    )
    _wait_for(
        "RendezvousRefused in the log",
        lambda: any(
            e.WhichOneof("payload") == "rendezvous_refused" and e.rendezvous_refused.node_id == node
            for e in _events(driver["address"])
        ),
        30,
    )


# ---------------------------------------------------------------- real torchrun


def _torchrun(
    driver: dict[str, Any],
    tmp: Path,
    run_id: str,
    tag: str,
    nnodes: str,
    steps: int,
    *,
    step_s: float = 0.2,
    node_id: str | None = None,
    in_job: bool = False,
) -> subprocess.Popen[bytes]:
    script = tmp / "train.py"
    if not script.exists():
        script.write_text(TRAIN)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "NODE_TAG": tag,
        "STEP_S": str(step_s),
        rdzv.TOKEN_ENV: TOKEN,
        rdzv.NODE_ID_ENV: node_id or f"tr-{tag}",
    }
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=600"
    conf += ",in_job=1" if in_job else ""
    log = open(tmp / f"torchrun-{tag}.log", "wb")
    try:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            "--nproc-per-node=1", "--rdzv-backend=unbroken",
            f"--rdzv-endpoint={driver['address']}", f"--rdzv-id={run_id}",
            "--rdzv-conf", conf, "--max-restarts=3", "--monitor-interval=0.5",
            "--local-addr=127.0.0.1", str(script), str(tmp), str(steps),
        ]  # fmt: skip
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp,  # not the repo: its stale *.egg-info could hide our entry point
            start_new_session=True,
        )
    finally:
        log.close()


def _kill_node(proc: subprocess.Popen[bytes], tmp: Path, tag: str) -> None:
    """A node dies: its torchrun agent and its worker (torch starts workers in a session
    of their own, so killing the agent's process group alone leaves the worker training)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, FileNotFoundError, ValueError):
        os.kill(int((tmp / f"pid-{tag}").read_text()), signal.SIGKILL)
    proc.wait(30)


def _kill_workers(tmp: Path) -> None:
    """Stop any worker a test left behind (they run in sessions of their own)."""
    for f in tmp.glob("pid-*"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(f.read_text()), signal.SIGKILL)


def _log_lines(tmp: Path, tag: str) -> list[tuple[str, int, int]]:
    p = tmp / f"log-{tag}"
    if not p.exists():
        return []
    rows = [line.split() for line in p.read_text().splitlines()]
    return [(r[0], int(r[1]), int(r[2])) for r in rows if len(r) == 4]


def _worker_pids(tmp: Path, tag: str) -> list[int]:
    """The worker processes that trained on node `tag`, in order."""
    pids: list[int] = []
    for line in (tmp / f"log-{tag}").read_text().splitlines():
        pid = int(line.split()[3])
        if pid not in pids:
            pids.append(pid)
    return pids


def _tail(tmp: Path, *tags: str) -> str:
    return "\n".join(f"--- {t}\n" + (tmp / f"torchrun-{t}.log").read_text()[-3000:] for t in tags)


@pytest.mark.parametrize(
    "in_job",
    [
        pytest.param(False, id="restart"),
        # the fallback: slow (another pair of torchrun start-ups) and out of the CI subset
        pytest.param(True, id="in-job-fallback", marks=pytest.mark.slow),
    ],
)
def test_torchrun_job_survives_a_killed_worker(
    driver: dict[str, Any], tmp_path: Path, in_job: bool
) -> None:
    """The script has no recovery loop: both workers restart and finish from its checkpoint.
    With in_job=1 the survivor's failure joins the in-job round as replaced (the fallback)."""
    run_id = f"job-{uuid.uuid4().hex[:6]}"
    steps = 20
    procs = [_torchrun(driver, tmp_path, run_id, t, "2", steps, in_job=in_job) for t in ("a", "b")]
    try:
        _wait_for("3 steps trained", lambda: len(_log_lines(tmp_path, "b")) >= 3, 300, procs)
        victim = int((tmp_path / "pid-b").read_text())
        os.kill(victim, signal.SIGKILL)
        for p in procs:
            p.wait(300)
        assert [p.returncode for p in procs] == [0, 0], _tail(tmp_path, "a", "b")
        if in_job:  # both nodes' workers restarted, into one in-job world
            for t in ("a", "b"):
                out = (tmp_path / f"torchrun-{t}.log").read_text()
                assert "this node's workers restart" in out, _tail(tmp_path, t)
    finally:
        stop_groups(procs, grace_s=15)
        _kill_workers(tmp_path)
    ckpt = json.loads((tmp_path / "ckpt.json").read_text())
    assert ckpt == {"step": steps, "world": 2}
    # b's agent counts a restart; a's may restart for b's re-join (a membership change,
    # which torch does not count) before its worker notices the dead peer
    assert {r for r, _, _ in _log_lines(tmp_path, "b")} == {"0", "1"}
    for tag in ("a", "b"):
        rows = _log_lines(tmp_path, tag)
        assert len(_worker_pids(tmp_path, tag)) == 2, rows  # every node's worker restarted
        assert rows[-1][1:] == (steps, 2)
        steps_seen = [s for _, s, _ in rows]
        assert steps_seen == sorted(steps_seen) and steps_seen[-1] == steps  # resumed
        assert len(steps_seen) < steps + 3, rows  # from the checkpoint, not from scratch
    if in_job:
        return  # one torch round: the in-job world kept its membership
    rounds = _rounds(driver["address"], run_id)
    full = [r for r in rounds if not r.closed and len(r.participants) == 2]
    # the first round, and the one after the kill (membership changes between them,
    # such as a restarting node leaving and queueing again, are events of their own)
    assert len({r.round for r in full}) >= 2, rounds
    names = " ".join(full[-1].participants)
    assert "tr-a@" in names and "tr-b@" in names
    assert rounds[-1].closed  # the finished job closed the rendezvous
    state_key = f"/unbroken/{driver['job']}/rdzv/{run_id}/state"
    _wait_for(  # the closed run's store keys are swept; its state stays
        "store keys swept", lambda: _etcd_keys(driver, run_id) == [state_key], 30
    )


@pytest.mark.slow
def test_scale_up_hot_spare_and_scale_down(driver: dict[str, Any], tmp_path: Path) -> None:
    """--nnodes=1:2 with three agents, one after another.

    a trains alone; b joins (scale up: a's agent restarts its worker into a world of 2);
    c arrives beyond max nodes and waits as a hot spare; b's node dies (its whole agent
    is SIGKILLed): the spare c takes its place; then c dies too: a goes on alone (scale
    down). The script's checkpoint carries the step count through every change.
    """
    run_id = f"elastic-{uuid.uuid4().hex[:6]}"

    def worlds(tag: str) -> set[int]:
        return {w for _, _, w in _log_lines(tmp_path, tag)}

    def start(tag: str) -> subprocess.Popen[bytes]:
        return _torchrun(driver, tmp_path, run_id, tag, "1:2", 100_000, step_s=0.1)

    a = start("a")
    procs = [a]
    try:
        _wait_for("a trains alone", lambda: 1 in worlds("a"), 300, procs)
        procs.append(b := start("b"))
        _wait_for("scale up: b joins a", lambda: 2 in worlds("b"), 300, procs)
        procs.append(c := start("c"))
        _wait_for(
            "c listed as a hot spare",
            lambda: any(
                any("tr-c@" in n for n in r.spares) for r in _rounds(driver["address"], run_id)
            ),
            300,
            procs,
        )
        assert not _log_lines(tmp_path, "c")  # a spare beyond max nodes does not train
        _kill_node(b, tmp_path, "b")
        _wait_for("the spare c replaces b", lambda: 2 in worlds("c"), 300, [a, c])
        _kill_node(c, tmp_path, "c")  # and so is c
        before = len(_log_lines(tmp_path, "a"))
        _wait_for(
            "scale down: a alone again",
            lambda: any(w == 1 for _, _, w in _log_lines(tmp_path, "a")[before:]),
            300,
            [a],
        )
        (tmp_path / "stop").write_text("")
        a.wait(300)
        assert a.returncode == 0, _tail(tmp_path, "a")
    finally:
        stop_groups(procs, grace_s=15)
        _kill_workers(tmp_path)
    steps = [s for _, s, _ in _log_lines(tmp_path, "a")]
    assert steps[-1] == json.loads((tmp_path / "ckpt.json").read_text())["step"]
    assert all(x < y for x, y in itertools.pairwise(steps)), steps  # no step redone
    sizes = [len(r.participants) for r in _rounds(driver["address"], run_id) if not r.closed]
    assert 1 in sizes and 2 in sizes, sizes


@pytest.mark.slow
def test_torchrun_on_an_evicted_node_is_refused(driver: dict[str, Any], tmp_path: Path) -> None:
    node = EVICTED[1]
    _register_and_evict(driver["address"], node)
    probe = rdzv.DriverRendezvousBackend(_client(driver["address"], f"probe-{node}", node))

    def refused() -> bool:  # the driver's evicted set refreshes every second
        try:
            probe.get_state()
        except rdzv.NodeEvictedError:
            return True
        return False

    _wait_for("the driver refuses the evicted node", refused, 30)
    proc = _torchrun(driver, tmp_path, f"ev-{uuid.uuid4().hex[:6]}", "x", "1", 3, node_id=node)
    try:
        proc.wait(300)
    finally:
        stop_groups([proc], grace_s=15)
    out = (tmp_path / "torchrun-x.log").read_text()
    assert proc.returncode != 0
    assert "NodeEvictedError" in out and f"node {node} was evicted" in out, out[-3000:]
    assert not _log_lines(tmp_path, "x")


# ---------------------------------------------------------------- in-job rounds (in_job=1)

# the job's steps (and its reference run's): the kill comes once 100 are seen, and the 700
# left are ~6 s of training on 2 quiet cores (120 steps/s) for the test to kill in; 1,500
# cost ~12 s more of CI in the job and its reference run, and checked nothing more
INJOB_STEPS = 800
INJOB_SCRIPT = ["-m", "unbroken.trainer.examples.ddp_in_job"]


@contextlib.contextmanager
def _flash_agent(tmp: Path, tag: str) -> Iterator[Path]:
    """A node's `unbroken agent --no-start`: it owns the node's flash memory and hook socket
    (torchrun starts the workers); its socket."""
    sock, log = tmp / f"agent-{tag}.sock", tmp / f"agent-{tag}.log"
    args = [
        "--driver", f"127.0.0.1:{free_port()}",  # no driver: it retries in the background
        "--node-id", f"fl-{tag}", "--worker-cmd", "true", "--nproc-per-node", "1",
        "--no-start", "--socket", str(sock), "--log-dir", str(tmp / f"logs-{tag}"),
        "--flash-dir", str(tmp / f"shm-{tag}"), "--flash-job", "injob",
        "--persist-url", str(tmp / "persist"),
    ]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*CLI, "agent", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        _wait_for("the agent's flash store", lambda: "flash.ready" in log.read_text(), 120, [proc])
        yield sock
    finally:
        stop_groups([proc], grace_s=2)


def _injob_torchrun(
    driver: dict[str, Any],
    tmp: Path,
    run_id: str,
    tag: str,
    sock: Path,
    nnodes: str = "2",
    steps: int = INJOB_STEPS,
    script: tuple[str, ...] = tuple(INJOB_SCRIPT),
) -> Any:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        rdzv.TOKEN_ENV: TOKEN,
        rdzv.NODE_ID_ENV: f"tr-{tag}",
        "UNBROKEN_AGENT_SOCKET": str(sock),
    }
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=600"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
        "--rdzv-backend=unbroken", f"--rdzv-endpoint={driver['address']}",
        f"--rdzv-id={run_id}", "--rdzv-conf", f"{conf},in_job=1", "--max-restarts=3",
        "--monitor-interval=0.1", "--local-addr=127.0.0.1", *script,
        "--steps", str(steps), "--metrics-out", str(tmp / "metrics.jsonl"),
    ]  # fmt: skip
    with open(tmp / f"torchrun-{tag}.log", "wb") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True
        )


def _script_worker(
    proc: subprocess.Popen[bytes], module: str = "unbroken.trainer.examples.ddp_in_job"
) -> psutil.Process:
    """The one training worker torchrun `proc` runs now."""
    found = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if module in " ".join(p.cmdline())
    ]
    assert len(found) == 1, found
    return found[0]


def _kill_rank1_keep_rank0(
    procs: list[Any],
    tmp: Path,
    metrics: Path,
    *,
    first: int,
    past: int,
    module: str = "unbroken.trainer.examples.ddp_in_job",
) -> int:
    """After `first` steps SIGKILL the worker of rank 1 (rank 0's node picks the new world's
    port), wait for `past` more steps and both torchruns' clean end, and check rank 0's
    worker kept its pid; the index in `procs` of the node kept."""
    _wait_for(f"{first} steps", lambda: len(read_metrics(metrics)) >= first, 300, procs)
    workers = [_script_worker(p, module) for p in procs]
    keep = [w.environ()["RANK"] for w in workers].index("0")
    survivor, victim = workers[keep], workers[1 - keep]
    killed_at = max(read_metrics(metrics))
    victim.kill()
    _stacks_unless_held(survivor, tmp / f"torchrun-{'ab'[keep]}.log", 20.0)
    _wait_for(
        "training past the kill in a new world",
        lambda: (
            max(read_metrics(metrics)) > killed_at + past
            or all(p.poll() is not None for p in procs)
        ),
        300,
        procs,
    )
    kept = _script_worker(procs[keep], module).pid == survivor.pid
    assert kept, f"rank 0's worker was restarted:\n{_tail(tmp, 'a', 'b')}"
    _wait_ended(procs, tmp, 150)
    assert [p.returncode for p in procs] == [0, 0], _tail(tmp, "a", "b")
    return keep


def _stacks_unless_held(survivor: psutil.Process, log: Path, within_s: float) -> None:
    """Wait up to `within_s` for the survivor's torchrun to say its workers hold in place (in
    well under a second normally; the in-job timeout is 30 s); past it, have the survivor
    write its Python stacks into that log (the SDK's faulthandler signal) and go on. CI once
    saw the survivor never hold, under load, with nothing in its log to say where it was."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if "hold in place" in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    with contextlib.suppress(psutil.Error):
        survivor.send_signal(signal.SIGUSR1)  # trainer/hookchannel.py STACK_SIGNAL


def _wait_ended(procs: list[Any], tmp: Path, timeout_s: float) -> None:
    """Wait for both torchruns' end; if one outlives `timeout_s`, its workers' stacks say
    where they are: native ones (py-spy, in the failure) and Python's (the SDK's
    faulthandler signal, into the torchrun logs). CI once saw the kept rank 0 train its
    last step and never end: its peer passed the final barrier."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            native = []
            for q in procs:
                with contextlib.suppress(psutil.Error):
                    for c in psutil.Process(q.pid).children(recursive=True):
                        if "python" in c.name():
                            native.append(native_stacks(c.pid))  # C++ frames too (py-spy)
                            c.send_signal(signal.SIGUSR1)  # trainer/hookchannel.py STACK_SIGNAL
            time.sleep(3.0)
            pytest.fail(
                f"a torchrun did not end after training:\n{_tail(tmp, 'a', 'b')}\n"
                + "\n\n".join(native)
            )


# Two clean-clone CIs in a row (2026-12-06) saw its kept rank 0 train to its last step and
# never exit: DDP's Reducer freed the world's gloo group holding the GIL, which gloo's
# worker thread waited for (trainer/worldpin.py; tests/integration/test_world_end.py)
def test_in_job_torchrun_keeps_the_healthy_workers_process(
    driver: dict[str, Any], tmp_path: Path
) -> None:
    """`in_job=1`: rank 1's worker is SIGKILLed; its torchrun restarts it alone, rank 0's
    worker keeps its pid (its agent never restarts its group), both meet in a new world and
    every step's loss equals an uninterrupted run's (the flash restore, from the nodes'
    agents' memory)."""
    run_id = f"injob-{uuid.uuid4().hex[:6]}"
    metrics = tmp_path / "metrics.jsonl"
    with _flash_agent(tmp_path, "a") as sock_a, _flash_agent(tmp_path, "b") as sock_b:
        procs = [
            _injob_torchrun(driver, tmp_path, run_id, t, s)
            for t, s in (("a", sock_a), ("b", sock_b))
        ]
        try:
            keep = _kill_rank1_keep_rank0(procs, tmp_path, metrics, first=100, past=50)
        finally:
            stop_groups(procs, grace_s=15)
    kept, lost = ("a", "b") if keep == 0 else ("b", "a")
    kept_log = (tmp_path / f"torchrun-{kept}.log").read_text()
    lost_log = (tmp_path / f"torchrun-{lost}.log").read_text()
    assert "will restart worker group" not in kept_log, kept_log[-3000:]
    assert "this node's workers hold in place" in kept_log, kept_log[-3000:]
    assert "this node's workers restart into the new world" in lost_log, lost_log[-3000:]
    got = read_metrics(metrics)
    assert sorted(got) == list(range(1, INJOB_STEPS + 1))
    ref = reference(
        tmp_path / "reference", INJOB_STEPS, train=INJOB_SCRIPT, total_steps=INJOB_STEPS
    )
    for step, values in got.items():
        for v in values:
            assert v == ref[step], (step, v, ref[step])


@pytest.mark.slow
def test_in_job_torchrun_keeps_an_accelerate_adapters_healthy_worker(
    driver: dict[str, Any], tmp_path: Path
) -> None:
    """The same with the Accelerate adapter's example (its `recovery_loop` resets
    Accelerate's state between worlds): rank 1's worker is SIGKILLed, rank 0's keeps its
    pid, and every step's loss equals an uninterrupted run's."""
    module = "unbroken.trainer.examples.accelerate_unbroken"
    steps = 300
    script = ("-m", module, "--step-delay-s", "0.02")
    run_id = f"injob-acc-{uuid.uuid4().hex[:6]}"
    metrics = tmp_path / "metrics.jsonl"
    with _flash_agent(tmp_path, "a") as sock_a, _flash_agent(tmp_path, "b") as sock_b:
        procs = [
            _injob_torchrun(driver, tmp_path, run_id, t, s, steps=steps, script=script)
            for t, s in (("a", sock_a), ("b", sock_b))
        ]
        try:
            keep = _kill_rank1_keep_rank0(
                procs, tmp_path, metrics, first=20, past=20, module=module
            )
        finally:
            stop_groups(procs, grace_s=15)
    kept = "a" if keep == 0 else "b"
    kept_log = (tmp_path / f"torchrun-{kept}.log").read_text()
    assert "will restart worker group" not in kept_log, kept_log[-3000:]
    got = read_metrics(metrics)
    assert sorted(got) == list(range(1, steps + 1))
    ref = reference(tmp_path / "reference", steps, train=list(script), total_steps=steps)
    for step, values in got.items():
        for v in values:
            assert v == ref[step], (step, v, ref[step])


@pytest.mark.slow
def test_in_job_torchrun_through_a_lost_node(driver: dict[str, Any], tmp_path: Path) -> None:
    """`in_job=1`, --nnodes=1:2: node b dies whole (its torchrun and its worker). No node can
    open a generation for it: once torch's state drops b (its keep-alive lapses), a's agent
    restarts its held worker into torch's next round, and a trains on alone to the end."""
    run_id = f"injob-lost-{uuid.uuid4().hex[:6]}"
    metrics = tmp_path / "metrics.jsonl"
    steps = 6000

    def paired() -> bool:
        with contextlib.suppress(AssertionError, psutil.Error):
            return _script_worker(procs[1]).environ().get("WORLD_SIZE") == "2"
        return False

    with _flash_agent(tmp_path, "a") as sock_a, _flash_agent(tmp_path, "b") as sock_b:
        procs = [
            _injob_torchrun(driver, tmp_path, run_id, t, s, nnodes="1:2", steps=steps)
            for t, s in (("a", sock_a), ("b", sock_b))
        ]
        try:
            _wait_for("a world of 2", paired, 300, procs)
            worker_b = _script_worker(procs[1])
            _wait_for("steps in it", lambda: len(read_metrics(metrics)) >= 50, 300, procs)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(procs[1].pid, signal.SIGKILL)
            worker_b.kill()
            procs[1].wait(30)
            procs[0].wait(600)
            assert procs[0].returncode == 0, _tail(tmp_path, "a")
        finally:
            stop_groups(procs, grace_s=15)
    out = (tmp_path / "torchrun-a.log").read_text()
    assert "a node left the rendezvous" in out, out[-3000:]
    assert max(read_metrics(metrics)) == steps
