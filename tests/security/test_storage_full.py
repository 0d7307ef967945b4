"""Checkpoint storage fills mid-run: the failure is told, not silent.

Real `unbroken agent` processes training dp2 (the flash end-to-end harness), persisting to
a 64 MiB tmpfs mounted for the test. Once a checkpoint is committed the test fills the
tmpfs with a file: every later shard write fails with the kernel's ENOSPC. Within one
persistence interval (plus a heartbeat) `unbroken status` names the failing nodes with the
error and says how old the newest commit is, and the driver's Prometheus endpoint shows
`unbroken_node_persist_failures{node=...}` and `unbroken_newest_commit_age_seconds`.
The old code said "running" and nothing else. Needs root (to mount a tmpfs): skipped
otherwise, with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration import test_flash_e2e as e2e

pytestmark = pytest.mark.integration


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills) needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def _fill(where: Path) -> None:
    """Write zeros into `where` until the file system says ENOSPC."""
    with open(where / "filler", "wb") as f:
        block = b"\0" * (1 << 20)
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as e:
            assert e.errno == 28, e  # ENOSPC


def _status(addr: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "status", "--driver", addr, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.timeout(900)  # two agents training dp2 on 2 shared cores
def test_a_full_checkpoint_disk_shows_in_status_and_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(e2e, "STEPS", 100_000)  # trains until the test stops it
    storage = tmp_path / "storage"
    _mount_tmpfs(storage, "64m")
    try:
        asyncio.run(_scenario(tmp_path, storage))
    finally:
        subprocess.run(["umount", "-l", str(storage)], check=False)


async def _scenario(tmp_path: Path, storage: Path) -> None:
    c = e2e.Cluster(tmp_path)
    c.persist = storage
    await c.start_driver()
    assert c.service is not None
    mport = c.service.metrics.serve(0)
    addr = f"127.0.0.1:{c.port}"
    try:
        for i, node in enumerate(("n0", "n1")):
            await c.start_agent(node, node_rank=i, flash_node=node, buddy=("n1", "n0")[i])
        await c.until("the first commit", lambda: bool(c.committed), 300)
        first = c.committed[-1]
        _fill(storage)
        filled = time.monotonic()
        deadline = filled + 120
        while True:
            st = await asyncio.to_thread(_status, addr)
            failing = {f["node_id"]: f for f in st.get("persist_failing", [])}
            if failing:
                break
            assert time.monotonic() < deadline, f"no persist failure in status: {st}"
            await asyncio.sleep(0.5)
        told_s = time.monotonic() - filled
        # the agents persist every copy (--persist-every-s 0.001 unless the driver sent a
        # longer interval): the first write after the fill fails, and the next heartbeat
        # carries it; slack for the CLI's start and 2 shared cores
        interval = max(float(st["persist_every_s"]), 0.001)
        assert told_s < interval + 30, (told_s, interval)
        f = next(iter(failing.values()))
        assert "No space left on device" in f["error"], f
        assert int(f["failures"]) >= 1
        assert int(st["newest_commit_step"]) >= first
        assert float(st["newest_commit_age_s"]) >= 0
        # the text view says it too, naming the node
        text = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "unbroken.cli", "status", "--driver", addr],
            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"},
        )  # fmt: skip
        assert "PERSIST FAILING" in text.stdout, text.stdout + text.stderr
        assert next(iter(failing)) in text.stdout
        assert "newest commit" in text.stdout
        url = f"http://127.0.0.1:{mport}/metrics"
        page = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        metrics = page.decode()
        node = next(iter(failing))
        line = [ln for ln in metrics.splitlines() if ln.startswith(
            f'unbroken_node_persist_failures{{node="{node}"}}'
        )]  # fmt: skip
        assert line and float(line[0].split()[-1]) >= 1, metrics[-2000:]
        assert "unbroken_newest_commit_age_seconds " in metrics
        # a stale commit: its age keeps growing while persistence fails
        age0 = float(st["newest_commit_age_s"])
        await asyncio.sleep(2)
        st2 = await asyncio.to_thread(_status, addr)
        assert float(st2["newest_commit_age_s"]) > age0
        assert st2.get("persist_failing")
    finally:
        c.service.metrics.close()
        await c.close()
