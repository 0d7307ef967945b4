"""The operator CLI's credentials and its answer from a standby driver.

Two real gRPC servers in this process (a leader on an in-memory log that requires a
bearer token, and a standby that knows where the leader is) and the real `unbroken`
command as a subprocess: without the token the command exits 2 and says which flag to
pass; with it (flag or file) it works; a standby answers every operator call with
FAILED_PRECONDITION naming the leader, which the CLI prints (exit 1).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import DriverService, ServiceConfig, build_server

pytestmark = pytest.mark.integration

TOKEN = "a-token-of-at-least-16-characters"
VIEWER = "a-viewer-token-of-16-characters"
LEADER_AT = "10.9.8.7:50051"


async def _cli(*args: str, token: str | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken.cli.main",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_TOKEN")},
            "OMP_NUM_THREADS": "1",
            **({"UNBROKEN_TOKEN": token} if token is not None else {}),
        },
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _scenario(tmp: Path) -> None:
    store = InMemoryStore()
    leader = DriverService(
        ServiceConfig(tokens=RoleTokens({"operator": [TOKEN], "viewer": [VIEWER]})),
        driver_id="lead",
        job_id="auth",
    )
    leader.lead(InMemoryEventLog(store, "auth", store.elect("lead")), "127.0.0.1:0")
    standby = DriverService(
        ServiceConfig(), driver_id="standby", job_id="auth", leader_address=LEADER_AT
    )
    servers = []
    try:
        s1, port1, _ = await build_server(leader, "127.0.0.1:0")
        servers.append(s1)
        s2, port2, _ = await build_server(standby, "127.0.0.1:0")
        servers.append(s2)
        lead, stand = f"127.0.0.1:{port1}", f"127.0.0.1:{port2}"

        rc, _, err = await _cli("status", "--driver", lead, "--json")
        assert rc == 2 and "--token-file" in err, err
        rc, _, err = await _cli("status", "--driver", lead, "--json", "--token", TOKEN)
        assert rc == 2 and "visible to every local user" in err, err  # never on argv
        rc, out, err = await _cli("status", "--driver", lead, "--json", token=TOKEN)
        assert rc == 0, err
        assert json.loads(out)["job_id"] == "auth" and json.loads(out)["driver_id"] == "lead"
        token_file = tmp / "token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)  # token files must be private
        rc, out, err = await _cli("nodes", "--driver", lead, "--token-file", str(token_file))
        assert rc == 0 and "0 nodes" in out, err
        rc, _, err = await _cli("events", "--driver", lead, token="short")
        assert rc == 2 and "16 characters" in err
        # a viewer reads but may not act
        rc, out, err = await _cli("status", "--driver", lead, token=VIEWER)
        assert rc == 0, err
        rc, _, err = await _cli("evict", "n0", "--driver", lead, token=VIEWER)
        assert rc == 2 and "viewer:* may not call Evict" in err, err

        for args in (["status"], ["evict", "n0"], ["events"], ["diagnose"]):
            rc, _, err = await _cli(*args, "--driver", stand)
            assert rc == 1, (args, err)
            assert "not the leader" in err and LEADER_AT in err, (args, err)
    finally:
        for s in servers:
            await s.stop(0.2)
        await leader.close()
        await standby.close()


def test_token_and_standby(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))
