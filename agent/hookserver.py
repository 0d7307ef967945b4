"""The agent's end of the worker -> agent local channel (proto/hooks.proto).

A unix datagram socket: each worker report is one datagram, read by the event loop
without a connection per worker. Reports update the matching `Worker` (found by pid);
commands for workers (pause, resume, flash-save, stop) go back to the socket each worker
named in its Hello.

Processes the agent did not start (a script under torchrun or srun using the hooks SDK)
attach: their Hello carries `attach`, the agent keeps them in its own table of
`Attached` workers (never in the supervisor's, which the driver may restart) and answers
with a `Welcome` naming the node's flash store, so they flash-save into the agent's
memory exactly as its own workers do. Such a script finds the agent without the agent's
environment through the default socket path `DEFAULT_SOCKET`, which the first agent of a
node takes (later agents on the same host fall back to a per-process path).

Who may send: the agent's own user and root, and with a `group` (`--socket-group`) every
member of that group. The socket's mode keeps everyone else out (0600, or 0660 in a 1770
directory of the group), and each datagram's sender, as the kernel gives it
(SCM_CREDENTIALS), is checked again: a datagram from anyone else is counted and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from unbroken.agent.workers import Supervisor, Worker
from unbroken.common.paths import DEFAULT_SOCKET, private_dir, shared_dir, uid_in_group
from unbroken.common.workerenv import WorkerEnv
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import hooks_pb2 as hpb

log = structlog.get_logger(__name__)

MAX_ATTACHED = 1024  # attached workers remembered (the oldest dead ones go first)
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_UCRED.size)


@dataclass(kw_only=True, slots=True)
class Attached:
    """A worker process the agent did not start, known from its hooks SDK's Hello."""

    pid: int
    local_rank: int
    rank: int
    world_size: int
    reply_socket: str
    step: int = 0
    loss: float | None = None
    step_time_ms: float = 0.0
    reports: int = 0
    last_report: float = 0.0  # monotonic
    last_progress: float = 0.0  # monotonic: when `step` last changed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def socket_in_use(path: str) -> bool:
    """Whether a live process is bound to the unix datagram socket at `path`.

    Connecting a datagram socket sends nothing; a stale file (its agent died) refuses.
    """
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def claim(private: str, shared: str) -> bool:
    """Link the bound socket file `private` to `shared` unless a live agent holds `shared`.

    `os.link` fails when `shared` exists, so two agents starting at once cannot both win;
    a stale file (its agent died) is removed first, once.
    """
    for _ in range(2):
        try:
            os.link(private, shared)
            return True
        except FileExistsError:
            if socket_in_use(shared):
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shared)
    return False


