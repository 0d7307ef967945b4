"""Every command, given what a user can get wrong, says so in one line: no traceback, the
documented exit code (2 usage or a missing file, 3 unreachable, 1 refused or failed).

Real processes of the console script; the unreachable driver and etcd are closed loopback
ports. Run four at a time (each pays Python's start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NOWHERE = "127.0.0.1:1"  # nothing listens on port 1
CLIENTS = [
    ["status"],
    ["nodes"],
    ["events"],
    ["evict", "n0"],
    ["diagnose"],
    ["checkpoints"],
    ["selfcheck"],
    ["inject", "crash", "--node", "n0"],
]


def cases(tmp: Path) -> list[tuple[list[str], int, str]]:
    """(argv, exit code, a phrase the one line must contain)."""
    unknown = tmp / "unknown.toml"
    unknown.write_text('listen = "127.0.0.1:0"\nlisten-port = 5\n')
    bad_value = tmp / "bad.toml"
    bad_value.write_text('miss-limit = "many"\n')
    out: list[tuple[list[str], int, str]] = []
    for c in CLIENTS:
        out += [
            ([*c, "--driver", NOWHERE, "--timeout", "2"], 3, "cannot reach the driver"),
            ([*c, "--token-file", str(tmp / "missing")], 2, "does not exist"),
            ([*c, "--tls-cert", "/nx", "--tls-key", "/nx", "--tls-ca", "/nx"], 2, "no such file"),
            ([*c, "--driver", "not-an-address"], 2, "HOST:PORT"),
        ]
    mem = ["--event-log", "memory", "--listen", "127.0.0.1:0"]
    tls = ["--tls-cert", "/nx", "--tls-key", "/nx", "--tls-ca", "/nx"]
    out += [
        (
            [
                "driver",
                "--etcd",
                "http://127.0.0.1:1",
                "--listen",
                "127.0.0.1:0",
                "--archive-url",
                "none",
            ],
            3,
            "unreachable",
        ),
        # outside `unbroken up` the archive every driver shares must be named
        (["driver", "--etcd", "http://127.0.0.1:1", "--listen", "127.0.0.1:0"], 2, "--archive-url"),
        (["driver", *mem, "--miss-limit", "-1"], 2, "miss_limit"),
        (["driver", *mem, "--token-file", "node=/nx"], 2, "does not exist"),
        (["driver", *mem, "--token-file", "/nx"], 2, "ROLE=PATH"),
        (
            ["driver", *mem, "--tls-cert", "/nx", "--tls-key", "/nx", "--tls-ca", "/nx"],
            2,
            "no such",
        ),
        (["driver", *mem, "--config", str(unknown)], 2, "unknown key 'listen-port'"),
        (["driver", *mem, "--config", str(bad_value)], 2, "miss-limit"),
        (["driver", *mem, "--config", str(tmp / "nx.toml")], 2, "does not exist"),
        (["driver", "--listen", "0.0.0.0:0", "--event-log", "memory"], 2, "--insecure"),
        (["agent", "--driver", NOWHERE, "--max-disconnected-s", "1", "--no-flash"], 3, "no driver"),
        (["agent", "--driver", NOWHERE, "--heartbeat-interval-ms", "0"], 2, "heartbeat"),
        (["agent", "--driver", NOWHERE, "--token-file", "/nx"], 2, "does not exist"),
        (["agent", "--driver", NOWHERE, *tls], 2, "no such file"),
        (["agent", "--driver", NOWHERE, "--config", str(unknown)], 2, "unknown key"),
        (["etcd", "--data-dir", "/proc/no/such/dir"], 2, "check the path"),
        (["plan", "--params", "abc", "--gpus", "8"], 2, "not a number"),
        (["certs", "issue", "--dir", str(tmp / "no-ca"), "node:a"], 2, "no CA"),
        (["certs", "issue", "--dir", str(tmp), "root"], 2, "ROLE:NAME"),
    ]
    return out


def test_bad_input_gets_one_line_and_the_documented_exit_code(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")},
        "OMP_NUM_THREADS": "1",
    }

    def one(case: tuple[list[str], int, str]) -> str:
        argv, code, phrase = case
        r = subprocess.run(
            [sys.executable, "-m", "unbroken.cli", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        problems = []
        if r.returncode != code:
            problems.append(f"exit {r.returncode}, want {code}")
        if "Traceback" in r.stderr or "Traceback" in r.stdout:
            problems.append("a traceback")
        if phrase not in r.stderr:
            problems.append(f"no {phrase!r} on stderr")
        return f"unbroken {' '.join(argv)}: {', '.join(problems)}\n{r.stderr[-600:]}" * bool(
            problems
        )

    with ThreadPoolExecutor(4) as pool:
        failures = [f for f in pool.map(one, cases(tmp_path)) if f]
    assert failures == [], "\n".join(failures)


def test_print_config_is_a_config_file_that_reproduces_itself(tmp_path: Path) -> None:
    conf = tmp_path / "driver.toml"
    conf.write_text('listen = "127.0.0.1:0"\nmiss-limit = 7\ntoken-file = ["viewer=/v"]\n')
    cmd = [sys.executable, "-m", "unbroken.cli", "driver"]
    first = subprocess.run(
        [*cmd, "--config", str(conf), "--miss-limit", "9", "--print-config"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert 'listen = "127.0.0.1:0"' in first.stdout
    assert "miss-limit = 9" in first.stdout  # the flag overrides the file
    assert 'token-file = ["viewer=/v"]' in first.stdout
    again = tmp_path / "again.toml"
    again.write_text(first.stdout)
    second = subprocess.run(
        [*cmd, "--config", str(again), "--print-config"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert second.stdout == first.stdout


def test_driver_reports_every_missing_setting_at_once(tmp_path: Path) -> None:
    """A new user's first driver line (embedded etcd, all interfaces, no credentials) gets one
    error listing all three problems, each with what to do, not one per run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    r = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "driver", "--listen", "0.0.0.0:0", "--job-id", "j"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "3 settings to fix" in r.stderr
    for phrase in ("--etcd-data-dir DIR", "--archive-url", "--insecure"):
        assert phrase in r.stderr, (phrase, r.stderr)
