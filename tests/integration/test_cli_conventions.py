"""The operator CLI's conventions against real driver processes over mutual TLS.

One driver (`--event-log memory`, certificates from `unbroken certs`) per module, and the
real `unbroken` command:

- Each class of connection error gets one line naming its cause: no client certificate,
  a certificate of another CA (both directions), a driver certificate for another host
  name, nothing listening, and a principal not allowed to act (unauthorised).
- Settings come from the environment (UNBROKEN_DRIVER, UNBROKEN_CA, UNBROKEN_CERT,
  UNBROKEN_KEY) and from the config file ($UNBROKEN_CLI_CONFIG), flags winning.
- `--json` prints int64 fields as JSON numbers.
- Several `--driver` addresses: a dead one is skipped; a standby's answer is followed to
  the leader (two drivers on one etcd).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unbroken.cli.cluster import stop_groups
from unbroken.driver.etcd import free_port

pytestmark = pytest.mark.integration

UNBROKEN = [sys.executable, "-m", "unbroken.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    return {**env, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **extra}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*UNBROKEN, *args], capture_output=True, text=True, timeout=120, env=env or _env()
    )


def _certs(d: Path) -> None:
    for args in (
        ["ca", "--dir", str(d / "pki")],
        ["issue", "driver:main", "--dir", str(d / "pki")],  # localhost, 127.0.0.1
        ["issue", "driver:elsewhere", "--dir", str(d / "pki"), "--host", "driver.example"],
        ["issue", "operator:me", "--dir", str(d / "pki")],
        ["issue", "viewer:look", "--dir", str(d / "pki")],
        ["ca", "--dir", str(d / "other")],
        ["issue", "operator:me", "--dir", str(d / "other")],
    ):
        r = _cli("certs", *args)
        assert r.returncode == 0, r.stderr


def _start_driver(
    d: Path, name: str, cert: str, *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    pki = d / "pki"
    port_file = d / f"{name}.json"
    with open(d / f"{name}.log", "wb") as out:
        proc = subprocess.Popen(
            [*UNBROKEN, "driver", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
             "--driver-id", name, "--job-id", "conv",
             "--tls-cert", str(pki / f"{cert}.crt"), "--tls-key", str(pki / f"{cert}.key"),
             "--tls-ca", str(pki / "ca.pem"), *extra],
            stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while not port_file.exists():
        assert proc.poll() is None, (d / f"{name}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, f"{name} did not start"
        time.sleep(0.1)
    return proc, f"127.0.0.1:{json.loads(port_file.read_text())['grpc_port']}"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("conv")
    _certs(d)
    procs = []
    try:
        main, addr = _start_driver(d, "main", "driver-main", "--event-log", "memory")
        procs.append(main)
        other, other_addr = _start_driver(
            d, "elsewhere", "driver-elsewhere", "--event-log", "memory"
        )
        procs.append(other)
        yield {"dir": d, "address": addr, "misnamed": other_addr}
    finally:
        stop_groups(procs, grace_s=10)


def _flags(d: Path, who: str = "operator-me", ca_dir: str = "pki") -> list[str]:
    cert_dir = d / ("other" if ca_dir == "other-client" else "pki")
    ca = d / ("other" if ca_dir == "other" else "pki") / "ca.pem"
    return [
        "--tls-cert", str(cert_dir / f"{who}.crt"), "--tls-key", str(cert_dir / f"{who}.key"),
        "--tls-ca", str(ca),
    ]  # fmt: skip


def _one_line(r: subprocess.CompletedProcess[str], code: int, *phrases: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for p in phrases:
        assert p in lines[0], (p, lines[0])


def test_no_client_certificate(tls: dict[str, Any]) -> None:
    r = _cli("status", "--driver", tls["address"])
    _one_line(r, 3, "no client certificate", "--tls-cert")


def test_unknown_ca_of_the_driver(tls: dict[str, Any]) -> None:
    """Our CA did not sign the driver's certificate."""
    flags = _flags(tls["dir"], ca_dir="other")
    flags[1] = str(tls["dir"] / "other" / "operator-me.crt")
    flags[3] = str(tls["dir"] / "other" / "operator-me.key")
    r = _cli("status", "--driver", tls["address"], *flags)
    _one_line(r, 3, "unknown CA", "not signed by your CA")


def test_unknown_ca_of_our_certificate(tls: dict[str, Any]) -> None:
    """We trust the driver, but the driver does not trust our certificate's CA."""
    r = _cli("status", "--driver", tls["address"], *_flags(tls["dir"], ca_dir="other-client"))
    _one_line(r, 3, "unknown CA", "does not accept your client certificate")


def test_wrong_host_name(tls: dict[str, Any]) -> None:
    r = _cli("status", "--driver", tls["misnamed"], *_flags(tls["dir"]))
    _one_line(r, 3, "wrong host name", "127.0.0.1", "--host 127.0.0.1")


def test_unreachable(tls: dict[str, Any]) -> None:
    r = _cli("status", "--driver", f"127.0.0.1:{free_port()}", *_flags(tls["dir"]))
    _one_line(r, 3, "unreachable", "nothing accepts connections")


