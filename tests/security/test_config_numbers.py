"""Numbers in a config file are checked, with an error naming the key.

A `--config` TOML file's `miss-limit = 2.7` was read as 2 without a word, `true` as 1, and
`grace-s = nan` or `command-timeout-s = inf` were taken as durations (a deadline that never
comes). The real `unbroken driver` is started with each file and must refuse it at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BAD = [
    ("miss-limit = 2.7", "miss-limit must be a whole number"),
    ("miss-limit = true", "miss-limit must be a number"),
    ('miss-limit = "many"', "miss-limit must be a number"),
    ("grace-s = nan", "grace-s must be a finite number"),
    ("command-timeout-s = inf", "command-timeout-s must be a finite number"),
]


@pytest.mark.parametrize(("line", "said"), BAD)
def test_a_bad_number_in_a_config_file_is_refused_by_name(
    line: str, said: str, tmp_path: Path
) -> None:
    conf = tmp_path / "driver.toml"
    conf.write_text(line + "\n")
    run = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "driver", "--config", str(conf),
         "--event-log", "memory", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"{conf}: {said}" in run.stderr, run.stderr[-2000:]


def test_a_non_finite_number_on_the_command_line_is_refused() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "driver", "--grace-s", "nan",
         "--event-log", "memory", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--grace-s" in run.stderr and "nan" in run.stderr, run.stderr[-2000:]
