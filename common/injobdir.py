"""The files a torchrun agent's `unbroken` handler and its workers share for in-job rounds.

The handler (agent/rdzvinjob.py) makes a private directory and names it to its workers in
`DIR_ENV`; it writes each new world's environment there (`world_file`) and each held worker
answers with a marker (`held_file`) naming its pid and LOCAL_WORLD_SIZE
(trainer/torchrunhold.py). `GEN_ENV` names the generation a worker's world belongs to;
`WAIT_ENV` how long a held worker waits for its next world.
"""

from __future__ import annotations

import os

DIR_ENV = "UNBROKEN_TORCHRUN_INJOB_DIR"
GEN_ENV = "UNBROKEN_TORCHRUN_INJOB_GEN"
WAIT_ENV = "UNBROKEN_TORCHRUN_INJOB_WAIT_S"


def world_file(directory: str, gen: int) -> str:
    return os.path.join(directory, f"world-{gen}.json")


def held_file(directory: str, gen: int, local_rank: int) -> str:
    return os.path.join(directory, f"held-{gen}-{local_rank}")
