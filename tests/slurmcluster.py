"""A real Slurm cluster on this host for tests: munged, slurmctld, one slurmd per node.

Follows shared/slurm/README.md (Debian 12 slurm-wlm 22.05, multiple-slurmd build): every
node is a `slurmd -N <name>` with its own port and loopback address, all ports are free
ports of this run, every daemon runs in the foreground as our child so we own its PID, and
`stop()` stops them in order (slurmds, slurmctld, munged). `SLURM_CONF` must be in the
environment of every client command: use `cluster.env`.

`ensure_installed()` installs the Debian packages when they are missing and apt-get is
there (as .ci/run does for chromium); tests skip with the reason where that fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from unbroken.diagnostics.check import free_port

PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "srun", "sbatch", "sinfo", "squeue")


def missing() -> list[str]:
    """The Slurm/munge binaries not on this machine."""
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def ensure_installed() -> str:
    """'' when Slurm is usable, else why not (after trying apt-get once)."""
    if not missing():
        return ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"Slurm is not installed ({missing()}) and apt-get cannot run here"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
    ):
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode:
            return f"apt-get could not install Slurm: {r.stderr.strip()[-300:]}"
    return "" if not missing() else f"Slurm binaries still missing after apt-get: {missing()}"


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


CONF = """\
ClusterName=ut{tag}
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,permit_job_expansion
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=3
SlurmctldTimeout=10
MessageTimeout=2
InactiveLimit=0
KillWait=2
MinJobAge=30
HealthCheckInterval=0
TCPTimeout=2
{nodes}
PartitionName=main Nodes={all} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class SlurmCluster:
    """A running single-host Slurm cluster of `nodes` (names n1..nN)."""

    def __init__(self, root: Path, n: int = 4) -> None:
        self.d = root
        self.names = [f"n{i + 1}" for i in range(n)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        tag = os.getpid() % 100000
        self._octet = 10 + tag % 200  # 127.<octet>.x.y: parallel runs use other addresses

    def start(self, timeout_s: float = 30.0) -> SlurmCluster:
        d = self.d
        for sub in ("ctld", "spool", "log", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(d / "munge", 0o700)
        os.chmod(key, 0o400)
        m = d / "munge"
        self._spawn(
            "munged",
            [_sbin("munged"), "-F", "--force", f"--socket={m}/munge.socket",
             f"--key-file={key}", f"--log-file={d}/log/munged.log",
             f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"],
        )  # fmt: skip
        self._until("munge's socket", lambda: (m / "munge.socket").exists(), timeout_s)
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.{self._octet}.0.{i + 1} "
            f"Port={free_port()} CPUs=1 RealMemory=500 State=UNKNOWN"
            for i, n in enumerate(self.names)
        )
        self.conf.write_text(
            CONF.format(
                tag=os.getpid(),
                ctld_port=free_port(),
                d=d,
                nodes=nodes,
                all=",".join(self.names),
            )
        )
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
        self._until("slurmctld", lambda: self._ok("scontrol", "ping"), timeout_s)
        for n in self.names:
            self.start_node(n)
        self.wait_idle(self.names, timeout_s)
        return self

    def start_node(self, name: str) -> None:
        (self.d / "spool" / name).mkdir(parents=True, exist_ok=True)
        self._spawn(f"slurmd-{name}", [_sbin("slurmd"), "-D", "-f", str(self.conf), "-N", name])

    def wait_idle(self, names: list[str], timeout_s: float = 30.0) -> None:
        self._until(
            f"{names} idle",
            lambda: all(self.state(n).startswith("idle") for n in names),
            timeout_s,
        )

    def settle(self, timeout_s: float = 60.0) -> None:
        """Every job cancelled and every node idle again: a node drained or downed is
        resumed, also one drained after the cancel (a cancelled job's unbroken driver can
        still drain the node whose agent the cancel ended first: CI once saw n3 drained
        just after the resume pass, and the wait for idle timed out)."""

        def idle() -> bool:
            states = {n: self.state(n) for n in self.names}
            for n, st in states.items():
                if st.startswith(("drain", "drng", "down")):
                    self.cmd("scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)
            return all(st.startswith("idle") for st in states.values())

        self.cmd("scancel", "--full", "-u", "root", check=False)
        self._until(
            "the queue empty", lambda: not self.cmd("squeue", "-h", check=False).stdout.strip(),
            timeout_s,
        )  # fmt: skip
        self._until(f"{self.names} idle", idle, timeout_s)

    def state(self, name: str) -> str:
        """sinfo's short state of one node (idle, drain, drng, down*, alloc, ...)."""
        r = self.cmd("sinfo", "-h", "-n", name, "-o", "%t", check=False)
        return r.stdout.strip()

    def reason(self, name: str) -> str:
        r = self.cmd("sinfo", "-h", "-n", name, "-o", "%E", check=False)
        return r.stdout.strip()

    def end_job(self, steps: list[subprocess.Popen[bytes]], jid: str) -> None:
        """End a job's `srun` steps (SIGTERM, 10 s each to go) and cancel the job `jid`."""
        for p in steps:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        for p in steps:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        if jid:
            self.cmd("scancel", jid, check=False)

    def cmd(
        self, *argv: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode:
            raise AssertionError(f"{' '.join(argv)}: {r.stderr.strip()}\n{self.logs()}")
        return r

    def _ok(self, *argv: str) -> bool:
        return self.cmd(*argv, check=False, timeout=10).returncode == 0

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.d / "log" / f"{name}.out", "ab")  # the child owns it
        self.procs[name] = subprocess.Popen(
            argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()

    def _until(self, what: str, cond: object, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():  # type: ignore[operator]
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm: timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.05)

    def crash_node(self, name: str) -> None:
        """A node crash: SIGKILL its slurmd, the tasks it runs and their slurmstepds."""
        pids = []
        r = self.cmd("scontrol", "listpids", "*", name, check=False)
        for line in r.stdout.splitlines()[1:]:
            with contextlib.suppress(ValueError, IndexError):
                pids.append(int(line.split()[0]))
        import psutil

        stepds = set()
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                for parent in psutil.Process(pid).parents():
                    if parent.name().startswith("slurmstepd"):
                        stepds.add(parent.pid)
        p = self.procs.pop(f"slurmd-{name}")
        p.kill()
        p.wait(10)
        for pid in [*pids, *stepds]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def logs(self) -> str:
        parts = []
        for f in sorted((self.d / "log").glob("*")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop slurmds, then slurmctld, then munged (each by its PID), and every
        slurmstepd left behind (they run in the slurmds' sessions)."""
        order = [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            p = self.procs.pop(name, None)
            if p is None:
                continue
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)
        self._kill_strays()

    def _kill_strays(self) -> None:
        """slurmstepds of this cluster (their command line names our slurm.conf's nodes are
        not visible; they are found by their spool dir in the open files is too slow), so:
        any slurmstepd whose environment has our SLURM_CONF."""
        import psutil

        for p in psutil.process_iter(["name"]):
            if not (p.info["name"] or "").startswith("slurmstepd"):
                continue
            with contextlib.suppress(psutil.Error):
                if p.environ().get("SLURM_CONF") == str(self.conf):
                    p.kill()


@contextlib.contextmanager
def running(root: Path, nodes: int = 4) -> Iterator[SlurmCluster]:
    """A started cluster of `nodes` under `root`, stopped on exit; the test skips, saying
    why, where Slurm is not installed."""
    import pytest

    why = ensure_installed()
    if why:
        pytest.skip(why)
    c = SlurmCluster(root, nodes).start()
    try:
        yield c
    finally:
        c.stop()
