"""The worker -> agent local channel: one datagram per report on the agent's unix socket.

A worker (the embedded engine, a plugin trainer or any script) calls `report_step` once
per step. Each call is one datagram on the agent's unix socket (env
`UNBROKEN_AGENT_SOCKET`): no connection, no thread, no gRPC, no torch, a few microseconds;
when the agent is gone or its buffer is full the report is dropped rather than slowing the
step. The agent's commands (pause, resume, flash-save, stop) come back on a reply socket
in this user's private runtime directory. `install()` also registers a faulthandler stack
dump on SIGUSR1 so the agent can dump a hung worker's Python stacks before it kills it,
ties the worker's life to its agent's (`die_with_agent`: PR_SET_PDEATHSIG, then a
check that the parent is still the agent named in `UNBROKEN_AGENT_PID`, which closes the
race of an agent dying before the prctl), and has a fatal signal leave the Python stacks in
the worker's log (`crash_stacks`). Outside an agent (no env variable) every call is
a no-op.

The hooks SDK for scripts the agent did not start (`unbroken.trainer.hooks`) attaches
through the same channel. With a system agent of another user, which shares its socket with
a group of ours (`--socket-group`), the reply socket is bound in the agent's socket
directory instead (mode 0620 in the group: only the agent, whose user is a member, and
other members may send to it) and a command is taken only from the agent's user, root or
ourselves, by the kernel's credentials of its sender.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import math
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

from unbroken.common.paths import private_dir, shared_with_us
from unbroken.common.workerenv import AGENT_PID as ENV_AGENT_PID
from unbroken.common.workerenv import AGENT_SOCKET as ENV_SOCKET
from unbroken.common.workerenv import STACKS_END
from unbroken.proto import hooks_pb2 as hpb

ENV_LOCAL_RANK = "LOCAL_RANK"
STACK_SIGNAL = signal.SIGUSR1
RESTOP_SIGNAL = signal.SIGUSR2  # dump the stacks, then stop again (a stopped worker's dump)
# A collective wait shorter than this is not reported (`Hooks.collective_entered`): the
# agent's hang floor is about a second, its heartbeat 100 ms.
LAZY_COLLECTIVE_S = 0.1
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_UCRED.size)


def shared_agent(path: str) -> tuple[str, int] | None:
    """(the socket's directory, the agent's uid) when `path` is another user's agent socket
    shared with a group of ours; None otherwise (our own agent's, root's, or none)."""
    try:
        st = os.stat(path)
        dst = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return None
    if st.st_uid in (os.geteuid(), 0) or not shared_with_us(st, dst):
        return None
    return os.path.dirname(os.path.abspath(path)), st.st_uid


def die_with_agent() -> bool:
    """Have the kernel SIGKILL this process when its parent (the agent) dies.

    The agent also starts workers under `setpriv --pdeathsig KILL`; this covers workers
    started some other way. Setting the signal in the worker itself is safe (no fork with
    threads involved). If the parent is already not the agent, the agent died before the
    signal was armed: exit at once instead of training as an orphan.

    Returns:
        True when the death signal is armed (Linux, under an agent).
    """
    agent = os.environ.get(ENV_AGENT_PID, "")
    if not agent.isdigit() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if int(agent) not in _ancestors():
        print(
            f"unbroken: agent {agent} is gone (parent is now {os.getppid()}); exiting",
            file=sys.stderr,
        )
        os._exit(70)
    return True


def _ancestors(limit: int = 8) -> list[int]:
    """Pids of this process's parent, grandparent, ... (a worker may run under a shell)."""
    out, pid = [], os.getppid()
    for _ in range(limit):
        if pid <= 1:
            break
        out.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


