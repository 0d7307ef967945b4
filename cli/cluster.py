"""The one local-cluster harness: etcd, drivers and agents as real processes on loopback.

`unbroken up` (and its drill), bench/recovery.py, the chaos suite and the integration tests
all build on it, so it ships in the package (`up` needs it) rather than under tests/.

- `LocalCluster` starts an embedded etcd (or joins one it is given), drivers (on port 0: the
  port is read back from each driver's port file) and agents, each a process in its own
  process group writing `<run>/<name>.log`. It kills, respawns (same arguments; a driver on
  its old address, so agents find it again) and stops them all (SIGCONT, SIGTERM, SIGKILL
  after a grace period), also as a context manager.
- `LogWatch` tails the job's event log from etcd and the leading driver's live view. etcd's
  client is asyncio: it runs on a loop of its own in a daemon thread, so a test calls the
  watch plainly and an asyncio caller (the drill) through `asyncio.to_thread`.
- `until(pred, timeout_s, what)`: the one wait; a timeout names `what` and shows the last
  events and the logs' tails.

The faults and the table of which event proves which fault: cli/faults.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import psutil

from unbroken.agent.checks import CHECK_MODULE
from unbroken.common import aio
from unbroken.common.loopthread import LoopThread
from unbroken.driver import worldsplit
from unbroken.driver.etcd import (
    EmbeddedEtcd,
    EmbeddedEtcdCluster,
    EtcdConfig,
    distinct_port,
)
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

T = TypeVar("T")
CLI = (sys.executable, "-m", "unbroken.cli")
TOKEN_ROLES = ("node", "operator", "viewer")
RPC_TIMEOUT_S = 5.0
LOG_TAIL = 2500  # characters of each log in a failure message
EVENT_TAIL = 10  # events in a failure message


class UntilTimeout(AssertionError):
    """A condition did not come true in time (an AssertionError: a failed test)."""


class _HasLogs(Protocol):
    def logs(self, tail: int = ...) -> str: ...


def until(
    pred: Callable[[], T],
    timeout_s: float,
    what: str,
    context: _HasLogs | Callable[[], str] | None = None,
    *,
    poll_s: float = 0.1,
) -> T:
    """Wait for `pred()` to be truthy (at most `timeout_s`); return its value.

    Args:
        pred: the condition, polled every `poll_s`; an exception it raises propagates.
        timeout_s: the deadline.
        what: what is awaited, for the failure message.
        context: a cluster or watch (its `logs()`) or a callable whose text the failure
            message carries.
        poll_s: the polling interval.

    Raises:
        UntilTimeout: naming `what`, with the context's text.
    """
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        if time.monotonic() > deadline:
            detail = ""
            if context is not None:
                detail = context() if callable(context) else context.logs()
            raise UntilTimeout(f"timed out after {timeout_s:g} s waiting for {what}\n{detail}")
        time.sleep(poll_s)
    return value


#: What a helper of the agent's own runs (recovery/sdcbuddy.py: the SDC opinion helper, a
#: `concurrent.futures` process, and the resource tracker multiprocessing starts with it;
#: agent/loopguard.py: the loop guard).
HELPER_MODULES = (
    "multiprocessing.spawn",
    "multiprocessing.resource_tracker",
    "unbroken.agent.loopguard",
)


def is_agent_helper(p: psutil.Process) -> bool:
    """Whether an agent's child is one of its helpers, not a worker: a check process
    (`unbroken.diagnostics.check`, the warm one included), the SDC opinion helper or the
    loop guard."""
    try:
        cmd = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return CHECK_MODULE in cmd or any(m in a for a in cmd for m in HELPER_MODULES)


def signal_group(p: subprocess.Popen[bytes] | None, sig: int) -> None:
    """Send `sig` to `p`'s process group (gone already: nothing); to `p` alone when it leads
    no group (started without `start_new_session`), so it is never silently skipped."""
    if p is None:
        return
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)
    except PermissionError:
        pass


def stop_groups(procs: Iterable[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGCONT and SIGTERM every process group, SIGKILL what is left after `grace_s` in all."""
    procs = list(procs)
    for p in procs:
        signal_group(p, signal.SIGCONT)  # a stopped process cannot handle its SIGTERM
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    for p in procs:
        signal_group(p, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)


