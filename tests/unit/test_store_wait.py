"""`trainer.run.wait_for_store`: a rank other than 0 joins once rank 0's store listens."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from unbroken.trainer.run import wait_for_store

pytestmark = pytest.mark.unit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_it_returns_once_the_port_listens() -> None:
    port = _free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    accepted: list[object] = []

    def listen_later() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()
        accepted.append(server.accept()[0])

    t = threading.Thread(target=listen_later)
    t.start()
    t0 = time.monotonic()
    try:
        assert wait_for_store("127.0.0.1", port, 30.0)
        assert time.monotonic() - t0 >= 0.3  # not before the store listened
        t.join(10)
        assert accepted  # it connected (and hung up): the store saw one client come and go
    finally:
        server.close()


def test_nothing_listening_is_false_after_the_timeout() -> None:
    assert not wait_for_store("127.0.0.1", _free_port(), 0.2)
