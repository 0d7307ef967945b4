"""False alarms of silent-data-corruption detection under load (docs/sdc.md): a soak run.

A real local cluster (an embedded etcd, a driver, two agents that are each other's buddy)
trains the tiny model with `--dp-mode replicate` on dp2 and fingerprints every `--every`
steps, for `--minutes` minutes, beside `stress-ng -c 1` at nice 19 (one CPU hog, so the
trainers, the buddies' recomputations and the heartbeats run on a loaded host). Nothing is
injected: every SdcSuspected is a false alarm. Counts the StepVerified events and how many
of them both buddies checked (`buddy_checked`), and records the load average over the run.

Writes bench/results/sdc_soak.json. Run: `make bench-sdc_soak ARGS="--minutes 20"`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.cli.cluster import LocalCluster, read_metrics
from unbroken.driver.eventlog import LogUnavailableError

RESULTS = Path(__file__).parent / "results" / "sdc_soak.json"
REPLICA_KEY = "bench-sdc-soak-replica-key-0123456789"


def _cluster(run: Path, every: int) -> LocalCluster:
    c = LocalCluster(run, job="sdc-soak", env={"UNBROKEN_REPLICA_KEY": REPLICA_KEY}, grace_s=15)
    c.start()
    cmd = (
        f"{sys.executable} -m unbroken.trainer.run --preset tiny --dp 2 --steps 100000000 "
        f"--log-every 1000 --dp-mode replicate --fingerprint-every {every} "
        f"--metrics-out {c.metrics}"
    )
    c.start_driver(
        "driver",
        [
            "--nodes", "2", "--workers-per-node", "1", "--dp", "2", "--worker-cmd", cmd,
            "--master-addr", "127.0.0.1", "--miss-limit", "30",
            "--archive-url", str(run / "archive"),
        ],
    )  # fmt: skip
    for node, buddy in (("n0", "n1"), ("n1", "n0")):
        c.start_agent(
            node,
            [
                "--no-start", "--worker-cmd", f"{sys.executable} -c pass", "--allow-remote-cmd",
                "--flash-dir", str(run / f"shm-{node}"), "--flash-job", "sdc-soak",
                "--flash-copies", "16", "--hang-floor-ms", "10000", "--no-warm-checks",
            ],
            buddy=buddy,
        )  # fmt: skip
    return c


def _events(c: LocalCluster) -> list[Any]:
    try:
        return c.events()
    except LogUnavailableError:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--every", type=int, default=5, help="--fingerprint-every of the trainers")
    ap.add_argument("--no-stress", action="store_true", help="without stress-ng beside it")
    ap.add_argument("--out", type=Path, default=RESULTS)
    given = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(given)
    stress_bin = shutil.which("stress-ng")
    if not args.no_stress and stress_bin is None:
        ap.error("stress-ng is not installed (apt-get install stress-ng), or pass --no-stress")
    run = Path(tempfile.mkdtemp(prefix="sdc-soak-"))
    duration = args.minutes * 60.0
    loads: list[float] = []
    stress = None
    c = _cluster(run, args.every)
    try:
        if not args.no_stress:
            assert stress_bin is not None
            stress = subprocess.Popen(
                ["nice", "-n", "19", stress_bin, "-c", "1", "--timeout", f"{int(duration) + 60}s"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        t0 = time.monotonic()
        while time.monotonic() - t0 < duration:
            time.sleep(10)
            loads.append(os.getloadavg()[0])
            print(f"{(time.monotonic() - t0) / 60:5.1f} min  load {loads[-1]:.1f}", flush=True)
        events = _events(c)
        steps = read_metrics(c.metrics)
    finally:
        if stress is not None:
            stress.terminate()
            stress.wait(timeout=30)
        c.stop()
    kinds = [e.WhichOneof("payload") for e in events]
    verified = [e.step_verified for e in events if e.HasField("step_verified")]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "make bench-sdc_soak" + (f' ARGS="{" ".join(given)}"' if given else ""),
        "minutes": args.minutes,
        "fingerprint_every": args.every,
        "layout": "dp2 replicate, 2 nodes (each the other's buddy), tiny model, CPU/gloo",
        "stress": "none" if args.no_stress else "stress-ng -c 1 at nice 19",
        "steps_trained": max(steps, default=0),
        "sdc_suspected": kinds.count("sdc_suspected"),
        "false_sdc_suspected": kinds.count("sdc_suspected"),  # nothing was injected
        "steps_verified": len(verified),
        "steps_verified_buddy_checked": sum(1 for v in verified if v.buddy_checked == 2),
        "pauses": kinds.count("training_paused"),
        "rollbacks": kinds.count("rollback"),
        "rollback_reasons": [e.rollback.reason for e in events if e.HasField("rollback")],
        "load1": round(sum(loads) / len(loads), 2) if loads else os.getloadavg()[0],
        "load1_min": min(loads, default=0.0),
        "load1_max": max(loads, default=0.0),
        "unix_time": time.time(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if result["steps_trained"]:
        shutil.rmtree(run, ignore_errors=True)
        return 0
    print(f"no step trained: see the logs under {run}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