def test_unauthorised(tls: dict[str, Any]) -> None:
    r = _cli("evict", "n0", "--driver", tls["address"], *_flags(tls["dir"], who="viewer-look"))
    _one_line(r, 2, "unauthorised", "viewer:look may not call Evict")


def test_settings_from_the_environment_and_the_config_file(tls: dict[str, Any]) -> None:
    d, pki = tls["dir"], tls["dir"] / "pki"
    env = _env(
        UNBROKEN_DRIVER=tls["address"],
        UNBROKEN_CA=str(pki / "ca.pem"),
        UNBROKEN_CERT=str(pki / "operator-me.crt"),
        UNBROKEN_KEY=str(pki / "operator-me.key"),
    )
    r = _cli("status", "--json", env=env)
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["job_id"] == "conv"
    # int64 values are JSON numbers, not strings
    assert isinstance(status["last_seq"], int) and isinstance(status["step"], int), status
    events = [json.loads(x) for x in _cli("events", "--json", env=env).stdout.splitlines()]
    assert events and all(isinstance(e["seq"], int) for e in events), events[:2]
    assert all(isinstance(e["wall_time_unix_ns"], int) for e in events)

    conf = d / "cli.toml"  # relative paths: from the file's folder
    conf.write_text(
        f'driver = ["127.0.0.1:{free_port()}", "{tls["address"]}"]\n'
        'ca = "pki/ca.pem"\ncert = "pki/operator-me.crt"\nkey = "pki/operator-me.key"\n'
    )
    r = _cli("status", "--json", env=_env(UNBROKEN_CLI_CONFIG=str(conf)))
    assert r.returncode == 0, r.stderr  # the dead first address was skipped
    assert json.loads(r.stdout)["driver_id"] == "main"
    # a flag wins over the file: this driver presents a certificate for another name
    r = _cli("status", "--driver", tls["misnamed"], env=_env(UNBROKEN_CLI_CONFIG=str(conf)))
    _one_line(r, 3, "wrong host name")
    conf.write_text('driver = "127.0.0.1:1"\ncolour = "red"\n')
    r = _cli("status", env=_env(UNBROKEN_CLI_CONFIG=str(conf)))
    _one_line(r, 2, "unknown key(s) colour")


def test_several_drivers_and_following_the_leader(
    tls: dict[str, Any], etcd_server: Any, tmp_path: Path
) -> None:
    """Two drivers of one job on etcd: whichever address comes first, the CLI reaches the
    leader (a standby answers with the leader's address, which the CLI follows)."""
    d = tls["dir"]
    job = f"lead-{uuid.uuid4().hex[:6]}"
    extra = ("--etcd", etcd_server.endpoint, "--archive-url", "none", "--job-id", job)
    procs = []
    try:
        first, a1 = _start_driver(d, f"d1-{job}", "driver-main", *extra)
        procs.append(first)
        leader_id = ""
        deadline = time.monotonic() + 60
        while not leader_id:  # the first one leads once it has campaigned
            r = _cli("status", "--json", "--driver", a1, *_flags(d))
            if r.returncode == 0:
                leader_id = json.loads(r.stdout)["driver_id"]
            assert time.monotonic() < deadline, r.stderr
            time.sleep(0.5)
        second, a2 = _start_driver(d, f"d2-{job}", "driver-main", *extra)
        procs.append(second)
        time.sleep(3)  # the standby learns who leads (it reads the election every second)
        for drivers in ([a2, a1], [f"{a2},{a1}"], [a2]):
            args = [x for a in drivers for x in ("--driver", a)]
            r = _cli("status", "--json", *args, *_flags(d))
            assert r.returncode == 0, (drivers, r.stderr)
            assert json.loads(r.stdout)["driver_id"] == leader_id, (drivers, r.stdout)
    finally:
        stop_groups(procs, grace_s=10)


def test_shell_completion_from_the_parser() -> None:
    script = _cli("completion", "bash")
    assert script.returncode == 0, script.stderr

    def complete(*words: str) -> list[str]:
        line = " ".join(words)
        prog = (
            f"source /dev/stdin; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
            '_unbroken; printf "%s\\n" "${COMPREPLY[@]}"'
        )
        r = subprocess.run(
            ["bash", "-c", prog], input=script.stdout, capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert complete("unbroken", "ev") == ["events", "evict"]
    assert "resume" in complete("unbroken", "")
    assert complete("unbroken", "resume", "--re") == ["--reason"]
    assert complete("unbroken", "driver", "--event-log", "") == ["etcd", "memory"]
    assert "--tls-cert" in complete("unbroken", "status", "--tls")


def test_tables_are_wide_when_piped() -> None:
    """A piped table is never cut at 80 columns; a terminal's (or $COLUMNS) width wins."""
    prog = "from unbroken.cli.client import console; print(console().width)"
    env = {k: v for k, v in _env().items() if k != "COLUMNS"}
    assert (
        subprocess.run(
            [sys.executable, "-c", prog], capture_output=True, text=True, env=env, timeout=60
        ).stdout.split()[-1]
        == "1000"
    )
    sized = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True,
        env={**env, "COLUMNS": "90"}, timeout=60,
    )  # fmt: skip
    assert sized.stdout.split()[-1] == "90"