class Hooks:
    """A connectionless client of the agent's local channel."""

    def __init__(
        self,
        socket_path: str | None = None,
        local_rank: int | None = None,
        *,
        coalesce_s: float = 0.0,
    ) -> None:
        """A client of the agent at `socket_path` (default: `UNBROKEN_AGENT_SOCKET`).

        Args:
            socket_path: the agent's socket; empty: every call is a no-op.
            local_rank: this worker's local rank (default: `LOCAL_RANK`).
            coalesce_s: send at most one step report per this many seconds; the steps in
                between ride along in the next report (their mean step time, their peak
                loss). 0 sends every step.
        """
        self.path = socket_path if socket_path is not None else os.environ.get(ENV_SOCKET, "")
        rank = local_rank if local_rank is not None else os.environ.get(ENV_LOCAL_RANK, "0")
        self.local_rank = int(rank)
        self.pid = os.getpid()
        self.coalesce_s = coalesce_s
        self._last_t: float | None = None
        self._sent_t: float | None = None  # when the last step report went out
        self._held: tuple[int, float | None] | None = None  # the newest unsent step, loss
        self._held_steps = 0
        self._held_ms = 0.0  # their summed step time
        self._peak: tuple[float, int] | None = None  # their highest (or non-finite) loss
        self._wait_ms = 0.0  # collective waits marked since the last step (`collective`)
        self._held_timings: dict[str, float] = {}  # the held steps' summed timings
        # `collective_entered`: when the rank entered its step's collective (None: it is
        # not in one, or the agent was told); a marker thread tells the agent if it lasts
        self._coll_since: float | None = None
        # Held while a phase or step report is sent and `_coll_since` is looked at or
        # cleared: the marker's late "collective" never follows a newer phase or step. It
        # did: a rank whose peer died in the all-reduce said "held" and the marker, which
        # had not seen the collective end, said "collective" after it; the agent's in-job
        # hold then waited for "held" until the rank said it again a second later (bench
        # recovery, node loss: 1.0 s of a 1.6 s resume). Reentrant: a script's signal
        # handler may say a phase while the main thread is inside a send.
        self._say = threading.RLock()
        self._marker: threading.Thread | None = None
        self._marker_stop = threading.Event()
        self._sock: socket.socket | None = None
        self._reply = ""
        self.reply_error = ""  # why no reply socket could be bound (commands cannot reach us)
        # senders whose commands are taken, when others could reach the reply socket
        self._senders: frozenset[int] | None = None
        self.refused = 0  # commands dropped: their sender was neither the agent nor us
        if self.path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            # The agent's replies come to a socket file in this user's private runtime
            # directory: unlike an abstract-namespace name, no other user can send to it.
            # A system agent of another user cannot enter that directory: the socket goes
            # into the agent's group-shared one, and senders are checked (`commands`).
            shared = shared_agent(self.path)
            try:
                where = shared[0] if shared else private_dir()
                reply = os.path.join(where, f"w-{os.geteuid()}-{self.pid}-{id(self):x}.sock")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(reply)
                self._sock.bind(reply)
                os.chmod(reply, 0o620 if shared else 0o600)
                if shared:  # the directory's group: the agent's user is a member
                    os.chown(reply, -1, os.stat(where).st_gid)
                    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
                    self._senders = frozenset({os.geteuid(), 0, shared[1]})
                self._reply = reply
            except OSError as e:
                self.reply_error = f"no private reply socket ({e}); agent commands cannot reach us"
                self._reply = ""

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def replies(self) -> bool:
        """Whether the agent's commands can reach this client (a reply socket is bound)."""
        return bool(self._reply)

    def _send(self, report: hpb.WorkerReport) -> bool:
        if self._sock is None:
            return False
        report.local_rank = self.local_rank
        report.pid = self.pid
        try:
            self._sock.sendto(report.SerializeToString(), self.path)
            return True
        except OSError:  # agent gone or its buffer full: drop, never block the step
            return False

    def hello(
        self,
        *,
        stack_signal: bool,
        restop_signal: bool = False,
        attach: bool = False,
        rank: int = 0,
        world_size: int = 0,
    ) -> bool:
        """Tell the agent where to send commands and which signals dump stacks.

        Args:
            stack_signal: SIGUSR1 dumps this process's stacks.
            restop_signal: SIGUSR2 dumps the stacks and stops the process again.
            attach: this process was not started by the agent (the hooks SDK): the agent
                tracks it as an attached worker and answers with a Welcome.
            rank: the global rank, for an attached worker.
            world_size: the world size, for an attached worker.
        """
        return self._send(
            hpb.WorkerReport(
                hello=hpb.Hello(
                    reply_socket=self._reply,
                    stack_signal=stack_signal,
                    restop_signal=restop_signal,
                    attach=attach,
                    rank=rank,
                    world_size=world_size,
                )
            )
        )

    def phase(self, name: str, step: int | None = None, source: str = "") -> bool:
        """Tell the agent this rank enters phase `name` (now).

        "train" is judged for hangs by the rank's step rhythm (about a second at 100 ms
        steps); any other name ("restore", "checkpoint", "eval") by the agent's longer
        phase limit, so a slow restore or evaluation is not a hang. The next step report
        puts the rank back into "train". `step`: the step the state is at, given with the
        first "train" after a start: the step it restored (0: from scratch); `source` with
        it: where that state came from ("memory", "buddy", "storage").
        """
        return self._send_past_wait(
            hpb.WorkerReport(phase=hpb.PhaseReport(name=name, step=step, source=source))
        )

    def _send_past_wait(self, report: hpb.WorkerReport) -> bool:
        """Send a phase or step report: the rank is out of its collective wait, so the
        marker thread says nothing after it (`_say`)."""
        with self._say:
            self._coll_since = None
            return self._send(report)

    def fingerprint(self, step: int, fingerprints: dict[str, int]) -> bool:
        """Send this rank's state fingerprints after `step` (trainer/sdc.py): one datagram,
        never coalesced, so the driver sees every fingerprinted step."""
        keys = sorted(fingerprints)
        report = hpb.Fingerprint(step=step, keys=keys, hashes=[fingerprints[k] for k in keys])
        return self._send(hpb.WorkerReport(fingerprint=report))

    def collective_entered(self) -> None:
        """The rank enters its step's collective (the embedded engine's one timed
        all-reduce). Unlike `phase("collective")` nothing is sent now: a marker thread
        sends that phase once the wait has lasted `LAZY_COLLECTIVE_S`, so a step whose
        peers are on time costs no datagram (each one woke the agent and, on a busy node,
        gave it this rank's CPU: about half a millisecond per step), and a rank left waiting
        for a stopped peer is still judged as a victim long before its hang threshold."""
        self._coll_since = time.monotonic()
        if self._marker is None and self._sock is not None:
            self._marker = threading.Thread(
                target=self._mark_long_waits, name="unbroken-hooks-marker", daemon=True
            )
            self._marker.start()

    def _mark_long_waits(self) -> None:
        while not self._marker_stop.wait(LAZY_COLLECTIVE_S / 2):
            with self._say:
                since = self._coll_since
                if since is not None and time.monotonic() - since >= LAZY_COLLECTIVE_S:
                    self._coll_since = None
                    self._send(hpb.WorkerReport(phase=hpb.PhaseReport(name="collective")))

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Mark a wait for peers (an all-reduce, a barrier): its time is reported as
        `collective_wait` and the rest of the step as `compute`, for straggler detection."""
        self.phase("collective")  # a long wait here is a peer's hang, judged as such
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._wait_ms += (time.monotonic() - t0) * 1000.0

    def step(
        self,
        step: int,
        loss: float | None = None,
        step_time_ms: float | None = None,
        **timings_ms: float,
    ) -> bool:
        """Report a finished step; `step_time_ms` defaults to the time since the last report.

        Args:
            step: the step just finished (non-decreasing).
            loss: its loss (None when unknown).
            step_time_ms: its duration in ms (default: measured between reports).
            **timings_ms: named phase durations in ms ("forward", "backward", ...).

        Returns:
            True when a datagram was sent now; False when the step is held for the next
            report (`coalesce_s`) or the datagram was dropped.
        """
        self._coll_since = None  # out of the step's collective
        now = time.monotonic()
        if step_time_ms is None:
            step_time_ms = 0.0 if self._last_t is None else (now - self._last_t) * 1000.0
        self._last_t = now
        if self._wait_ms and "collective_wait" not in timings_ms:  # marked by `collective`
            wait = min(self._wait_ms, step_time_ms)
            timings_ms = {**timings_ms, "compute": step_time_ms - wait, "collective_wait": wait}
        self._wait_ms = 0.0
        if loss is not None:
            loss = float(loss)
            p = self._peak  # a non-finite loss, once held, is never replaced
            if p is None or (math.isfinite(p[0]) and (not math.isfinite(loss) or loss > p[0])):
                self._peak = (loss, step)
        # the newest step, as plain values: the message is built only when it is sent
        self._held = (step, loss)
        self._held_steps += 1
        self._held_ms += step_time_ms
        for k, v in timings_ms.items():
            self._held_timings[k] = self._held_timings.get(k, 0.0) + float(v)
        if (
            self.coalesce_s > 0
            and self._sent_t is not None
            and now - self._sent_t < self.coalesce_s
            and (loss is None or math.isfinite(loss))
        ):
            return False
        return self.flush_steps(now)

    def flush_steps(self, now: float | None = None) -> bool:
        """Send the held step report, if any (True when a datagram went out)."""
        if self._held is None:
            return False
        step, loss = self._held
        rep = hpb.StepReport(
            step=step, steps=self._held_steps, step_time_ms=self._held_ms / self._held_steps
        )
        if loss is not None:
            rep.loss, rep.has_loss = loss, True
        n = self._held_steps
        for k, v in self._held_timings.items():  # the mean over the steps it stands for
            rep.timings_ms[k] = v / n
        if self._peak is not None:
            rep.has_peak, (rep.peak_loss, rep.peak_step) = True, self._peak
        self._held, self._held_steps, self._held_ms, self._peak = None, 0, 0.0, None
        self._held_timings = {}
        self._sent_t = time.monotonic() if now is None else now
        return self._send_past_wait(hpb.WorkerReport(step=rep))

    def wait(self, timeout_s: float) -> None:
        """Block until a command may be waiting or `timeout_s` passed (then read `commands`)."""
        if self._sock is not None:
            select.select([self._sock], [], [], max(0.0, timeout_s))

    def hold_waiting(self) -> bool:
        """Whether the next command waiting is a hold, without taking it (`commands` still
        reads it): a side thread's look while the main thread is blocked in a collective.
        Only where our reply socket is private (no sender to check)."""
        if self._sock is None or self._senders is not None:
            return False
        try:
            data = self._sock.recv(65536, socket.MSG_PEEK)
            return hpb.WorkerCommand.FromString(data).WhichOneof("kind") == "hold"
        except Exception:  # nothing waiting, or not a command
            return False

    def commands(self) -> list[hpb.WorkerCommand]:
        """Commands the agent sent (pause, resume, flash-save), without blocking."""
        out: list[hpb.WorkerCommand] = []
        if self._sock is None:
            return out
        while True:
            try:
                if self._senders is None:
                    data = self._sock.recv(65536)
                else:  # a shared directory: only the agent's user, root and we may command
                    data, anc, _, _ = self._sock.recvmsg(65536, _CMSG_SPACE)
                    uids = [
                        _UCRED.unpack(raw[: _UCRED.size])[1]
                        for level, kind, raw in anc
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
                    ]
                    if not uids or uids[0] not in self._senders:
                        self.refused += 1
                        continue
            except (BlockingIOError, OSError):
                return out
            with contextlib.suppress(Exception):
                out.append(hpb.WorkerCommand.FromString(data))

    def close(self) -> None:
        self._marker_stop.set()
        if self._sock is not None:
            self.flush_steps()
            self._sock.close()
            self._sock = None
            if self._reply:
                with contextlib.suppress(OSError):
                    os.unlink(self._reply)


_default: Hooks | None = None


def install(*, stack_signal: bool = True) -> Hooks:
    """The process-wide hooks client; registers the SIGUSR1 stack dump and says hello."""
    global _default
    if _default is None:
        _default = Hooks()
        if _default.reply_error:
            warnings.warn(f"unbroken hooks: {_default.reply_error}", RuntimeWarning, stacklevel=2)
        if _default.enabled:
            die_with_agent()
            crash_stacks()
        restop = False
        if stack_signal and _default.enabled:
            faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
            restop = _install_restop()
        _default.hello(stack_signal=stack_signal and _default.enabled, restop_signal=restop)
    return _default


def stacks_on_signal() -> bool:
    """Have SIGUSR1 write every thread's Python stack to stderr (the process goes on), where
    the signal still has its default action (which ends the process): a script that claimed
    it (Lightning's SLURM requeue, its own handler) keeps it. For a process that attached
    to an agent it did not start (torchrun's workers): a hung one's stacks, `kill -USR1`
    away. True when registered."""
    if signal.getsignal(STACK_SIGNAL) is not signal.SIG_DFL:
        return False
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    return True


def crash_stacks() -> bool:
    """Have a fatal signal (a crashed extension's SIGSEGV, SIGBUS, SIGFPE, SIGILL, or an
    abort) write every thread's Python stack to stderr, the worker's log, before the process
    dies. Without it a worker that segfaulted left nothing in its log but its exit code
    (a drill on 2026-12-05: one gloo rank exited -11 after 3 minutes of steady training).
    A process that enabled faulthandler itself keeps its own settings.

    Returns:
        True when this call enabled it.
    """
    if faulthandler.is_enabled():
        return False
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, RuntimeError, OSError):  # no usable stderr
        return False
    return True


def _dump_and_stop(signum: int, frame: Any) -> None:
    """SIGUSR2: the agent continued this stopped process only to read its stacks.

    A Python-level handler runs at the first bytecode after SIGCONT (an interrupted sleep
    returns into it), so the stacks show where it was stopped and no step runs before the
    process stops itself again. The dump ends with `STACKS_END`: the agent then has it whole
    at once (its hang flag waits for it).
    """
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    with contextlib.suppress(OSError, ValueError):  # after faulthandler's own raw writes
        os.write(sys.stderr.fileno(), f"{STACKS_END}\n".encode())
    os.kill(os.getpid(), signal.SIGSTOP)


def _install_restop() -> bool:
    """Register `_dump_and_stop` unless the script owns SIGUSR2 or this is not the main thread."""
    try:
        if signal.getsignal(RESTOP_SIGNAL) is not signal.SIG_DFL:
            return False
        signal.signal(RESTOP_SIGNAL, _dump_and_stop)
    except ValueError:  # not the main thread
        return False
    return True


def report_step(
    step: int, loss: float | None = None, step_time_ms: float | None = None, **timings_ms: float
) -> bool:
    """Report a finished step through the process-wide client (see `Hooks.step`)."""
    return install().step(step, loss, step_time_ms, **timings_ms)
