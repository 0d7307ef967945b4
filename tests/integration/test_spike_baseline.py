"""A new process in an old world judges a loss spike as its peers do (trainer/spikewait.py).

In a `make run` drill a rank replaced 9 steps before a loss spike had too little history
to judge it: it went on into the next step while its peers waited at the spiked one for the
driver's verdict, and the rollback, finding the world not held at one boundary, waited out
its agreement and left the world (3.2 s). Here a real 2-rank gloo world: rank 0 has trained
40 steps, rank 1 is new; after `agree` both judge the same losses alike, the spike included.
"""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.trainer.launch import spawn

pytestmark = pytest.mark.integration


def _judge(survivor_steps: int) -> list[Any]:
    import torch.distributed as dist

    from unbroken.trainer import spikewait

    s = spikewait.SpikeWait(lambda _: False, wait_s=0.0)
    if dist.get_rank() == 0:  # the survivor: its curve so far
        for step in range(1, survivor_steps + 1):
            s.detector.observe(step, 3.0 - step * 0.01)
        s.last_step = survivor_steps
    s.agree()
    step0 = survivor_steps
    verdicts = []
    for i, loss in enumerate([2.6, 2.59, 12.2, 2.58], start=1):
        spike = s.detector.observe(step0 + i, loss)
        verdicts.append(None if spike is None else (spike.step, spike.loss))
    return [len(s.detector.history()), s.last_step, verdicts]


def test_a_new_rank_takes_its_peers_baseline_and_judges_the_spike_with_them() -> None:
    (h0, last0, v0), (h1, last1, v1) = spawn(_judge, 2, 40)
    assert (h1, last1) == (h0, last0), ((h0, last0), (h1, last1))
    assert v1 == v0, (v0, v1)
    assert any(v is not None for v in v0), v0  # the spike was judged at all
