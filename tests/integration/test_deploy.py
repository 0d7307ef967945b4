"""docs/operations/deploy.md, as far as this machine goes: the example config files load
through the real flag parser, the systemd units pass `systemd-analyze verify` (or, where
it is missing, a parser check of the settings they must carry) and `systemd-analyze
security` rates each at most 5.0, and `systemd-sysusers` makes the user and the SDK group
from the sysusers.d file."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.cli import main as cli

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


@pytest.mark.parametrize("name", ["driver", "agent"])
def test_the_example_config_files_load(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([name, "--config", str(DEPLOY / f"{name}.toml"), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "tls-cert = " in out and "/etc/unbroken/pki/" in out


def test_the_units_carry_what_the_security_and_orphan_work_expects() -> None:
    assert {u.name for u in UNITS} == {"unbroken-driver.service", "unbroken-agent.service"}
    for unit in UNITS:
        ini = configparser.ConfigParser(strict=False, interpolation=None)
        ini.optionxform = str  # type: ignore[assignment,method-assign]
        ini.read(unit)
        svc = ini["Service"]
        assert svc["ExecStart"].startswith("/usr/local/bin/unbroken ")
        assert "--config /etc/unbroken/" in svc["ExecStart"]
        assert svc["KillMode"] == "control-group"  # stopping the unit stops the workers
        assert svc["Restart"] in ("on-failure", "always")
        assert svc["User"] == "unbroken" and svc["NoNewPrivileges"] == "yes"
        assert ini["Install"]["WantedBy"] == "multi-user.target"
    agent = configparser.ConfigParser(strict=False, interpolation=None)
    agent.optionxform = str  # type: ignore[assignment,method-assign]
    agent.read(DEPLOY / "systemd" / "unbroken-agent.service")
    assert agent["Service"]["RuntimeDirectoryMode"] == "0700"
    # the SDK group: the agent is a member and makes its socket the group's
    assert agent["Service"]["SupplementaryGroups"] == "unbroken-users"
    assert "--socket-group unbroken-users" in agent["Service"]["ExecStart"]
    assert "--socket /run/unbroken/agent.sock" in agent["Service"]["ExecStart"]
    # its SCHED_RR loop: by the rlimit, and nothing that forbids real-time scheduling
    assert agent["Service"]["LimitRTPRIO"] == "1"
    assert "RestrictRealtime" not in agent["Service"]
    assert "RemoveIPC" not in agent["Service"]  # it would delete the flash copies
    assert "PrivateDevices" not in agent["Service"]  # the workers' GPUs


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_analyze_security_rates_the_unit_at_most_5(unit: Path) -> None:
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert m, f"no overall exposure level in systemd-analyze's output:\n{r.stdout}{r.stderr}"
    assert float(m.group(1)) <= 5.0, r.stdout


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="no systemd-sysusers here")
def test_sysusers_creates_the_user_and_the_sdk_group(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    r = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(DEPLOY / "systemd/unbroken.sysusers.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    users = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert users["unbroken"][5] == "/var/lib/unbroken"
    assert users["unbroken"][6].endswith("nologin")
    assert {"unbroken", "unbroken-users"} <= groups


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "unbroken"
    for unit in UNITS:  # verify checks that ExecStart exists: point it at ours
        text = unit.read_text().replace("/usr/local/bin/unbroken", str(exe))
        (tmp_path / unit.name).write_text(text)
    r = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / u.name) for u in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
