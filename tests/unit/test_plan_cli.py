"""`unbroken plan` end to end through the real dispatcher: readable tables, `--json`, and
exit code 2 with a useful message on bad input (the installed script's exit codes:
tests/integration/test_plan_script.py)."""

from __future__ import annotations

import json

import pytest

from unbroken.cli import main as cli
from unbroken.trainer import plan_cli

pytestmark = pytest.mark.unit

OPT = ["--params", "175B", "--tokens", "300B", "--gpus", "1024", "--gpu", "a100-80gb"]


def test_json_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        *OPT,
        "--mfu",
        "47.1%",
        "--recompute",
        "full",
        "--layout",
        "8x8",
        "--failure-rate",
        "0.2%",
        "--save-cost",
        "5m",
        "--restart-cost",
        "20m",
        "--json",
    ]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 175e9 and out["tokens"] == 300e9
    assert out["mfu"] == pytest.approx(0.471)
    assert out["compute_days"] == pytest.approx(33, rel=0.05)
    assert out["gpu"]["name"] == "a100-80gb"
    assert [m["zero_stage"] for m in out["memory"]] == [0, 1, 2, 3]
    assert {(m["tp"], m["pp"], m["dp"]) for m in out["memory"]} == {(8, 8, 16)}
    assert out["memory"][0]["activations_gb"] is None  # no shape given
    # 0.2 %/GPU-day on 1024 GPUs: ~2 failures a day, the OPT team's "~2 machines go down
    # every day" (metaseq projects/OPT/chronicles/final_update.md).
    assert out["failures_per_day"] == pytest.approx(2.05, rel=0.01)
    assert out["checkpoint_interval_min"] == pytest.approx(
        (2 * 300 * out["mtbf_hours"] * 3600) ** 0.5 / 60
    )
    assert out["wall_days"] > out["compute_days"]


def test_table_plan_with_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--layers",
        "96",
        "--hidden",
        "12288",
        "--heads",
        "96",
        "--seq-len",
        "2048",
        "--vocab",
        "50272",
        "--tokens",
        "300B",
        "--gpus",
        "1024",
        "--gpu",
        "A100-80GB",
        "--layout",
        "8x8",
        "--layout",
        "8x16",
        "--sequence-parallel",
        "--recompute",
        "selective",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for text in ("Training plan", "Memory per GPU", "8×8×16", "8×16×8", "goodput", "GPU-hours"):
        assert text in out
    assert "activations need the model shape" not in out


def test_list_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--list-gpus", "--json"]) == 0
    names = {g["name"] for g in json.loads(capsys.readouterr().out)}
    assert {"a100-40gb", "h100-sxm", "mi300x", "l40s", "v100-32gb", "h800"} <= names


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpu", "h100"], "known types: a100-40gb"),
        (["--gpu", "a100-80gb", "--layout", "3x1"], "not divisible"),
        (["--gpu", "a100-80gb", "--mfu", "140%"], "mfu: must be in (0, 1]"),
        (["--gpu", "a100-80gb", "--layers", "4"], "missing --hidden, --heads"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--params", "7B", "--tokens", "1T", "--gpus", "8", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("unbroken plan: error: ")
    assert message in err


@pytest.mark.parametrize(
    "bad",
    [
        ["--params", "-5"],
        ["--tokens", "many"],
        ["--gpus", "2.5"],
        ["--layout", "8by8"],
        ["--save-cost", "soon"],
        ["--failure-rate", "often"],
    ],
)
def test_unparseable_flags_exit_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *OPT, *bad])
    assert e.value.code == 2
    assert "unbroken plan: error: argument" in capsys.readouterr().err


def test_missing_required_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--params", "7B"]) == 2
    assert "missing --tokens, --gpus, --gpu" in capsys.readouterr().err


def test_parsers() -> None:
    assert plan_cli.parse_count("3.5T") == 3.5e12
    assert plan_cli.parse_count("175b") == 175e9
    assert plan_cli.parse_count("1,024") == 1024
    assert plan_cli.parse_fraction("0.1%") == pytest.approx(0.001)
    assert plan_cli.parse_seconds("2m") == 120
    assert plan_cli.parse_seconds("1h") == 3600
    assert plan_cli.parse_layout("4x12") == (4, 12)
