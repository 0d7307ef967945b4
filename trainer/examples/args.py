"""The flags every adapter example takes: the same five, so tests and the bench drive them alike."""

from __future__ import annotations

import argparse

from unbroken.trainer.pacer import SAVE_BUDGET


def example_parser(description: str) -> argparse.ArgumentParser:
    """A parser with `--steps`, `--persist-every-s`, `--save-budget`, `--step-delay-s` and
    `--metrics-out`."""
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
    return parser