def read_metrics(path: Path) -> dict[int, list[float]]:
    """step -> every loss a trainer's `--metrics-out` logged for it (a re-run step twice)."""
    out: dict[int, list[float]] = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                m = json.loads(line)
                out.setdefault(int(m["step"]), []).append(float(m["loss"]))
    return out


def world_of(events: Iterable[ev.Event]) -> list[str]:
    """The node ids of the job's current world, folded from its events (a large world's
    WorldNodes parts put back into their head events first)."""
    world: list[str] = []
    for e in worldsplit.merged(events):
        kind = e.WhichOneof("payload")
        if kind == "job_started":
            world = list(e.job_started.world.node_ids)
        elif kind == "training_resumed" and e.training_resumed.HasField("world"):
            world = list(e.training_resumed.world.node_ids)
        elif kind == "world_resized":
            world = list(e.world_resized.new_world.node_ids)
    return world


class LocalCluster:
    """etcd, drivers and agents of one job as processes on this machine.

    Every process is `python -m unbroken.cli <args>` (or `launcher`), started in its own
    session with `env`, its output in `<run>/<name>.log`. Drivers get `--etcd`, `--job-id`,
    `--driver-id`, `--listen` and `--port-file`; agents `--driver` (every driver), `--node-id`,
    `--socket`, `--log-dir <run>/workers/<node>`, `--persist-url <run>/storage` and a
    replica port with a buddy's; the rest is the caller's (`driver_args`, `agent_args`, and
    per process).

    Args:
        run: the run directory (logs, port files, storage, etcd data).
        job: the job id (default: a fresh one).
        etcd: an etcd to use and leave running (a server object or an endpoint list);
            None: `start()` starts an embedded one (`etcd_members` > 1: a cluster) and
            `stop()` stops it.
        env: extra environment of every process (on top of this one's, OMP_NUM_THREADS=1
            and PYTHONUNBUFFERED=1).
        driver_args: appended to every driver's command line.
        agent_args: appended to every agent's command line.
        grace_s: how long `stop()` waits after SIGTERM before SIGKILL.
    """

    def __init__(
        self,
        run: Path,
        *,
        job: str = "",
        etcd: EmbeddedEtcd | EmbeddedEtcdCluster | str | None = None,
        etcd_members: int = 1,
        env: Mapping[str, str] | None = None,
        driver_args: Sequence[str] = (),
        agent_args: Sequence[str] = (),
        grace_s: float = 10.0,
    ) -> None:
        self.run = Path(run)
        self.run.mkdir(parents=True, exist_ok=True)
        self.job = job or f"job-{uuid.uuid4().hex[:6]}"
        self.etcd: EmbeddedEtcd | EmbeddedEtcdCluster | None = (
            None if isinstance(etcd, str) else etcd
        )
        self._endpoint = etcd if isinstance(etcd, str) else ""
        self._owns_etcd = etcd is None
        self.etcd_members = etcd_members
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.driver_args = list(driver_args)
        self.agent_args = list(agent_args)
        self.grace_s = grace_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # name -> its newest process
        self.args: dict[str, list[str]] = {}  # name -> its arguments, to respawn it
        self._launch: dict[str, tuple[list[str], dict[str, Any]]] = {}
        self.roles: dict[str, str] = {}  # name -> "driver" | "agent" | "other"
        self.addresses: dict[str, str] = {}  # driver name -> its gRPC address
        self.replica: dict[str, int] = {}  # node -> its replica port
        self.tokens: dict[str, str] = {}  # role -> this run's token (`make_tokens`)
        self.metrics = self.run / "metrics.jsonl"  # where a test's trainers log (optional)
        self.stopping = False

    # ------------------------------------------------------------ etcd
    def start(self) -> LocalCluster:
        """Start the embedded etcd unless one was given."""
        if self.etcd is None and not self._endpoint:
            if self.etcd_members > 1:
                self.etcd = EmbeddedEtcdCluster(self.etcd_members, self.run / "etcd").start()
            else:
                self.etcd = EmbeddedEtcd(self.run / "etcd").start()
        return self

    @property
    def endpoint(self) -> str:
        """etcd's client URL(s), comma-separated: what drivers get as --etcd."""
        if self.etcd is not None:
            return self.etcd.endpoint
        assert self._endpoint, "no etcd: call start() first"
        return self._endpoint

    @property
    def etcd_config(self) -> EtcdConfig:
        return EtcdConfig(endpoints=self.endpoint.split(","), connect_timeout_s=2.0)

    # ------------------------------------------------------------ processes
    def spawn(
        self,
        name: str,
        args: Sequence[str],
        *,
        launcher: Sequence[str] = CLI,
        role: str = "other",
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        """Start `launcher + args` as `name` (respawn() repeats it), output to `<name>.log`."""
        self.args[name] = list(args)
        self._launch[name] = (list(launcher), dict(popen))
        self.roles.setdefault(name, role)
        env = popen.pop("env", self.env)
        with open(self.run / f"{name}.log", "ab") as log:  # the child keeps its own fd
            p = subprocess.Popen(
                [*launcher, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                **popen,
            )
        self.procs[name] = p
        return p

    def port_file(self, name: str) -> Path:
        return self.run / f"{name}.port.json"

    def start_driver(
        self,
        name: str = "driver",
        args: Sequence[str] = (),
        *,
        listen: str = "127.0.0.1:0",
        wait_s: float | None = 60.0,
        launcher: Sequence[str] = CLI,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Start a driver; wait for its port file (unless `wait_s` is None); its address."""
        self.port_file(name).unlink(missing_ok=True)
        argv = [
            "driver", "--etcd", self.endpoint, "--job-id", self.job, "--driver-id", name,
            "--listen", listen, "--port-file", str(self.port_file(name)),
            *self.driver_args, *args,
        ]  # fmt: skip
        kw: dict[str, Any] = {"env": {**self.env, **env}} if env else {}
        self.spawn(name, argv, launcher=launcher, role="driver", **kw)
        if wait_s is None:
            return ""
        self.wait_driver(name, wait_s)
        return self.addresses[name]

    def wait_driver(self, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait for the driver's port file; note its address; return the file's content."""
        path, proc = self.port_file(name), self.procs[name]

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode}; see its log\n{self.log(name)}"
                )
            return path.exists()

        until(ready, timeout_s, f"{name}'s port file", poll_s=0.05)
        info: dict[str, Any] = json.loads(path.read_text())
        self.addresses[name] = f"127.0.0.1:{info['grpc_port']}"
        return info

    def driver_address(self, name: str = "driver") -> str:
        """The driver's gRPC address (waiting for its port file if not yet read)."""
        if name not in self.addresses:
            self.wait_driver(name)
        return self.addresses[name]

    def replica_port(self, node: str) -> int:
        """The node's buddy-replica port (chosen once, kept across respawns)."""
        if node not in self.replica:
            # never another node's: picked one after the other before either agent binds,
            # two nodes were handed the same port and the second agent could not start
            self.replica[node] = distinct_port(set(self.replica.values()))
        return self.replica[node]

    def start_agent(
        self,
        node: str,
        args: Sequence[str] = (),
        *,
        buddy: str | None = None,
        spare: bool = False,
        drivers: str | None = None,
        launcher: Sequence[str] = CLI,
    ) -> subprocess.Popen[bytes]:
        """Start the agent of `node` (reaching `drivers`, default every driver started)."""
        argv = [
            "agent", "--driver", drivers or ",".join(self.addresses.values()), "--node-id", node,
            "--socket", str(self.run / f"{node}.sock"),
            "--log-dir", str(self.worker_dir(node)),
            "--persist-url", str(self.run / "storage"),
            "--replica-listen", f"127.0.0.1:{self.replica_port(node)}",
        ]  # fmt: skip
        if buddy is not None and buddy != node:
            argv += ["--buddy", f"127.0.0.1:{self.replica_port(buddy)}"]
        if spare:
            argv.append("--spare")
        return self.spawn(node, [*argv, *self.agent_args, *args], launcher=launcher, role="agent")

    def respawn(self, name: str, *, wait_s: float | None = 60.0) -> subprocess.Popen[bytes]:
        """Start `name` again with its arguments; a driver on its old address."""
        args = list(self.args[name])
        launcher, popen = self._launch[name]
        if self.roles.get(name) == "driver":
            if name in self.addresses:
                args[args.index("--listen") + 1] = self.addresses[name]
            self.port_file(name).unlink(missing_ok=True)
        p = self.spawn(name, args, launcher=launcher, **popen)
        if self.roles.get(name) == "driver" and wait_s is not None:
            self.wait_driver(name, wait_s)
        return p

    def kill(self, name: str, sig: int = signal.SIGKILL, *, wait_s: float = 10.0) -> None:
        """Send `sig` to the process group of `name`; after a SIGKILL, reap it."""
        p = self.procs[name]
        signal_group(p, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(wait_s)

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def names(self, role: str) -> list[str]:
        """The processes of `role` ("driver", "agent"), in start order."""
        return [n for n, r in self.roles.items() if r == role]

    @property
    def drivers(self) -> dict[str, subprocess.Popen[bytes]]:
        return {n: self.procs[n] for n in self.names("driver")}

    @property
    def agents(self) -> dict[str, subprocess.Popen[bytes]]:
        return {n: self.procs[n] for n in self.names("agent")}

    def forget(self, name: str) -> subprocess.Popen[bytes]:
        """Drop `name` from the cluster (stop() no longer stops it); its process."""
        self.roles.pop(name, None)
        self.args.pop(name, None)
        return self.procs.pop(name)

    def workers(self, node: str) -> list[psutil.Process]:
        """The node's worker processes (its agent's children but its helpers: the warm check
        process, the SDC opinion helper), oldest first."""
        p = self.procs.get(node)
        if p is None or p.poll() is not None:
            return []
        with contextlib.suppress(psutil.NoSuchProcess):
            kids = [k for k in psutil.Process(p.pid).children() if not is_agent_helper(k)]
            return sorted(kids, key=lambda k: k.create_time())
        return []

    def worker(self, node: str) -> psutil.Process | None:
        """The node's first worker process, if it runs one."""
        kids = self.workers(node)
        return kids[0] if kids else None

    def worker_dir(self, node: str) -> Path:
        return self.run / "workers" / node

    # ------------------------------------------------------------ what they wrote
    def log(self, name: str, tail: int | None = None) -> str:
        p = self.run / f"{name}.log"
        text = p.read_text(errors="replace") if p.exists() else ""
        return text[-tail:] if tail else text

    def worker_log(self, node: str, rank: int = 0) -> str:
        p = self.worker_dir(node) / f"worker-{rank}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def logs(self, tail: int = LOG_TAIL) -> str:
        """The tail of every process's and every worker's log (for a failure message)."""
        parts = [f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                 for p in sorted(self.run.glob("*.log"))]  # fmt: skip
        for p in sorted(self.run.glob("workers/*/worker-*.log")):
            parts.append(f"--- {p.parent.name}/{p.name}\n{p.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def steps(self, path: Path | None = None) -> dict[int, list[float]]:
        """step -> losses from `path` (default: `metrics`, where a test's trainers log)."""
        return read_metrics(path or self.metrics)

    def max_step(self, path: Path | None = None) -> int:
        return max(self.steps(path), default=0)

    def events(self, from_seq: int = 1) -> list[ev.Event]:
        """The job's event log from etcd (a fresh client; see LogWatch to tail it)."""
        from unbroken.driver.etcdlog import EtcdEventLog, connect

        async def read() -> list[ev.Event]:
            client = await connect(self.etcd_config)
            try:
                return list(await EtcdEventLog(client, self.job, None).read(from_seq))
            finally:
                await client.close()

        return asyncio.run(read())

    def payloads(self, kind: str) -> list[Any]:
        """The payloads of every `kind` event in the log (`kind`: a payload name)."""
        return [getattr(e, kind) for e in self.events() if e.WhichOneof("payload") == kind]

    # ------------------------------------------------------------ roles and tokens
    def make_tokens(self, nodes: Sequence[str] = ()) -> list[str]:
        """One fresh token per role in <run>/tokens/ (0600), as a secured cluster runs;
        the driver flags that accept them.

        With `nodes`, node tokens are bound: one per node (`node_token_file(node)`), each
        listed in the driver's node.tokens with the one node id it may act as, so a node's
        token cannot open a session as another node. Without, one shared node token, which
        the driver takes for the rendezvous only (it refuses an unbound node token for
        Register and Session)."""
        d = self.run / "tokens"
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        flags = []

        def write(path: Path, text: str) -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)

        for role in TOKEN_ROLES:
            token = self.tokens[role] = secrets.token_hex(24)
            if role == "node" and nodes:
                lines = []
                for node in nodes:
                    bound = self.tokens[f"node:{node}"] = secrets.token_hex(24)
                    write(self.node_token_file(node), bound + "\n")
                    lines.append(f"{bound} {node}\n")
                write(d / "node.tokens", "".join(lines))
            else:
                for path in (d / f"{role}.tokens", d / f"{role}.token"):
                    write(path, token + "\n")
            flags += ["--token-file", f"{role}={d / f'{role}.tokens'}"]
        return flags

    def node_token_file(self, node: str) -> Path:
        """The file holding `node`'s own bound token (`make_tokens(nodes)`)."""
        return self.run / "tokens" / f"node-{node}.token"

    def metadata(self, role: str = "operator") -> tuple[tuple[str, str], ...]:
        """Call metadata with this run's token of `role` (none: an open cluster)."""
        token = self.tokens.get(role)
        return (("authorization", f"Bearer {token}"),) if token else ()

    def rpc(self, driver: str, method: str, request: Any, timeout_s: float = RPC_TIMEOUT_S) -> Any:
        """Call `method` on one driver as an operator; None when it does not answer."""
        addr = self.addresses.get(driver)
        if not addr or not self.alive(driver):
            return None
        try:
            with grpc.insecure_channel(addr) as ch:
                return getattr(dgrpc.DriverStub(ch), method)(
                    request, timeout=timeout_s, metadata=self.metadata()
                )
        except grpc.RpcError:
            return None

    def cli(
        self, *args: str, driver: str | None = None, timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run `unbroken ARGS --driver <every driver>` as an operator would (this run's
        operator token when it has one); its exit code and output."""
        env = {**self.env, "COLUMNS": "200"}
        if "operator" in self.tokens:
            env["UNBROKEN_TOKEN_FILE"] = str(self.run / "tokens" / "operator.token")
        return subprocess.run(
            [*CLI, *args, "--driver", driver or ",".join(self.addresses.values())],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )

    # ------------------------------------------------------------ stop
    def stop(self, grace_s: float | None = None) -> None:
        """Stop every process (agents first), then the etcd this cluster started."""
        self.stopping = True
        order = [*self.names("agent"), *self.names("other"), *self.names("driver")]
        stop_groups([self.procs[n] for n in order], self.grace_s if grace_s is None else grace_s)
        if self.etcd is not None and self._owns_etcd:
            members = (
                self.etcd.members if isinstance(self.etcd, EmbeddedEtcdCluster) else [self.etcd]
            )
            for m in members:  # a SIGSTOPped member cannot stop
                if m.proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        m.proc.send_signal(signal.SIGCONT)
            self.etcd.stop(remove=False)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LogWatch:
    """Tails one job's event log in etcd and the leading driver's live view.

    `poll()` reads the events appended since the last poll (`events` holds them all) and
    asks the running drivers which one leads (`leader`, its live view in `nodes`). A read
    etcd does not answer (it may be down on purpose) returns nothing and is retried at the
    next poll on a fresh connection.
    """

    def __init__(
        self, cluster: LocalCluster, *, archive_url: str | None = None, view: bool = True
    ) -> None:
        self.c = cluster
        self.archive_url = archive_url
        self.view = view
        self.events: list[ev.Event] = []
        self.leader = ""  # the leading driver's name ("" while none answers)
        self.nodes: list[dpb.NodeLive] = []
        self._loop = LoopThread("logwatch")
        self._client: Any = None
        self._log: Any = None

    def __enter__(self) -> LogWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _open(self) -> Any:
        from unbroken.driver.etcdlog import EtcdEventLog, connect

        if self._log is None:
            self._client = await connect(self.c.etcd_config)
            self._log = EtcdEventLog(self._client, self.c.job, None, archive_url=self.archive_url)
        return self._log

    async def _reset(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
        self._client = self._log = None

    def read(self, from_seq: int = 1, timeout_s: float = 10.0) -> list[ev.Event] | None:
        """Events from `from_seq` on, or None when etcd did not answer in time."""

        async def go() -> list[ev.Event]:
            log = await self._open()
            return list(await aio.wait_for(log.read(from_seq), timeout_s))

        try:
            return self._loop.call_sync(go(), timeout_s + 5)
        except Exception:
            with contextlib.suppress(Exception):
                self._loop.call_sync(self._reset(), 10)
            return None

    @property
    def seq(self) -> int:
        """The newest event's sequence number seen (0: none yet)."""
        return self.events[-1].seq if self.events else 0

    def poll(self, timeout_s: float = 5.0) -> list[ev.Event]:
        """Read the new events and refresh the live view; return the new events."""
        new = self.read(self.seq + 1, timeout_s) or []
        self.events.extend(new)
        if self.view:
            found = self.leader_view()
            if found is not None:
                self.leader, self.nodes = found
        return new

    def leader_view(self) -> tuple[str, list[dpb.NodeLive]] | None:
        """The leading driver's name and live view, asking each running driver."""
        for name in self.c.names("driver"):
            resp = self.c.rpc(name, "LiveView", dpb.LiveViewRequest(), timeout_s=2.0)
            if resp is not None and resp.leader:
                return name, list(resp.nodes)
        return None

    def find_leader(self, timeout_s: float = 60.0) -> str:
        """Wait until a driver leads; its name."""
        found = until(self.leader_view, timeout_s, "a leading driver", self, poll_s=0.2)
        assert found is not None
        self.leader, self.nodes = found
        return self.leader

    def rpc(self, method: str, request: Any, timeout_s: float = RPC_TIMEOUT_S) -> Any:
        """Call the leader (as the last poll found it); None when it does not answer."""
        return self.c.rpc(self.leader, method, request, timeout_s) if self.leader else None

    def world(self) -> list[str]:
        """The node ids of the current world, from the events read so far."""
        return world_of(self.events)

    def working(self) -> list[dpb.NodeLive]:
        """Alive nodes running workers, in the leader's live view."""
        return [n for n in self.nodes if n.alive and n.workers]

    def step(self) -> int:
        """The newest step any alive node's worker reported."""
        return max((w.step for n in self.nodes if n.alive for w in n.workers), default=0)

    def loss(self) -> float | None:
        losses = [w.loss for n in self.nodes for w in n.workers if w.has_loss and w.step > 0]
        return losses[-1] if losses else None

    def kinds(self, since_seq: int = 0) -> list[str]:
        """The payload names of the events after `since_seq`."""
        return [e.WhichOneof("payload") or "?" for e in self.events if e.seq > since_seq]

    def until(
        self,
        pred: Callable[[], T],
        timeout_s: float,
        what: str,
        *,
        poll_s: float = 0.2,
    ) -> T:
        """`until`, polling the log before each test of `pred`; a timeout shows the tails."""

        def polled() -> T:
            self.poll()
            return pred()

        return until(polled, timeout_s, what, self, poll_s=poll_s)

    def wait_event(
        self,
        match: Callable[[ev.Event], bool] | str,
        timeout_s: float,
        *,
        since_seq: int | None = None,
    ) -> ev.Event:
        """The first event after `since_seq` (default: the newest seen) that matches."""
        after = self.seq if since_seq is None else since_seq
        test = (lambda e: e.WhichOneof("payload") == match) if isinstance(match, str) else match

        def found() -> ev.Event | None:
            return next((e for e in self.events if e.seq > after and test(e)), None)

        what = match if isinstance(match, str) else getattr(match, "__name__", "an event")
        e = self.until(found, timeout_s, f"{what} after seq {after}")
        assert e is not None
        return e

    def logs(self, tail: int = LOG_TAIL) -> str:
        """The last events, then every process's log tail."""
        lines = [f"leader: {self.leader or '-'}; last events:"]
        for e in self.events[-EVENT_TAIL:]:
            kind = e.WhichOneof("payload") or "?"
            detail = " ".join(str(getattr(e, kind)).split()) if kind != "?" else ""
            lines.append(f"  {e.seq} {kind} {detail[:160]}")
        return "\n".join(lines) + "\n" + self.c.logs(tail)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.call_sync(self._reset(), 10)
        self._loop.stop(10)
