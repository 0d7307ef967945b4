"""`unbroken train`: run the trainer locally, on one process or N via torchrun.

With `--nproc-per-node 1` (the default) the trainer runs in this process; with more it
starts `torch.distributed.run --standalone` (torchrun picks a free port), which runs
`python -m unbroken.trainer.run` on each rank. No torch import at module level: the
`unbroken` command builds its help without loading torch.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from unbroken.trainer.flags import add_arguments, to_argv


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `unbroken train` flags."""
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="local processes (torchrun when > 1)"
    )
    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Train; returns the exit code (0 ok, 1 failed, 2 bad flags)."""
    worker_argv = to_argv(args)
    if args.nproc_per_node < 1:
        print("error: --nproc-per-node must be >= 1", file=sys.stderr)
        return 2
    if args.nproc_per_node == 1:
        from unbroken.trainer.run import main

        return main(worker_argv)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # torchrun picks a free port itself
        f"--nproc-per-node={args.nproc_per_node}",
        "-m",
        "unbroken.trainer.run",
        *worker_argv,
    ]
    return 1 if subprocess.call(cmd) else 0
