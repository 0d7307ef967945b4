"""The Slurm page's recipe (docs/getting-started/slurm.md), run as printed on a real cluster.

The page's fenced block is read from the page itself: `unbroken slurm submit ...` runs as
written in a fresh folder (the submit folder every node shares), against a single-host
Slurm cluster of 4 nodes (tests/slurmcluster.py; `SLURM_CONF` in the environment, as a
login node has it in /etc). The test fills in only what the job's output names: the
driver's address for HOST:PORT and the job id for JOBID. The job trains the tiny model on
two nodes with a spare; a training worker is SIGKILLed mid-run; the job resumes and trains
to its last step, and the page's `unbroken status` line answers as printed. Then the job is
FINISHED: its driver exits (`--exit-when-finished`) and the batch job leaves the queue.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurmcluster import SlurmCluster, running
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs/getting-started/slurm.md"


def page_lines() -> list[str]:
    """The commands of the page's ```bash block (comments dropped)."""
    block = re.search(r"```bash\n(.*?)```", PAGE.read_text(), re.S)
    assert block, f"{PAGE} has no ```bash block"
    return [x for x in block.group(1).splitlines() if x.strip() and not x.startswith("#")]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    with running(tmp_path / "slurm") as c:
        yield c


def test_the_page_holds_a_submit_and_a_status_line() -> None:
    lines = page_lines()
    assert [x.split()[:3] for x in lines] == [
        ["unbroken", "slurm", "submit"],
        ["unbroken", "status", "--driver"],
    ], lines


@pytest.mark.timeout(1200)  # real processes on a shared 2-core host
def test_the_slurm_recipe_trains_to_the_end_through_a_killed_worker(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    submit_line, status_line = page_lines()
    work = tmp_path / "shared"
    work.mkdir()
    # `python` and `unbroken` as a user's PATH has them (this venv's)
    env = {
        **{k: v for k, v in cluster.env.items() if not k.startswith("UNBROKEN_")},
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "USER": os.environ.get("USER", "root"),
    }
    words = shlex.split(submit_line)
    assert words[0] == "unbroken"
    r = subprocess.run([sys.executable, "-m", "unbroken.cli", *words[1:]], cwd=work, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("submitted job "), r.stdout
    job = r.stdout.split()[-1]
    output = work / f"unbroken-{job}.out"
    job_dir = work / f"unbroken-{job}"

    def logs() -> str:
        parts = [f"--- {output.name}\n{output.read_text(errors='replace')[-4000:]}"
                 if output.exists() else "(no job output)"]  # fmt: skip
        for p in sorted(work.glob("**/*.log"))[:8]:
            parts.append(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    try:
        address = ""

        def driver_named() -> bool:
            nonlocal address
            text = output.read_text() if output.exists() else ""
            m = re.search(r"unbroken: driver (\S+),", text)
            address = m.group(1) if m else ""
            return bool(address)

        until(driver_named, 120, "the job's output to name the driver", logs)
        status = [
            w.replace("HOST:PORT", address).replace("JOBID", job).replace("$USER", env["USER"])
            for w in shlex.split(status_line)
        ]

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "unbroken.cli", *args], cwd=work,
                                  env=env, capture_output=True, text=True, timeout=60)  # fmt: skip

        tls = status[status.index("--tls-cert") :]

        def state() -> dict[str, object]:
            r = cli("status", "--driver", address, *tls, "--json")
            return json.loads(r.stdout) if r.returncode == 0 else {}  # type: ignore[no-any-return]

        def step() -> int:
            s = state()
            return max(int(s.get("live_step", 0)), int(s.get("step", 0)))  # type: ignore[call-overload]

        until(lambda: step() >= 5, 600, "training to reach step 5", logs)
        printed = cli(*status[1:])
        assert printed.returncode == 0, printed.stderr  # the page's status line, as printed
        nodes = json.loads(cli("nodes", "--driver", address, *tls, "--json").stdout)
        victim = next(int(w["pid"]) for n in nodes for w in n.get("workers", []) if w.get("pid"))
        os.kill(victim, signal.SIGKILL)  # a training worker dies mid-run

        def events() -> list[dict[str, object]]:
            r = cli("events", "--driver", address, *tls, "--json")
            return [json.loads(x) for x in r.stdout.splitlines()] if r.returncode == 0 else []

        until(lambda: any("worker_failed" in e for e in events()), 120, "the kill detected", logs)
        # the start, and the resume after the kill (long before the job ends)
        until(lambda: sum("training_resumed" in e for e in events()) >= 2, 300, "the resume", logs)

        def exited() -> str:
            text = output.read_text(errors="replace")
            return text if "exiting (--exit-when-finished)" in text else ""

        # trained to its last step, the job FINISHED, its driver exited and the batch job ended
        text = until(exited, 900, "the job to finish and its driver to exit", logs)
        done = re.search(r"job finished\s.*\bstep=(\d+)", text)
        last = int(re.search(r"--steps (\d+)", submit_line).group(1))  # type: ignore[union-attr]
        assert done and int(done.group(1)) >= last, logs()

        def ended() -> bool:
            r = cluster.cmd("squeue", "-h", "-j", job, "-o", "%i", check=False)
            return job not in r.stdout.split()

        until(ended, 120, "the batch job to leave the queue", logs)
        assert (job_dir / "etcd").is_dir() and (job_dir / "pki" / "ca.pem").exists()
    finally:
        cluster.cmd("scancel", job, check=False)
