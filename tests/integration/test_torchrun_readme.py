"""The torchrun page's commands (docs/getting-started/torchrun.md), run as written.

The commands below are the section's lines (the page holds them verbatim); the test changes
only what a single machine needs: the host (`driver-host` -> 127.0.0.1), a free port instead
of 50051 (read back from the driver's --port-file), one process per node instead of 8, and
the training script's own arguments. Nothing else is set: no UNBROKEN_RDZV_KEY, no token,
no variable the section does not name (the environment is scrubbed of UNBROKEN_*). A worker
is SIGKILLed mid-run; torch's elastic agents restart both nodes through the driver and the
job trains to its last step. Then the operator evicts one of the nodes, which only torchrun
ever used (no `unbroken agent` registered it), and the driver refuses it from then on.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from tests.integration.rdzvscript import TRAIN
from unbroken.cli.cluster import stop_groups
from unbroken.common.tls import TlsConfig, channel_credentials
from unbroken.proto import rendezvous_pb2 as rpb
from unbroken.proto import rendezvous_pb2_grpc as rgrpc

pytestmark = pytest.mark.integration

# The torchrun page's commands (docs/getting-started/torchrun.md), line by line; a test below
# checks the page still holds each of them verbatim.
README = """
unbroken certs ca --dir pki
unbroken certs issue driver:main --dir pki --host driver-host
unbroken certs issue node:node-1 --dir pki
unbroken certs issue node:node-2 --dir pki
unbroken certs issue operator:me --dir pki
unbroken driver --listen 0.0.0.0:50051 --job-id train-7 --etcd-data-dir etcd-data --archive-url none --tls-cert pki/driver-main.crt --tls-key pki/driver-main.key --tls-ca pki/ca.pem
torchrun --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=unbroken --rdzv-endpoint=driver-host:50051 --rdzv-id=train-7-run1 --rdzv-conf node_id=node-1,tls_cert=pki/node-node-1.crt,tls_key=pki/node-node-1.key,tls_ca=pki/ca.pem,last_call_timeout=3 --max-restarts=3 train.py
torchrun --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=unbroken --rdzv-endpoint=driver-host:50051 --rdzv-id=train-7-run1 --rdzv-conf node_id=node-2,tls_cert=pki/node-node-2.crt,tls_key=pki/node-node-2.key,tls_ca=pki/ca.pem,last_call_timeout=3 --max-restarts=3 train.py
unbroken evict node-2 --driver driver-host:50051 --tls-cert pki/operator-me.crt --tls-key pki/operator-me.key --tls-ca pki/ca.pem
unbroken events --driver driver-host:50051 --tls-cert pki/operator-me.crt --tls-key pki/operator-me.key --tls-ca pki/ca.pem --json
"""  # noqa: E501
STEPS = 20


def _lines() -> list[list[str]]:
    return [shlex.split(line) for line in README.strip().splitlines()]


def _argv(words: list[str], port: int | None = None) -> list[str]:
    """A README line as this machine runs it (see the module docstring)."""
    out: list[str] = []
    for w in words:
        w = w.replace("driver-host", "127.0.0.1")
        if port is not None:
            w = w.replace(":50051", f":{port}")
        if w == "--nproc-per-node=8":
            w = "--nproc-per-node=1"
        out.append(w)
    if out[0] == "unbroken":
        return [sys.executable, "-m", "unbroken.cli", *out[1:]]
    assert out[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", *out[1:]]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"{argv}: {r.returncode}\n{r.stderr[-3000:]}"
    return r


def _rows(tmp: Path, tag: str) -> list[list[str]]:
    p = tmp / f"log-{tag}"
    return [line.split() for line in p.read_text().splitlines()] if p.exists() else []


def test_the_readme_torchrun_section_trains_through_a_killed_worker(tmp_path: Path) -> None:
    lines = _lines()
    for words in lines[:5]:  # the CA and the certificates
        _run(_argv(words), tmp_path)
    driver_words = lines[5]
    port_file = tmp_path / "driver.json"
    argv = [
        *_argv(driver_words),
        "--port-file",
        str(port_file),
    ]
    argv[argv.index("0.0.0.0:50051")] = "127.0.0.1:0"  # a free port on loopback
    procs: list[subprocess.Popen[bytes]] = []
    with open(tmp_path / "driver.log", "wb") as out:
        driver = subprocess.Popen(
            argv, cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    procs.append(driver)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the driver did not start within 120 s"
            time.sleep(0.2)
        port = json.loads(port_file.read_text())["grpc_port"]
        (tmp_path / "train.py").write_text(TRAIN)
        for tag, words in (("a", lines[6]), ("b", lines[7])):
            with open(tmp_path / f"torchrun-{tag}.log", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [*_argv(words, port), str(tmp_path), str(STEPS)],
                        cwd=tmp_path,
                        env=_env(NODE_TAG=tag),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        nodes = procs[1:]
        deadline = time.monotonic() + 300
        while len(_rows(tmp_path, "b")) < 3:
            for p in nodes:
                assert p.poll() is None, _tail(tmp_path)
            assert time.monotonic() < deadline, "3 steps not trained within 300 s\n" + _tail(
                tmp_path
            )
            time.sleep(0.2)
        os.kill(int((tmp_path / "pid-b").read_text()), signal.SIGKILL)  # a worker dies
        for p in nodes:
            p.wait(300)
        assert [p.returncode for p in nodes] == [0, 0], _tail(tmp_path)
        ckpt = json.loads((tmp_path / "ckpt.json").read_text())
        assert ckpt == {"step": STEPS, "world": 2}  # trained to the end, both nodes
        assert {r[0] for r in _rows(tmp_path, "b")} == {"0", "1"}  # b's agent restarted it
        assert int(_rows(tmp_path, "a")[-1][1]) == STEPS

        # the operator evicts node-2, a node only torchrun used
        evict = _run(_argv(lines[8], port), tmp_path)
        assert "node-2" in evict.stdout, evict.stdout
        out = _run(_argv(lines[9], port), tmp_path).stdout
        events = [json.loads(line) for line in out.splitlines()]  # one event per line
        evicted = [e for e in events if "node_evicted" in e]
        assert [e["node_evicted"]["node_id"] for e in evicted] == ["node-2"], events[-5:]
        refused = _get_state_as(tmp_path, port, "node-2")
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "node-2 was evicted" in (refused.details() or "")
    finally:
        stop_groups(procs, grace_s=15)
        for f in tmp_path.glob("pid-*"):
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def _get_state_as(tmp: Path, port: int, node: str) -> grpc.RpcError:
    """What the driver answers node `node`'s torchrun agent now (with its certificate)."""
    pki = tmp / "pki"
    cert, key = pki / f"node-{node}.crt", pki / f"node-{node}.key"
    tls = TlsConfig(cert=str(cert), key=str(key), ca=str(pki / "ca.pem"))
    caller = rpb.Caller(run_id=f"run-{uuid.uuid4().hex[:6]}", node_id=node)
    with grpc.secure_channel(f"127.0.0.1:{port}", channel_credentials(tls)) as ch:
        try:
            rgrpc.RendezvousStub(ch).GetState(rpb.GetStateRequest(caller=caller), timeout=30)
        except grpc.RpcError as e:
            return e
    raise AssertionError(f"the driver let evicted {node} rendezvous")


def _tail(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))


def test_the_page_holds_these_lines() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs/getting-started/torchrun.md").read_text()
    missing = [line for line in README.strip().splitlines() if line not in page.splitlines()]
    assert not missing, f"docs/getting-started/torchrun.md lost these lines: {missing}"
