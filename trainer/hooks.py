"""Worker-side hooks: report step, loss and timings to the node's agent.

A worker (the embedded engine, a plugin trainer or any script) calls `report_step` once
per step. Each call is one datagram on the agent's unix socket (env
`UNBROKEN_AGENT_SOCKET`): no connection, no thread, no gRPC, no torch, a few microseconds;
when the agent is gone or its buffer is full the report is dropped rather than slowing
the step. `install()` also registers a faulthandler stack dump on SIGUSR1 so the agent
can dump a hung worker's Python stacks before it kills it, and ties the worker's life to
its agent's (`die_with_agent`: PR_SET_PDEATHSIG, then a check that the parent is still the
agent named in `UNBROKEN_AGENT_PID`, which closes the race of an agent dying before the
prctl). Outside an agent (no env variable) every call is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import socket
import sys
import time

from unbroken.proto import hooks_pb2 as hpb

ENV_SOCKET = "UNBROKEN_AGENT_SOCKET"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_AGENT_PID = "UNBROKEN_AGENT_PID"
STACK_SIGNAL = signal.SIGUSR1
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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

    def __init__(self, socket_path: str | None = None, local_rank: int | None = None) -> None:
        self.path = socket_path if socket_path is not None else os.environ.get(ENV_SOCKET, "")
        rank = local_rank if local_rank is not None else os.environ.get(ENV_LOCAL_RANK, "0")
        self.local_rank = int(rank)
        self.pid = os.getpid()
        self._last_t: float | None = None
        self._sock: socket.socket | None = None
        self._reply = ""
        if self.path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            # an abstract-namespace address for the agent's replies (Linux; no file to clean)
            self._reply = f"\0unbroken-worker-{self.pid}-{id(self)}"
            try:
                self._sock.bind(self._reply)
            except OSError:
                self._reply = ""

    @property
    def enabled(self) -> bool:
        return self._sock is not None

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

    def hello(self, *, stack_signal: bool) -> bool:
        """Tell the agent where to send commands and whether SIGUSR1 dumps stacks."""
        return self._send(
            hpb.WorkerReport(hello=hpb.Hello(reply_socket=self._reply, stack_signal=stack_signal))
        )

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
            True when the datagram was sent.
        """
        now = time.monotonic()
        if step_time_ms is None:
            step_time_ms = 0.0 if self._last_t is None else (now - self._last_t) * 1000.0
        self._last_t = now
        rep = hpb.WorkerReport(step=hpb.StepReport(step=step, step_time_ms=step_time_ms))
        if loss is not None:
            rep.step.loss = float(loss)
            rep.step.has_loss = True
        for k, v in timings_ms.items():
            rep.step.timings_ms[k] = float(v)
        return self._send(rep)

    def commands(self) -> list[hpb.WorkerCommand]:
        """Commands the agent sent (pause, resume, flash-save), without blocking."""
        out: list[hpb.WorkerCommand] = []
        if self._sock is None:
            return out
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, OSError):
                return out
            with contextlib.suppress(Exception):
                out.append(hpb.WorkerCommand.FromString(data))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


_default: Hooks | None = None


def install(*, stack_signal: bool = True) -> Hooks:
    """The process-wide hooks client; registers the SIGUSR1 stack dump and says hello."""
    global _default
    if _default is None:
        _default = Hooks()
        if _default.enabled:
            die_with_agent()
        if stack_signal and _default.enabled:
            faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
        _default.hello(stack_signal=stack_signal and _default.enabled)
    return _default


def report_step(
    step: int, loss: float | None = None, step_time_ms: float | None = None, **timings_ms: float
) -> bool:
    """Report a finished step through the process-wide client (see `Hooks.step`)."""
    return install().step(step, loss, step_time_ms, **timings_ms)
