"""The chaos TCP proxy on real sockets: forwards, blackholes, drops, heals (about 1 s).

The "agent" is a child process that holds connections through the proxy to an echo
server in this process, so the cut targets a process other than the test's own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.chaos.proxy import DriverProxy, ProxyLoop, ports_of

pytestmark = pytest.mark.chaos

CLIENT = r"""
import socket, sys
port = int(sys.argv[1])
conns = []
for line in sys.stdin:
    cmd = line.split()
    try:
        if cmd[0] == "open":
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=1.0))
            print("ok", flush=True)
        elif cmd[0] == "echo":
            s = conns[int(cmd[1])]
            s.sendall(b"ping")
            print("got", s.recv(16).decode() or "EOF", flush=True)
    except OSError as e:
        print("error", type(e).__name__, flush=True)
"""


class Client:
    """A child process speaking through the proxy, one command per line."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, cmd: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def echo_port() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue

            def echo(c: socket.socket = c) -> None:
                with c:
                    while data := c.recv(64):
                        c.sendall(data)

            threading.Thread(target=echo, daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield int(srv.getsockname()[1])
    stop.set()
    t.join(5)
    srv.close()


def test_proxy_forwards_blackholes_drops_and_heals(echo_port: int) -> None:
    loop = ProxyLoop()
    proxy = DriverProxy(loop, "a")
    client: Client | None = None
    try:
        proxy.start()
        proxy.set_upstream(f"127.0.0.1:{echo_port}")
        client = Client(proxy.port)
        assert client("open") == "ok"
        assert client("echo 0") == "got ping"
        deadline = time.monotonic() + 10
        while not ports_of(client.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

        assert proxy.cut(client.proc.pid, "blackhole") == 1
        assert client("echo 0") == "error TimeoutError"  # silence, not a reset
        proxy.heal(client.proc.pid)  # blackholed streams are closed: the client reconnects
        assert client("open") == "ok"
        assert client("echo 1") == "got ping"

        assert proxy.cut(client.proc.pid, "drop") == 1
        assert client("echo 1") in ("got EOF", "error ConnectionResetError")
        assert client("open") == "ok"  # accepted by the kernel, then closed at once
        assert client("echo 2") in ("got EOF", "error ConnectionResetError")
        proxy.heal(client.proc.pid)
        assert client("open") == "ok"
        assert client("echo 3") == "got ping"
        assert proxy.refused >= 1
    finally:
        if client is not None:
            client.close()
        proxy.close()
        loop.close()
