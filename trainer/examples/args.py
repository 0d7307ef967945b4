"""The flags every adapter example takes, the same seven: tests and the bench drive them alike."""

from __future__ import annotations

import argparse

from unbroken.trainer.pacer import SAVE_BUDGET

#: Sequences per rank per step, unless `--batch-size` says otherwise.
BATCH_SIZE = 4
#: The model's width (GPT-2's n_embd, Llama's dim), unless `--width` says otherwise.
WIDTH = 32


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text}")
    return value


def _width(text: str) -> int:
    value = _positive(text)
    if value % 2:
        raise argparse.ArgumentTypeError(
            f"must be even (the models have 2 attention heads), got {text}"
        )
    return value


def example_parser(description: str) -> argparse.ArgumentParser:
    """A parser with `--steps`, `--persist-every-s`, `--save-budget`, `--step-delay-s`,
    `--metrics-out`, `--batch-size` and `--width`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--persist-every-s", type=float, default=30.0)
    parser.add_argument(
        "--save-budget",
        type=float,
        default=SAVE_BUDGET,
        help="the share of the step time flash saves may take (0.5: a save every step)",
    )
    parser.add_argument(
        "--step-delay-s",
        type=float,
        default=0.0,
        help="sleep this long in every step (to watch a run)",
    )
    parser.add_argument("--metrics-out", default="", help="rank 0's step losses (JSON lines)")
    parser.add_argument(
        "--batch-size",
        type=_positive,
        default=BATCH_SIZE,
        help="sequences per rank per step (the same model and state: longer steps, the same "
        "save; bench/adapters.py --batch-sizes)",
    )
    parser.add_argument(
        "--width",
        type=_width,
        default=WIDTH,
        help="the model's width, two layers either way (a larger state to save and a longer "
        "step; bench/adapters.py --widths); even",
    )
    return parser
