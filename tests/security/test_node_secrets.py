"""The Low findings: workers inherit no node secret, node ids are plain ASCII words, and a
token file others can read is refused.

Real processes: an `unbroken agent` starting a real worker against a real driver
service (in-process gRPC), the `unbroken driver` CLI, and the rendezvous over gRPC.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.inproc import driver, status_of, until
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import rendezvous_pb2 as rpb
from unbroken.proto import rendezvous_pb2_grpc as rgrpc

pytestmark = pytest.mark.integration

TOKEN = "n0-node-token-0123456789abcdef"
SECRETS = {
    "UNBROKEN_REPLICA_KEY": "replica-key-0123456789abcdef",
    "UNBROKEN_RDZV_KEY": "rdzv-key-0123456789abcdef",
    "UNBROKEN_RDZV_KEY_FILE": "/etc/unbroken/rdzv.key",
}


def test_workers_inherit_no_node_secret(tmp_path: Path) -> None:
    """The agent holds a token file and the job's keys in its environment; its worker's
    environment (what user code, and anything it runs, can read) has none of them."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    dump = tmp_path / "worker-env.json"
    code = f"import json,os; json.dump(dict(os.environ), open('{dump}','w'))"
    worker = f'{sys.executable} -c "{code}"'
    log = tmp_path / "agent.log"

    async def go() -> None:
        tokens = RoleTokens({"node": [f"{TOKEN} n0"]})
        async with driver(ServiceConfig(tokens=tokens)) as (_svc, _store, addr):
            env = {
                **os.environ,
                **SECRETS,
                "UNBROKEN_TOKEN_FILE": str(token),
                "OMP_NUM_THREADS": "1",
            }
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "unbroken.cli", "agent", "--driver", addr,
                "--node-id", "n0", "--no-flash", "--no-selfcheck", "--worker-cmd", worker,
                "--socket", str(tmp_path / "n0.sock"), "--log-dir", str(tmp_path / "logs"),
                env=env, stdout=log.open("wb"), stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            try:
                await until(
                    lambda: (
                        (dump.exists() and dump.stat().st_size > 0) or proc.returncode is not None
                    ),
                    120,
                    "the worker",
                )
                assert proc.returncode is None, log.read_text()[-3000:]
                await asyncio.sleep(0.5)  # the dump is written in one go; let it close
            finally:
                if proc.returncode is None:
                    proc.terminate()
                await asyncio.wait_for(proc.wait(), 30)
        seen = json.loads(dump.read_text())
        assert seen.get("RANK") == "0"  # it is the worker's environment
        leaked = {k for k in (*SECRETS, "UNBROKEN_TOKEN", "UNBROKEN_TOKEN_FILE") if k in seen}
        assert not leaked, leaked

    asyncio.run(go())


@pytest.mark.parametrize("bad", ["nоde-1", "-rf", ".hidden", "n\u200b1"])  # Cyrillic 'о'
def test_node_ids_are_plain_ascii_words(bad: str) -> None:
    async def go() -> None:
        async with driver(rendezvous=True) as (svc, _store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                reg = dgrpc.DriverStub(ch).Register(dpb.RegisterRequest(node_id=bad, epoch=1))
                assert await status_of(reg) == grpc.StatusCode.INVALID_ARGUMENT
                caller = rpb.Caller(run_id="r", node_id=bad)
                get = rgrpc.RendezvousStub(ch).GetState(rpb.GetStateRequest(caller=caller))
                assert await status_of(get) == grpc.StatusCode.INVALID_ARGUMENT
                ok = dgrpc.DriverStub(ch).Register(dpb.RegisterRequest(node_id="node-1", epoch=1))
                assert await status_of(ok) == grpc.StatusCode.OK
            assert bad not in svc.view.nodes

    asyncio.run(go())


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    tokens = tmp_path / "node.tokens"
    tokens.write_text(TOKEN + " n0\n")
    tokens.chmod(0o644)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    drv = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "driver", "--event-log", "memory",
         "--token-file", f"node={tokens}"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert drv.returncode == 2 and f"chmod 600 {tokens}" in drv.stderr, drv.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "nodes", "--driver", "127.0.0.1:1",
         "--token-file", str(tokens)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert cli.returncode == 2 and "chmod 600" in cli.stderr, cli.stderr
