"""Warm standby workers (agent/warm.py) behave like cold starts, and a crash restarts in one.

1. The supervisor alone, with a plain script and a `-m` module as the worker: a worker
   started in a warm standby prints the same argv, environment, `__name__`, `sys.path[0]`
   and niceness (a standby waits at nice 19) and exits with the same code as a cold one; it
   is the standby's own process (same pid), the leader of its own process group in the
   agent's session (one autogroup: the agent's priorities apply), a child of the agent;
   its stacks can be dumped (SIGUSR1) and a SIGTERM of its group ends it as it ends a cold
   one. A standby whose environment no longer matches is discarded and the worker starts
   cold.
2. A real driver (recovery loop) and a real agent with 2 workers training the tiny model
   (dp2, flash every step): a worker is SIGKILLed; the loop recovers in-job: the killed rank
   restarts in a standby that already imported torch, the other rank keeps its process
   (docs/in-job-recovery.md), and training continues. Every step's loss, before
   and after the restore, equals an uninterrupted cold run's.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from tests.jobs import TRAIN, reference
from unbroken.agent import warm as warmlib
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor
from unbroken.cli.cluster import is_agent_helper, until

pytestmark = pytest.mark.integration

PROBE = textwrap.dedent(
    """
    import json, os, sys
    keys = ("RANK", "WORLD_SIZE", "MASTER_PORT", "UNBROKEN_AGENT_PID", "PYTHONUNBUFFERED")
    print(json.dumps({
        "argv": sys.argv, "name": __name__, "path0": sys.path[0],
        "env": {k: os.environ.get(k) for k in keys},
        "spec": getattr(__spec__, "name", None),
        "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "sid": os.getsid(0),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }))
    if "--sleep" in sys.argv:
        import faulthandler, signal, time
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        print("sleeping", flush=True)
        time.sleep(60)
    sys.exit(int(os.environ.get("PROBE_CODE", "0")))
    """
)


def _line(log: Path, before: int) -> dict[str, object]:
    lines = log.read_text().splitlines()[before:]
    return json.loads(next(x for x in lines if x.startswith("{")))  # type: ignore[no-any-return]


def _nlines(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


async def _wait_ready(sup: Supervisor, n: int, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while sum(s.ready for s in sup.standbys) < n:
        assert asyncio.get_running_loop().time() < deadline, "standbys not ready in time"
        await asyncio.sleep(0.05)


def test_warm_start_is_a_cold_start(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "probemod.py").write_text(PROBE)
    env = {"PYTHONPATH": str(tmp_path), "PROBE_CODE": "3"}

    async def run() -> None:
        spec = WorkerSpec(
            cmd=[sys.executable, str(tmp_path / "probe.py"), "x", "--y=1"],
            nproc=1,
            log_dir=str(tmp_path / "logs"),
            extra_env=env,
            warm_preload=("json",),  # cheap: this test is about behaviour, not speed
            warm_nice=19,  # wait on idle CPU, take the workers' niceness (5) at hand-off
            master_port=12345,
        )
        sup = Supervisor(spec, str(tmp_path / "agent.sock"))
        log = tmp_path / "logs" / "worker-0.log"
        try:
            for cmd in (spec.cmd, [sys.executable, "-m", "probemod", "x", "--y=1"]):
                sup.launch = replace(sup.launch, cmd=tuple(cmd))
                seen = []
                for warm in (True, False):
                    sup.spec = replace(spec, warm=warm)
                    if warm:
                        sup.warm_up()
                        await asyncio.sleep(0)
                        await _wait_ready(sup, 1)
                        standby_pid = sup.standbys[0].proc.pid
                        assert psutil.Process(standby_pid).nice() == 19  # waits on idle CPU
                    mark = _nlines(log)
                    w = await sup.start(0, refill=False)
                    assert w.warm is warm
                    if warm:
                        assert w.pid == standby_pid
                    assert psutil.Process(w.pid).ppid() == os.getpid()
                    await asyncio.wait_for(w.tasks[-1], 60)
                    assert w.exit_code == 3
                    seen.append(_line(log, mark))
                assert seen[0] == seen[1], seen
                assert seen[0]["name"] == "__main__" and seen[0]["pgid_is_pid"] is True
                assert seen[0]["sid"] == os.getsid(0)  # the agent's session (autogroup)
                assert seen[0]["argv"][1:] == ["x", "--y=1"]  # type: ignore[index]
                assert seen[0]["nice"] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)
                assert seen[0]["env"]["MASTER_PORT"] == "12345"  # type: ignore[index]

            # A stop (SIGTERM to the group) ends a warm worker as it ends a cold one.
            sup.launch = replace(
                sup.launch, cmd=(sys.executable, str(tmp_path / "probe.py"), "--sleep")
            )
            codes = []
            for warm in (True, False):
                sup.spec = replace(spec, warm=warm)
                if warm:
                    sup.warm_up()
                    await asyncio.sleep(0)
                    await _wait_ready(sup, 1)
                mark = _nlines(log)
                w = await sup.start(0, refill=False)
                assert w.warm is warm
                while "sleeping" not in log.read_text().splitlines()[mark:]:  # it runs
                    await asyncio.sleep(0.05)
                w.stack_signal = True  # what the worker's hello says once hooks are installed
                stacks = await sup.stop(w, grace_s=5.0, dump=True)
                assert "probe.py" in stacks and "<module>" in stacks, stacks
                assert w.proc is not None
                codes.append(w.proc.returncode)
            assert codes == [-signal.SIGTERM, -signal.SIGTERM]

            # A standby started before the environment changed is not used.
            sup.spec = replace(spec, warm=True)
            sup.warm_up()
            await asyncio.sleep(0)
            await _wait_ready(sup, 1)
            stale = sup.standbys[0].proc
            sup.launch = replace(sup.launch, cmd=(sys.executable, str(tmp_path / "probe.py")))
            sup.launch = sup.launch.with_env(OMP_NUM_THREADS="2")
            w = await sup.start(0, refill=False)
            assert not w.warm and w.pid != stale.pid
            await asyncio.wait_for(stale.wait(), 10)
            await asyncio.wait_for(w.tasks[-1], 60)
            assert w.exit_code == 3
        finally:
            await sup.close(grace_s=2.0)
        assert not sup.standbys

    asyncio.run(run())


def test_parse_target() -> None:
    py = sys.executable
    t = warmlib.parse_target([py, "-u", "-X", "dev", "-m", "a.b", "--c"])
    assert t == warmlib.Target(py, ("-u", "-X", "dev"), "a.b", "", ("--c",))
    assert warmlib.parse_target([py, "s.py", "1"]) == warmlib.Target(py, (), "", "s.py", ("1",))
    for cold in ([py, "-c", "pass"], ["bash", "x.sh"], [py], [py, "-m"], [py, "-"]):
        assert warmlib.parse_target(cold) is None, cold
    assert warmlib.compatible({"A": "1", "RANK": "0"}, {"A": "1", "RANK": "3"}) == ""
    assert "OMP" in warmlib.compatible({"OMP": "1"}, {"OMP": "2"})


def test_crashed_worker_restarts_warm_and_training_continues(
    tmp_path: Path, etcd_server: object
) -> None:
    endpoint = etcd_server.endpoint  # type: ignore[attr-defined]
    metrics = tmp_path / "metrics.jsonl"
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(name: str, args: list[str]) -> None:
        out = open(tmp_path / f"{name}.log", "ab")  # the child owns it
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "unbroken.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        out.close()

    def agent_log() -> str:
        return (tmp_path / "agent.log").read_text(errors="replace")

    def logs() -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(tmp_path.rglob("*.log"))
        )

    def steps() -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.endswith("}"):
                    m = json.loads(line)
                    out.setdefault(int(m["step"]), []).append(float(m["loss"]))
        return out

    try:
        cmd = " ".join([sys.executable, *TRAIN, "--steps", "100000", "--metrics-out", str(metrics)])
        job = f"warm-{os.getpid()}"
        spawn(
            "driver",
            [
                "driver", "--etcd", endpoint, "--job-id", job, "--listen", "127.0.0.1:0",
                "--port-file", str(tmp_path / "driver.json"), "--miss-limit", "30",
                "--nodes", "1", "--workers-per-node", "2", "--dp", "2",
                "--worker-cmd", cmd, "--master-addr", "127.0.0.1",
            ],
        )  # fmt: skip
        until((tmp_path / "driver.json").exists, 90, "the driver's port file")
        port = json.loads((tmp_path / "driver.json").read_text())["grpc_port"]
        spawn(
            "agent",
            [
                "agent", "--driver", f"127.0.0.1:{port}", "--node-id", "n0", "--no-start",
                "--worker-cmd", sys.executable + " -c pass", "--nproc-per-node", "2",
                "--log-dir", str(tmp_path / "workers"), "--socket", str(tmp_path / "n0.sock"),
                "--flash-dir", str(tmp_path / "shm"), "--flash-job", job,
                "--persist-url", str(tmp_path / "storage"), "--no-selfcheck", "--warm-workers",
                "--allow-remote-cmd",  # the driver's --worker-cmd wins
            ],
        )  # fmt: skip
        until(lambda: max(steps(), default=0) >= 2, 120, "training to start")
        # Wait for the refill: two standbys started after the first workers (one still
        # importing is handed the restart all the same: it is further along than a new one).
        until(
            lambda: agent_log().split("worker started")[-1].count("standby started") >= 2,
            90,
            "two standbys after the first start",
        )
        spare_pids = {
            int(pid)
            for pid in re.findall(
                r"standby started\s+.*?pid=(\d+)", agent_log().split("worker started")[-1]
            )
        }
        kids = [
            p
            for p in psutil.Process(procs["agent"].pid).children()
            if p.pid not in spare_pids and not is_agent_helper(p)
        ]
        assert len(kids) == 2, kids
        # both standbys imported (their imports load the host: a rank slowed then is flagged
        # hung) and a few steps in, so the killed rank has a copy in the ring (its first copy
        # is still being written at step 2 on a loaded host: then no step is common and the
        # job starts afresh, which is right, but not what this test is about)
        until(
            lambda: agent_log().split("worker started")[-1].count("standby ready") >= 2,
            120,
            "both standbys imported",
        )
        until(lambda: max(steps(), default=0) >= 5, 90, "five steps")
        crash_step = max(steps())
        kids[1].kill()
        until(
            lambda: max(steps(), default=0) >= crash_step + 3,
            90,
            "training past the crash",
        )
        restarts = re.findall(r"worker started\s+.*?pid=(\d+) restarts=1 warm=(\w+)", agent_log())
        assert len(restarts) == 1, agent_log()[-3000:]  # only the killed rank (in-job)
        assert all(w == "True" for _, w in restarts), restarts
        assert {int(p) for p, _ in restarts} <= spare_pids, (restarts, spare_pids)
        assert kids[0].is_running() and "in-job rejoin" in agent_log(), agent_log()[-3000:]
        log0 = (tmp_path / "workers" / "worker-0.log").read_text(errors="replace")
        assert "flash.restored" in log0, log0[-2000:]
        # the survivor its own trainer, the standby its dry run's (trainer/keeptrainer.py)
        for rank in (0, 1):
            log = (tmp_path / "workers" / f"worker-{rank}.log").read_text(errors="replace")
            assert "trainer kept across worlds" in log, log[-2000:]
    except AssertionError as e:
        raise AssertionError(f"{e}\n{logs()}") from None
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)

    got = steps()
    last = max(got)
    assert sorted(got) == list(range(1, last + 1)), sorted(got)
    ref = reference(tmp_path / "reference", last)
    for step, values in got.items():
        for v in values:
            assert v == ref[step], (step, v, ref[step])


def test_a_standby_handed_off_while_importing_takes_the_workers_priority_at_once(
    tmp_path: Path,
) -> None:
    """A standby waiting at nice 19 reads its job only once its imports are done; handed
    off before then, it must not go on importing at nice 19 (the rank would start behind the
    job's own work: in `make run`, 18 s instead of about 5)."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "slowimport.py").write_text("import time\ntime.sleep(3)\n")

    async def run() -> None:
        spec = WorkerSpec(
            cmd=[sys.executable, str(tmp_path / "probe.py")],
            nproc=1,
            log_dir=str(tmp_path / "logs"),
            extra_env={"PYTHONPATH": str(tmp_path)},
            warm=True,
            warm_preload=("slowimport",),
            warm_nice=19,
        )
        sup = Supervisor(spec, str(tmp_path / "agent.sock"))
        target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + spec.nice)
        try:
            sup.warm_up()
            deadline = asyncio.get_running_loop().time() + 30
            while not sup.standbys:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            s = sup.standbys[0]
            while psutil.Process(s.proc.pid).nice() != 19:  # its wrapper sets it
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            assert not s.ready
            w = await sup.start(0, refill=False)
            assert w.warm and w.pid == s.proc.pid
            threads = psutil.Process(w.pid).threads()
            nices = {os.getpriority(os.PRIO_PROCESS, t.id) for t in threads}
            assert nices == {target}, nices  # at once, while it still imports
            await asyncio.wait_for(w.tasks[-1], 60)
            line = _line(tmp_path / "logs" / "worker-0.log", 0)
            assert line["nice"] == target
        finally:
            await sup.close(grace_s=1.0)

    if not warmlib.may_raise_priority(5):
        pytest.skip("this user may not raise a priority back (root, CAP_SYS_NICE or RLIMIT_NICE)")
    asyncio.run(run())
