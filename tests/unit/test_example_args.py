"""The adapter examples' shared flags: defaults as before, and a wrong value refused by name."""

from __future__ import annotations

import pytest

from unbroken.trainer.examples.args import BATCH_SIZE, WIDTH, example_parser

pytestmark = pytest.mark.unit


def test_the_defaults_are_the_tiny_model_and_batch() -> None:
    args = example_parser("x").parse_args([])
    assert (args.width, args.batch_size) == (WIDTH, BATCH_SIZE) == (32, 4)
    args = example_parser("x").parse_args(["--width", "256", "--batch-size", "32"])
    assert (args.width, args.batch_size) == (256, 32)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--width", "33"], "--width: must be even"),
        (["--width", "0"], "--width: must be a positive whole number"),
        (["--width", "wide"], "--width: must be a whole number, got 'wide'"),
        (["--batch-size", "-4"], "--batch-size: must be a positive whole number"),
    ],
)
def test_a_wrong_value_is_refused_saying_what_is_wrong(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        example_parser("x").parse_args(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
