"""docs/operations/deploy.md, as far as this machine goes: the example config files load
through the real flag parser, and the systemd units pass `systemd-analyze verify` (or, where
it is missing, a parser check of the settings they must carry)."""

from __future__ import annotations

import configparser
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
