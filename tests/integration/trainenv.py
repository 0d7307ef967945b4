"""Environment of a worker run by hand (no agent, no flash): what torchrun would set."""

from __future__ import annotations

import os


def plain_worker_env(rank: int, world: int, master_port: int) -> dict[str, str]:
    """torchrun's variables for `rank` on loopback, without the agent's and flash's."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }
    for k in ("UNBROKEN_AGENT_SOCKET", "UNBROKEN_FLASH_ROOT"):
        env.pop(k, None)
    return env
