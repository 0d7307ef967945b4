"""Elasticity without spares: a lost node shrinks dp, its return grows dp back.

`unbroken driver --nodes 2 --dp 2 --min-nodes 1` starts the job on two agents and has no
spare. When n1's agent is SIGKILLed the loop cannot replace it, so it shrinks the world to
dp1 on n0: the worker restarts with UNBROKEN_DP=1 (the driver's layout wins over the
command's --dp 2) and reshards the dp2 flash copies (n0's own and its buddy replica of
n1's) into one rank. When n1's agent comes back, the loop grows the world back to dp2 and
both workers restore the dp1 state resharded onto two ranks.

The global batch stays 8 across the changes, so the losses stay on the uninterrupted dp2
run's curve up to the reduction order (resharding from memory is exact, the collective
sums are not bit-identical across world sizes).
"""

from __future__ import annotations

import pytest

from tests.jobs import Job, reference
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

TOLERANCE = 1e-3  # relative, on the loss: reduction order differs between dp1 and dp2


def _worlds(job: Job) -> list[tuple[int, tuple[str, ...]]]:
    return [
        (e.training_resumed.world.dp, tuple(e.training_resumed.world.node_ids))
        for e in job.events()
        if e.HasField("training_resumed")
    ]


def test_lost_node_shrinks_dp_and_its_return_grows_it_back(job: Job) -> None:
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= 3, 120, "training to start", job)

    # 1. n1 is lost and there is no spare: dp shrinks to 1 on n0.
    job.procs["n1"].kill()
    job.procs["n1"].wait(10)
    lost_step = job.max_step()
    until(
        lambda: (1, ("n0",)) in _worlds(job) and job.max_step() >= lost_step + 3,
        150,
        "training on dp1 past the loss",
        job,
    )
    shrunk_step = job.max_step()

    # 2. n1 returns: dp grows back to 2.
    job.start_agent("n1", buddy="n0")
    until(
        lambda: (
            (w := _worlds(job)[-1])[0] == 2
            and sorted(w[1]) == ["n0", "n1"]
            and job.max_step() >= shrunk_step + 3
        ),
        150,
        "training on dp2 again",
        job,
    )

    events = job.events()
    kinds = [e.WhichOneof("payload") for e in events]
    assert "spare_assigned" not in kinds, kinds
    resized = [e.world_resized for e in events if e.HasField("world_resized")]
    assert [(r.old_world.dp, r.new_world.dp) for r in resized][-2:] == [(2, 1), (1, 2)], resized
    worlds = _worlds(job)
    assert worlds[0][0] == 2 and sorted(worlds[0][1]) == ["n0", "n1"], worlds
    assert (1, ("n0",)) in worlds, worlds

    # Every step ran, and every loss stays on the uninterrupted dp2 run's curve.
    got = job.steps()
    last = max(got)
    assert sorted(got) == list(range(1, last + 1)), sorted(got)
    ref = reference(job.tmp / "reference", last)
    for step, values in got.items():
        for v in values:
            assert abs(v - ref[step]) <= TOLERANCE * abs(ref[step]), (step, v, ref[step])
