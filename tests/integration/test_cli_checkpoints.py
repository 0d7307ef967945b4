"""`unbroken checkpoints` against a real driver, real agents and workers with flash memory.

Two agents (a world of 2 ranks, one worker each) persist to one shared directory. The
workers save a flash copy (a small tensor filled with the step) only when their agent
forwards a FlashSave, at the step it names, the way a script under the hooks SDK does; so
a checkpoint is committed only if `checkpoints --request` reaches every rank, both save
the same step, both agents persist and report it and the driver commits it. The command
is judged by its exit code and output; `--request --wait` runs as a real process
(`python -m unbroken.cli`), the others through the same `main()` in this process,
since each interpreter start-up costs seconds on a loaded machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import Procs, start_agent, start_driver, wait_nodes
from unbroken.cli.cluster import CLI
from unbroken.diagnostics.check import free_port
from unbroken.recovery.persist import read_shard

pytestmark = pytest.mark.integration

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_DRIVER": "127.0.0.1:1"}  # no default

WORKER = """
import os, time
import torch
from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.trainer.flashckpt import FlashEnv
from unbroken.trainer.hooks import install

h = install(stack_signal=False)
env = FlashEnv.from_env()
writer = FlashWriter(int(os.environ["RANK"]), FlashOwner(FlashConfig(root=env.root, job=env.job)))
state = {"w": torch.zeros(4096)}
writer.prepare(state)
step, want = 0, None
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    step += 1
    state["w"].fill_(step)
    for c in h.commands():
        if c.WhichOneof("kind") == "flash_save":
            want = c.flash_save
    if want is not None and step >= want:  # the step asked for, or at once when past it
        writer.save(state, step).wait()
        want = None
    h.step(step, loss=1.0 / step)
    time.sleep(0.1)