def _bind_private(sock: socket.socket, path: str) -> None:
    """Bind `sock` at `path` as a socket file only this user may send to (0600)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock.bind(path)
    os.chmod(path, 0o600)


class HookServer:
    """Receives `WorkerReport`s and applies them to the supervisor's workers."""

    def __init__(
        self, path: str, supervisor: Supervisor, node_id: str = "", group: int | None = None
    ) -> None:
        """`group`: the id of a group whose members' scripts may use the SDK with this
        agent (None: only this user's and root's)."""
        self.path = path
        self.group = group
        self._members: dict[int, tuple[bool, float]] = {}  # uid -> (member, when looked up)
        self.node_id = node_id
        self.supervisor = supervisor
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.bad = 0
        self.foreign = 0  # datagrams from another user, dropped
        self.reports = 0
        self.attached: dict[int, Attached] = {}  # pid -> an SDK process the agent did not start
        self._bound = False
        # called when a worker reports its first step since it (re)started or rejoined: the
        # agent heartbeats at once, so the driver's restore sees every rank step sooner
        self.on_beat_now: Callable[[], object] | None = None
        # called when a step report's loss stands out (`Worker.beat_now`): the agent
        # heartbeats at once, its rings listed anew, for the driver's spike detector
        self.on_outlier: Callable[[], object] | None = None
        # called on every step report of a worker the agent started (the flash thread scans
        # the rings then: the step's previous save is whole, and its buddy waits for it)
        self.on_step: Callable[[], object] | None = None

    def welcome(self) -> hpb.Welcome:
        """Where this node's flash store is (from the environment the agent gives workers)."""
        env = WorkerEnv.from_env(self.supervisor.launch.env)
        return hpb.Welcome(
            node_id=self.node_id,
            flash_root=env.flash_root,
            flash_job=env.flash_job,
            flash_node=env.flash_node,
            persist_url=env.persist_url,
        )

    async def start(self) -> None:
        """Bind the socket. The shared default path is claimed atomically (a hard link to a
        private socket file): taken only when no live agent holds it, else the agent keeps
        its private path (and tells its own workers that one)."""
        parent = os.path.dirname(os.path.abspath(self.path))
        if self.group is not None:
            shared_dir(parent, self.group)  # refuses a planted directory
        elif self.path == DEFAULT_SOCKET:
            private_dir(parent)  # refuses a planted or shared directory
        else:
            Path(parent).mkdir(mode=0o700, parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if self.path == DEFAULT_SOCKET:
            private = f"{self.path}.{os.getpid()}"
            _bind_private(sock, private)
            if claim(private, self.path):
                os.unlink(private)
            else:
                log.warning(
                    "hooks.default_socket_taken",
                    path=self.path,
                    using=private,
                    hint="another agent on this host holds it; scripts under other launchers "
                    "find this agent only through UNBROKEN_AGENT_SOCKET",
                )
                self.path = private
                self.supervisor.socket_path = private
        else:
            _bind_private(sock, self.path)
        if self.group is not None:  # the group's members may send (and only they, below)
            os.chown(self.path, -1, self.group)
            os.chmod(self.path, 0o660)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setblocking(False)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)
        self._bound = True

    def _readable(self) -> None:
        """Read every queued datagram with its sender's credentials."""
        assert self._sock is not None
        me = os.geteuid()
        while True:
            try:
                data, anc, _, _ = self._sock.recvmsg(1 << 16, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("hooks.recv_failed", error=str(e))
                return
            cred = None
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    cred = _UCRED.unpack(raw[: _UCRED.size])
            if cred is None or not self.allowed(cred[1], cred[2], me):
                self.foreign += 1
                if self.foreign in (1, 100, 10_000):
                    log.warning(
                        "hooks.foreign_sender_dropped",
                        uid=cred[1] if cred else None,
                        pid=cred[0] if cred else None,
                        dropped=self.foreign,
                    )
                continue
            self.datagram_received(data, cred[0])

    def allowed(self, uid: int, gid: int, me: int) -> bool:
        """Whether a datagram of user `uid` (group `gid`) is taken: ours, root's, or, with a
        group, a member's (by the user database, looked up at most once a minute per user)."""
        if uid in (me, 0):
            return True
        if self.group is None:
            return False
        if gid == self.group:
            return True
        now = time.monotonic()
        known = self._members.get(uid)
        if known is None or now - known[1] > 60.0:
            if len(self._members) > 4096:
                self._members.clear()
            known = (uid_in_group(uid, self.group), now)
            self._members[uid] = known
        return known[0]

    def datagram_received(self, data: bytes, pid: int) -> None:
        """One report from process `pid` (the kernel's word for who sent it)."""
        try:
            rep = hpb.WorkerReport.FromString(data)
        except Exception:
            self.bad += 1
            return
        rep.pid = pid
        kind = rep.WhichOneof("kind")
        if kind == "hello" and rep.hello.attach:
            self._attach(rep)
            return
        a = self.attached.get(rep.pid)
        if a is not None:
            self.reports += 1
            if kind == "step":
                if rep.step.step != a.step:
                    a.last_progress = time.monotonic()
                a.step, a.step_time_ms = rep.step.step, rep.step.step_time_ms
                a.loss = rep.step.loss if rep.step.has_loss else None
                a.reports += 1
                a.last_report = time.monotonic()
            return
        w = self.supervisor.by_pid(rep.pid) or self.supervisor.workers.get(rep.local_rank)
        if w is None:
            self.bad += 1
            return
        self.reports += 1
        if kind == "step":
            s = rep.step
            first = w.step == 0 and s.step > 0
            w.on_step(
                s.step,
                s.loss if s.has_loss else None,
                s.step_time_ms,
                time.monotonic(),
                (s.peak_loss, s.peak_step) if s.has_peak else None,
                dict(s.timings_ms) if s.timings_ms else None,
                steps=s.steps,
            )
            if w.beat_now and self.on_outlier is not None:
                self.on_outlier()
            elif (first or w.beat_now) and self.on_beat_now is not None:
                self.on_beat_now()
            if self.on_step is not None:
                self.on_step()
        elif kind == "fingerprint":
            w.on_fingerprint(rep.fingerprint)
        elif kind == "phase":
            step = rep.phase.step if rep.phase.HasField("step") else None
            w.on_phase(rep.phase.name, time.monotonic(), step, rep.phase.source)
        elif kind == "hello":
            w.reply_socket = rep.hello.reply_socket
            w.stack_signal = rep.hello.stack_signal
            w.restop_signal = rep.hello.restop_signal

    def _attach(self, rep: hpb.WorkerReport) -> None:
        """Remember an SDK process the agent did not start and tell it where flash lives."""
        h = rep.hello
        if not h.reply_socket:
            self.bad += 1
            return
        own = self.supervisor.by_pid(rep.pid)
        if own is not None:  # the SDK in a worker this agent started: it stays the agent's
            own.reply_socket = h.reply_socket
            self.reports += 1
            self._sendto(hpb.WorkerCommand(welcome=self.welcome()), h.reply_socket, own.local_rank)
            return
        if len(self.attached) >= MAX_ATTACHED:
            self.prune()
        if len(self.attached) >= MAX_ATTACHED:  # all alive: forget the oldest
            del self.attached[next(iter(self.attached))]
        self.attached[rep.pid] = Attached(
            pid=rep.pid,
            local_rank=rep.local_rank,
            rank=h.rank,
            world_size=h.world_size,
            reply_socket=h.reply_socket,
        )
        self.reports += 1
        log.info(
            "hooks.attached",
            pid=rep.pid,
            rank=h.rank,
            local_rank=rep.local_rank,
            world=h.world_size,
        )
        self._sendto(hpb.WorkerCommand(welcome=self.welcome()), h.reply_socket, rep.local_rank)

    def statuses(self, now: float) -> list[dpb.WorkerStatus]:
        """Heartbeat entries of the attached workers still alive (the dead are forgotten)."""
        self.prune()
        return [
            dpb.WorkerStatus(
                local_rank=a.local_rank,
                global_rank=a.rank,
                pid=a.pid,
                state=dpb.WORKER_STATE_RUNNING,
                step=a.step,
                loss=a.loss if a.loss is not None else 0.0,
                has_loss=a.loss is not None,
                step_time_ms=a.step_time_ms,
                since_progress_ms=(now - a.last_progress) * 1000.0 if a.last_progress else 0.0,
            )
            for a in self.attached.values()
        ]

    def prune(self) -> int:
        """Forget attached workers whose process is gone; return how many were dropped."""
        dead = [pid for pid in self.attached if not pid_alive(pid)]
        for pid in dead:
            del self.attached[pid]
        return len(dead)

    def _sendto(self, cmd: hpb.WorkerCommand, addr: str, local_rank: int) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto(cmd.SerializeToString(), addr)
            return True
        except OSError as e:
            log.warning("worker command not delivered", local_rank=local_rank, error=str(e))
            return False

    def send_to(self, w: Worker, cmd: hpb.WorkerCommand) -> bool:
        """Send `cmd` to one of the agent's own workers; False when it has no reply socket
        or the send failed."""
        return bool(w.reply_socket) and self._sendto(cmd, w.reply_socket, w.local_rank)

    def send(self, cmd: hpb.WorkerCommand) -> int:
        """Send `cmd` to every worker that gave a reply socket, the agent's own and the
        attached ones; return how many got it."""
        if self._sock is None:
            return 0
        self.prune()
        n = 0
        for w in self.supervisor.workers.values():
            if w.reply_socket:
                n += self._sendto(cmd, w.reply_socket, w.local_rank)
        for a in self.attached.values():
            n += self._sendto(cmd, a.reply_socket, a.local_rank)
        return n

    def close(self) -> None:
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._bound:  # never unlink a path another agent holds
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
