"""The hooks SDK of another user with a system agent, through the agent's `--socket-group`.

Three local users besides root, made for the test (groupadd/useradd, removed after): the
agent's (a member of the SDK group, as the systemd unit's SupplementaryGroups= makes it), a
researcher's (a member) and `nobody` (not one). A real driver (root) and a real `unbroken
agent` run as the agent's user with `--socket-group`; the researcher's script, a process of
its own uid, attaches through the SDK, reports its steps (the driver lists them), flash-saves
into node memory, a second process of it restores that step, and the driver's eviction
reaches it as a stop. `nobody` is refused by the socket's mode, its SDK refuses the socket as
another user's, and a datagram it sends once the mode is opened is dropped by the agent's
check of the sender's credentials.

Processes of the test users get CAP_DAC_READ_SEARCH (setpriv's ambient set) only to read
this checkout and its Python under /root; it grants no write or send permission, so every
socket and directory permission is exercised as on a real host. Root only; skips otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unbroken.cli.cluster import stop_groups

pytestmark = pytest.mark.integration

SCRIPT = r"""
import hashlib, os, sys, time, warnings
import torch, torch.distributed as dist
from unbroken.trainer import hooks

mode = sys.argv[1]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0 if mode == "save" else 1)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "opt": opt}

def digest():
    raw = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(raw).hexdigest()[:16]

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ok = hooks.init(timeout_s=20)
print("attached", ok, os.getuid(), [str(w.message) for w in caught], flush=True)
if not ok:
    sys.exit(3)
