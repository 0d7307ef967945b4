"""The agent's end of the worker -> agent local channel (proto/hooks.proto).

A unix datagram socket: each worker report is one datagram, read by the event loop
without a connection per worker. Reports update the matching `Worker` (found by pid);
commands for workers (pause, resume, flash-save) go back to the socket each worker named
in its Hello.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from pathlib import Path

import structlog

from unbroken.agent.workers import Supervisor
from unbroken.proto import hooks_pb2 as hpb

log = structlog.get_logger(__name__)


class HookServer(asyncio.DatagramProtocol):
    """Receives `WorkerReport`s and applies them to the supervisor's workers."""

    def __init__(self, path: str, supervisor: Supervisor) -> None:
        self.path = path
        self.supervisor = supervisor
        self.transport: asyncio.DatagramTransport | None = None
        self.bad = 0
        self.reports = 0

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(self.path)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: self, sock=sock)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: object) -> None:
        try:
            rep = hpb.WorkerReport.FromString(data)
        except Exception:
            self.bad += 1
            return
        w = self.supervisor.by_pid(rep.pid) or self.supervisor.workers.get(rep.local_rank)
        if w is None:
            self.bad += 1
            return
        self.reports += 1
        kind = rep.WhichOneof("kind")
        if kind == "step":
            s = rep.step
            w.on_step(s.step, s.loss if s.has_loss else None, s.step_time_ms, time.monotonic())
        elif kind == "hello":
            w.reply_socket = rep.hello.reply_socket
            w.stack_signal = rep.hello.stack_signal

    def send(self, cmd: hpb.WorkerCommand) -> int:
        """Send `cmd` to every worker that gave a reply socket; return how many got it."""
        n = 0
        if self.transport is None:
            return 0
        data = cmd.SerializeToString()
        for w in self.supervisor.workers.values():
            if w.reply_socket:
                try:
                    self.transport.sendto(data, w.reply_socket)
                    n += 1
                except OSError as e:
                    log.warning(
                        "worker command not delivered", local_rank=w.local_rank, error=str(e)
                    )
        return n

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