"""


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "checkpoints", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        check=False,
    )


def inproc(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`unbroken checkpoints ARGS` run in this process (interpreter start-ups cost seconds on
    a loaded machine); the same code path as the console script."""
    from unbroken.cli.main import main

    capsys.readouterr()
    code = main(["checkpoints", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["checkpoints", *args], code, out, err)


@pytest.fixture(scope="module")
def cluster(etcd_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ckpt")
    procs = Procs(tmp)
    script = tmp / "worker.py"
    script.write_text(WORKER)
    storage = tmp / "storage"
    nodes = [f"c{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    try:
        job = f"ckpt-{uuid.uuid4().hex[:8]}"
        args = ("--etcd", etcd_server.endpoint, "--job-id", job, "--miss-limit", "100")
        addr, stub = start_driver(procs, tmp, *args)
        for i, node in enumerate(nodes):
            start_agent(
                procs, addr, node,
                "--worker-cmd", f"{sys.executable} {script}",
                "--nnodes", "2", "--node-rank", str(i),
                "--flash-dir", str(tmp / f"flash-{node}"),
                "--persist-url", str(storage),
            )  # fmt: skip
        wait_nodes(stub, nodes, "stepping", timeout_s=120)
        yield {"driver": addr, "nodes": nodes, "storage": storage, "tmp": tmp}
    finally:
        procs.stop_all()


def test_list_before_any_checkpoint(
    cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    r = inproc(capsys, "--driver", cluster["driver"], "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["checkpoints"] == []
    assert [n["node_id"] for n in data["nodes"]] == cluster["nodes"]
    assert all(int(n["live_step"]) > 0 for n in data["nodes"])
    table = inproc(capsys, "--driver", cluster["driver"])
    assert table.returncode == 0 and "no checkpoint committed yet" in table.stdout


def test_request_wait_then_list(
    cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    r = cli("--driver", cluster["driver"], "--request", "--wait", "--json")  # a real process
    assert r.returncode == 0, r.stderr
    resp = json.loads(r.stdout)
    step, committed = int(resp["step"]), int(resp["committed_step"])
    assert resp["node_ids"] == cluster["nodes"] and committed >= step > 0
    assert resp["uri"].startswith(str(cluster["storage"]))
    listed = json.loads(inproc(capsys, "--driver", cluster["driver"], "--json").stdout)
    ck = listed["checkpoints"][-1]
    assert int(ck["step"]) == committed and ck["ranks"] == 2 and int(ck["bytes"]) > 0
    assert int(ck["wall_time_unix_ns"]) > 0 and ck["shards_error"] == ""
    shards = ck["shards"]
    assert [s["rank"] for s in shards] == [0, 1]
    assert [s["node_id"] for s in shards] == cluster["nodes"]  # rank i runs on node i
    for s in shards:
        manifest, data = read_shard(s["uri"])
        assert manifest.step == committed and int(s["bytes"]) > len(data) > 0
    by_node = {n["node_id"]: n for n in listed["nodes"]}
    for i, node in enumerate(cluster["nodes"]):
        assert int(by_node[node]["persisted_step"]) == committed
        assert by_node[node]["ranks"] == [i]
    table = inproc(capsys, "--driver", cluster["driver"])
    assert table.returncode == 0, table.stderr
    assert "committed checkpoints" in table.stdout and "flash copies by node" in table.stdout
    assert str(committed) in table.stdout and cluster["nodes"][0] in table.stdout


def test_request_without_wait(cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    r = inproc(capsys, "--driver", cluster["driver"], "--request")
    assert r.returncode == 0, r.stderr
    assert "asked 2 nodes" in r.stdout and "to checkpoint step" in r.stdout


def test_wait_times_out_with_a_reason(
    cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    # a step far ahead: nobody reaches it within the wait
    r = inproc(
        capsys,
        "--driver",
        cluster["driver"],
        "--request",
        "--wait",
        "--wait-timeout",
        "2",
        "--lead-steps",
        "100000",
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "no checkpoint at step" in r.stderr and "should_save" in r.stderr


def test_unreadable_storage_is_reported(
    cluster: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # a table wide enough that no cell wraps
    storage: Path = cluster["storage"]
    aside = storage.with_name("storage-aside")
    storage.rename(aside)
    try:
        r = inproc(capsys, "--driver", cluster["driver"], "--json")
    finally:
        aside.rename(storage)
    assert r.returncode == 0, r.stderr
    ck = json.loads(r.stdout)["checkpoints"][-1]
    assert ck["shards"] == [] and "cannot list" in ck["shards_error"]
    assert ck["ranks"] == 2  # the event still says what was committed
    # only the step's directory gone (the agents' retention removed it): pruned, no error
    step_dir = Path(ck["uri"])
    step_dir.rename(step_dir.with_name("aside"))
    try:
        r = inproc(capsys, "--driver", cluster["driver"], "--json")
        table = inproc(capsys, "--driver", cluster["driver"])
    finally:
        step_dir.with_name("aside").rename(step_dir)
    ck = json.loads(r.stdout)["checkpoints"][-1]
    assert ck["pruned"] is True and ck["shards"] == [] and ck["shards_error"] == ""
    assert "pruned by retention" in table.stdout


@pytest.mark.parametrize(
    "args,words",
    [
        (["--wait"], "--wait needs --request"),
        (["--request", "--wait", "--wait-timeout", "0"], "--wait-timeout"),
        (["--request", "--lead-steps", "-1"], "--lead-steps"),
        (["--driver", "nohost"], "HOST:PORT"),
    ],
    ids=str,
)
def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str], args: list[str], words: str) -> None:
    r = inproc(capsys, *args)
    assert r.returncode == 2 and words in r.stderr, r.stderr


@pytest.mark.parametrize("args", [[], ["--request"], ["--request", "--wait"]], ids=str)
def test_unreachable_driver_exits_3(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    r = inproc(capsys, *args, "--driver", f"127.0.0.1:{free_port()}", "--timeout", "3")
    assert r.returncode == 3 and "cannot reach the driver" in r.stderr, r.stderr


def test_table_helpers() -> None:
    from unbroken.cli.checkpoints import human_bytes, shards_text, when
    from unbroken.proto import driver_pb2 as dpb

    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB"
    assert when(0) == "?" and when(1_700_000_000 * 10**9).startswith("2023-11-14")
    many = dpb.CheckpointInfo(
        shards=[dpb.ShardInfo(rank=r, bytes=1024 * (r + 1), node_id=f"n{r // 2}") for r in range(6)]
    )
    assert shards_text(many) == "6 files on 3 nodes, 1.0 KiB-6.0 KiB each"
    assert shards_text(dpb.CheckpointInfo(pruned=True)) == "pruned by retention"


def test_cli_does_not_import_torch() -> None:
    # every operator command imports the client; torch would cost seconds per command
    code = "import sys, unbroken.cli.checkpoints; sys.exit('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], env=ENV, timeout=120, check=False)
    assert r.returncode == 0