if mode == "save":
    for step in range(1, 6):
        loss = model(torch.ones(8, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        hooks.report(step, float(loss))
        hooks.save(step, state, force=True)
    hooks.flush()
    print("saved", 5, digest(), flush=True)
    time.sleep(1.0)  # the agent's next heartbeat carries step 5
    hooks.close()
else:
    got = hooks.restore(state)
    print("restored", got, digest(), flush=True)
    deadline = time.monotonic() + 120
    while not hooks.should_stop() and time.monotonic() < deadline:
        hooks.report(got or 0, 0.5)
        time.sleep(0.1)
    print("stopped", hooks.should_stop(), flush=True)
"""


@dataclass
class Users:
    group: str
    gid: int
    agent: int
    researcher: int
    agent_gid: int  # their primary groups
    researcher_gid: int


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@pytest.fixture
def users() -> Iterator[Users]:
    if os.geteuid() != 0:
        pytest.skip("needs root to make the test's users and run processes as them")
    for tool in ("groupadd", "useradd", "userdel", "groupdel", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    tag = f"{os.getpid() % 100000}"
    group, agent, res = f"ubsdk{tag}", f"ubagent{tag}", f"ubres{tag}"
    made: list[tuple[str, str]] = []
    try:
        _run("groupadd", group)
        made.append(("groupdel", group))
        for name in (agent, res):
            _run("useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", group, name)
            made.insert(0, ("userdel", name))
        import grp
        import pwd

        a, r = pwd.getpwnam(agent), pwd.getpwnam(res)
        yield Users(group, grp.getgrnam(group).gr_gid, a.pw_uid, r.pw_uid, a.pw_gid, r.pw_gid)
    finally:
        for tool, name in made:
            subprocess.run([tool, name], capture_output=True, timeout=60)


def _as(uid: int, gid: int, groups: list[int], argv: list[str]) -> list[str]:
    """`argv` as user `uid` with these groups; CAP_DAC_READ_SEARCH only to read the venv."""
    g = ",".join(map(str, groups)) if groups else None
    return [
        "setpriv", f"--reuid={uid}", f"--regid={gid}",
        *([f"--groups={g}"] if g else ["--clear-groups"]),
        "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", *argv,
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("UNBROKEN_") and k not in ("XDG_RUNTIME_DIR", "HOME")
    }
    return {**env, "OMP_NUM_THREADS": "1", "HOME": "/tmp", **extra}


def _until(
    what: str,
    cond: Callable[[], bool],
    timeout_s: float,
    logs: Callable[[], str],
    daemons: list[subprocess.Popen[bytes]],
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs()}"
        for p in daemons:
            assert p.poll() is None, f"{p.args[:4]} exited while waiting for {what}\n{logs()}"
        time.sleep(0.2)


@pytest.mark.timeout(1200)  # real processes on a shared 2-core host
def test_a_member_of_the_socket_group_uses_the_sdk_with_the_system_agent(users: Users) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    # no --nodes: no recovery loop, so no StartWorkers; the agent only serves the SDK
    root = Path(tempfile.mkdtemp(prefix="ub-sdkgroup-", dir="/tmp"))
    root.chmod(0o755)  # every user may enter; what is below decides
    run = root / "run"  # what systemd's RuntimeDirectory= makes: the agent's, 0700
    logs_dir, persist = root / "logs", root / "persist"
    for d in (run, logs_dir, persist):
        d.mkdir(mode=0o700)
        os.chown(d, users.agent, users.gid)
    shm = Path(f"/dev/shm/ub-sdkgroup-{os.getpid()}")
    sock = run / "agent.sock"
    (root / "script.py").write_text(SCRIPT)
    (root / "script.py").chmod(0o644)
    py = sys.executable
    procs: list[subprocess.Popen[bytes]] = []

    def logs() -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
            for p in sorted(root.glob("*.log"))
        )

    def start(name: str, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
        with open(root / f"{name}.log", "wb") as out:
            p = subprocess.Popen(argv, cwd=root, env=_env(**env), stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        procs.append(p)
        return p

    def cli(*args: str) -> str:
        r = subprocess.run([py, "-m", "unbroken.cli", *args, "--driver", address],
                           capture_output=True, text=True, timeout=300, env=_env())  # fmt: skip
        assert r.returncode == 0, f"{args}: {r.stderr}"
        return r.stdout

    try:
        port_file = root / "driver.json"
        start("driver", [py, "-m", "unbroken.cli", "driver", "--listen", "127.0.0.1:0",
                         "--event-log", "memory", "--port-file", str(port_file)])  # fmt: skip
        _until("the driver's port file", port_file.exists, 120, logs, procs[:2])
        address = f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"
        agent = [py, "-m", "unbroken.cli", "agent", "--driver", address, "--node-id", "n1",
                 "--worker-cmd", "true", "--nproc-per-node", "1", "--no-start",
                 "--socket", str(sock), "--socket-group", users.group,
                 "--flash-dir", str(shm / "n1"), "--log-dir", str(logs_dir),
                 "--persist-url", str(persist)]  # fmt: skip
        start("agent", _as(users.agent, users.agent_gid, [users.gid], agent))
        _until("the agent's socket", sock.exists, 120, logs, procs[:2])
        st, dst = sock.stat(), run.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (users.agent, users.gid, 0o660)
        assert (dst.st_uid, dst.st_gid, dst.st_mode & 0o7777) == (users.agent, users.gid, 0o1770)

        def nodes() -> list[dict[str, object]]:
            return json.loads(cli("nodes", "--json"))  # type: ignore[no-any-return]

        def registered() -> bool:
            return any(n["node_id"] == "n1" for n in nodes())

        _until("the agent registered", registered, 120, logs, procs[:2])

        # the researcher: attach, report, flash-save five steps, exit
        script = [py, str(root / "script.py")]
        as_res = _as(users.researcher, users.researcher_gid, [users.gid], script)
        saver = start("save", [*as_res, "save"], UNBROKEN_AGENT_SOCKET=str(sock))
        seen: list[int] = []

        def attached_step() -> bool:
            for n in nodes():
                for a in n.get("attached", []):  # type: ignore[union-attr]
                    seen.append(int(a.get("step", 0)))  # type: ignore[union-attr]
            return 5 in seen

        _until("the heartbeat carries the researcher's step 5", attached_step, 180, logs, procs[:2])
        assert saver.wait(120) == 0, logs()
        out = (root / "save.log").read_text()
        assert f"attached True {users.researcher}" in out, out
        assert "saved 5 " in out, logs()
        digest = next(line.split()[2] for line in out.splitlines() if line.startswith("saved"))
        # its flash copies are in node memory, its own (the agent's store is the agent's)
        own = shm.parent / f"unbroken-u{users.researcher}"
        assert own.is_dir() and own.stat().st_uid == users.researcher, list(shm.parent.glob("*"))

        # nobody: not in the group, its SDK refuses the socket
        attach = (
            "import warnings; from unbroken.trainer import hooks\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); ok = hooks.init(timeout_s=10)\n"
            "print('attached', ok, [str(x.message) for x in w])\n"
        )
        as_nobody = _as(nobody.pw_uid, nobody.pw_gid, [], [py, "-c", attach])
        r = subprocess.run(as_nobody, capture_output=True, text=True, timeout=300,
                           env=_env(UNBROKEN_AGENT_SOCKET=str(sock)))  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        assert "attached False" in r.stdout and "not a system agent's socket shared" in r.stdout, (
            r.stdout
        )

        # a new process of the researcher restores step 5 (the driver's eviction stops it, below)
        restorer = start("restore", [*as_res, "restore"], UNBROKEN_AGENT_SOCKET=str(sock))

        def restored() -> list[str]:
            text = (root / "restore.log").read_text()
            return [x for x in text.splitlines() if x.startswith("restored")]

        _until("the restore", lambda: bool(restored()), 180, logs, procs[:2])
        line = restored()[0]
        assert line.split()[1:] == ["5", digest], logs()

        # the socket opened to everyone by mistake: the agent's credential check still drops it
        os.chmod(run, 0o1777)
        os.chmod(sock, 0o666)
        send = "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b'x', %r)"
        r = subprocess.run(_as(nobody.pw_uid, nobody.pw_gid, [], [py, "-c", send % str(sock)]),
                           capture_output=True, text=True, timeout=300, env=_env())  # fmt: skip
        assert r.returncode == 0, r.stderr

        def dropped() -> bool:
            text = (root / "agent.log").read_text()
            return "hooks.foreign_sender_dropped" in text and f"uid={nobody.pw_uid}" in text

        _until("the agent dropped nobody's datagram", dropped, 60, logs, procs[:2])

        # the driver's eviction reaches the member's script as a stop
        cli("evict", "n1", "--reason", "sdk group test")
        assert restorer.wait(120) == 0, logs()
        assert "stopped True" in (root / "restore.log").read_text(), logs()
    finally:
        stop_groups(procs, grace_s=10)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm.parent / f"unbroken-u{users.researcher}", ignore_errors=True)
