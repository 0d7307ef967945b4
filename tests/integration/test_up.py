"""`unbroken up` (what `make run` runs) brings up the cluster, trains, drills, and cleans up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


def test_up_trains_drills_and_stops_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken.cli.main",
            "up",
            "--no-live",
            "--nodes",
            "2",
            "--workers-per-node",
            "1",
            "--dp",
            "1",
            "--pp",
            "2",
            "--tp",
            "1",
            "--steps",
            "5000",
            "--duration",  # an upper bound: the run ends once the drill is over
            "300",
            # CI runs a shortened drill; `make run` adds the hang, the loss spike, the bad
            # node and the driver kill in the middle of a recovery
            "--faults",
            "driver_kill,node_loss,worker_crash",
            "--spares",
            "1",
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "first training step" in text
    for fault in ("driver SIGKILL", "node lost (agent", "worker SIGKILL"):  # cells wrap
        assert fault in text
    assert "not yet" not in text and "did not resume within" not in text
    assert re.search(r"no \w+ within \d+ s", text) is None
    assert "leader_elected×2" in text
    # the recovery loop: the crash and the lost node were recovered (a drilled fault whose
    # training did not resume shows "not yet" or makes the run exit 1), the spare took over
    assert "resumed in" in text and "steps lost" in text and "continued" in text
    assert re.search(r"first step \d+\.\d s after start", text), text[-2000:]  # the goal's 15 s
    assert "spare_assigned×1" in text and "world_resized×1" in text and "job_started×1" in text
    # nothing it started is left running: etcd, drivers, agents, workers and standbys
    assert _ours(run_dir, os.getpid()) == []


def test_up_rejects_a_layout_that_does_not_fit() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "up", "--dp", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "dp × pp × tp" in out.stderr and "--dp/--pp/--tp" in out.stderr


def _ours(run_dir: Path, but: int) -> list[int]:
    """Processes of an `up` run: their flags name the run dir (etcd, drivers, agents), or
    their agent's socket in their environment does (workers and warm standbys). Matching a
    worker by its command line also matched another test's `up` beside this one (xdist)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] == but:
            continue
        try:
            ours = str(run_dir) in " ".join(p.info["cmdline"] or []) or str(run_dir) in (
                p.environ().get("UNBROKEN_AGENT_SOCKET", "")
            )
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # gone meanwhile, or another user's
        if ours:
            out.append(p.info["pid"])
    return out


@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGTERM,
        # the same handler as SIGTERM: only in `make test-all` (CI budget)
        pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
        signal.SIGKILL,
    ],
)
def test_a_stop_signal_stops_the_whole_cluster(tmp_path: Path, sig: signal.Signals) -> None:
    """`timeout`, systemd and CI send SIGTERM; a closed terminal sends SIGHUP. Either stops
    etcd, both drivers, the agents and their trainers, as Ctrl-C does (the default action
    killed `up` alone and left the rest running as orphans). A SIGKILLed `up` cannot stop
    anything itself: its reaper (common/reaper.py) does, within its grace period."""
    run_dir = tmp_path / "run"
    argv = (
        "up --no-live --no-drill --nodes 2 --workers-per-node 1 --dp 2 --pp 1 --tp 1 --steps 99999"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unbroken.cli.main",
            *argv.split(),
            "--spares",
            "0",
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    deadline = time.monotonic() + 180
    while not (run_dir / "storage").exists():  # a step was saved: everything runs
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.5)
    assert len(_ours(run_dir, proc.pid)) >= 5  # etcd, 2 drivers, 2 agents, ...
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    if sig == signal.SIGKILL:
        deadline = time.monotonic() + 30  # the reaper's 10 s grace, plus slack
        while _ours(run_dir, proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
    else:
        assert proc.returncode == 130, out[-3000:]
        assert "stopped every process" in out
    assert _ours(run_dir, proc.pid) == []


def test_a_sigkilled_driver_takes_its_embedded_etcd_with_it(tmp_path: Path) -> None:
    data = tmp_path / "etcd-data"
    port_file = tmp_path / "driver.json"
    drv = subprocess.Popen(
        [
            sys.executable, "-m", "unbroken.cli", "driver", "--listen", "127.0.0.1:0",
            "--etcd-data-dir", str(data), "--port-file", str(port_file),
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not [p for p in _ours(data, drv.pid) if p != drv.pid]:  # its etcd runs
            assert drv.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        drv.kill()
        drv.wait()
        deadline = time.monotonic() + 20
        while _ours(data, drv.pid) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert _ours(data, drv.pid) == []
    finally:
        if drv.poll() is None:
            drv.kill()
            drv.wait()
