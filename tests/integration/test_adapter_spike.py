"""A loss spike injected through `unbroken inject` is rolled back and skipped, per adapter.

`unbroken driver --nodes 2` starts each adapter's example (a tiny GPT-2 from a config, gloo,
one rank per node) on two `unbroken agent --no-start` processes, on the session's real
etcd. Once the loss has settled, `unbroken inject loss-spike --node N --step S` (the CLI,
against the real driver) makes both agents write their workers' fault file; the adapter
reads it through the hooks SDK (`hooks.injected_fault`) before step S's forward and scales
the model's output layer for that one step, so the loss really spikes and the bad update
is applied. Nothing else is sent by the test:

- the driver's loss watch appends LossSpike at the step the fault hit;
- the machine appends Rollback to a step before it and restarts the world with the restore
  point and the batches to skip (UNBROKEN_RESTORE_STEP / UNBROKEN_SKIP_BATCHES);
- a rank whose loss spiked waits at that step for the driver (`hooks.spike_wait`);
- every restarted worker restores exactly that step (`hooks.restore(not_after=...)`), adds
  the skipped batches to its data position (the Transformers adapter says it cannot: the
  Trainer derives its data position from its global step), never applies the fault again,
  and trains on with losses back in the band of those before the spike.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from statistics import median

import pytest

from tests.integration.adapterrun import losses
from tests.jobs import Job
from unbroken.cli import main as cli
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

# Whether the adapter moves its data past the skipped batches: the Transformers Trainer
# derives its data position from its global step, so its adapter cannot (it says so).
SKIPS = {"accelerate": True, "lightning": True, "torchtitan": True, "transformers": False}
EXAMPLES = {  # adapter -> (example module, libraries it needs)
    "accelerate": ("unbroken.trainer.examples.accelerate_unbroken", ("accelerate",)),
    "lightning": ("unbroken.trainer.examples.lightning_unbroken", ("lightning",)),
    "torchtitan": ("unbroken.trainer.examples.torchtitan_unbroken", ("torchtitan",)),
    "transformers": ("unbroken.trainer.examples.transformers_unbroken", ("transformers",)),
}
STEPS = 100_000  # the examples' --steps: they never finish while the test watches
SETTLED = 30  # steps before the spike: the driver's baseline needs 10 sampled losses
LEAD = 20  # steps between the injection and the spiking step: both nodes must see it first
STEP_DELAY_S = 0.05  # each step sleeps this long (a tiny model's step is milliseconds)
RESTORED = re.compile(r"flash\.restored.*?step=(\d+)")
APPLIED = re.compile(r"fault applied.*?step=(\d+)")


class AdapterJob(Job):
    """The tests' job running an adapter example as the agents' worker command."""

    def __init__(self, tmp: Path, endpoint: str, module: str) -> None:
        super().__init__(tmp, endpoint)
        self.module = module

    def worker_cmd(self, dp: int = 2) -> str:
        return " ".join(
            [sys.executable, "-m", self.module, "--steps", str(STEPS), "--persist-every-s",
             "0.05", "--step-delay-s", str(STEP_DELAY_S), "--save-budget", "0.5"]
        )  # fmt: skip

    def new_step(self) -> int:
        """The newest step printed after a restore (the rollback's timeline)."""
        logs = [self.worker_log(n) for n in ("n0", "n1")]
        restored = [log for log in logs if "flash.restored" in log]
        new = "".join(log.rpartition("flash.restored")[2] for log in restored)
        return max((s for s, _ in losses(new)), default=0)

    def max_step(self, path: Path | None = None) -> int:
        """The newest step global rank 0 printed (on whichever node it runs)."""
        text = "".join(self.worker_log(n) for n in ("n0", "n1"))
        return max((s for s, _ in losses(text)), default=0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "adapter",
    [  # CI runs one (the adapters share the spike path, adapters/core.py); make test-all all
        "accelerate",
        *(
            pytest.param(a, marks=pytest.mark.slow)
            for a in ("lightning", "torchtitan", "transformers")
        ),
    ],
)
def test_injected_spike_rolls_back_and_skips(
    adapter: str, tmp_path: Path, etcd_server: object
) -> None:
    module, libs = EXAMPLES[adapter]
    for lib in libs:
        pytest.importorskip(lib)
    job = AdapterJob(tmp_path, etcd_server.endpoint, module)  # type: ignore[attr-defined]
    try:
        _spike_rolls_back_and_skips(job, SKIPS[adapter])
    finally:
        job.close()


def _spike_rolls_back_and_skips(job: AdapterJob, skips: bool) -> None:
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= SETTLED, 300, "the loss curve to settle", job)

    at = job.max_step() + LEAD
    for node in ("n0", "n1"):  # both ranks: the loss rank 0 reports spikes either way
        rc = cli.main(["inject", "loss-spike", "--node", node, "--step", str(at),
                       "--driver", job.address])  # fmt: skip
        assert rc == 0, f"unbroken inject on {node} failed"

    def resumed_after_rollback() -> bool:
        kinds = [e.WhichOneof("payload") for e in job.events()]
        return "rollback" in kinds and "training_resumed" in kinds[kinds.index("rollback") :]

    until(resumed_after_rollback, 240, "the rollback's resume", job)
    events = job.events()
    rollback = next(e.rollback for e in events if e.HasField("rollback"))
    past = max(rollback.to_step, rollback.skip_from_step) + 5
    until(lambda: job.new_step() >= past, 240, "training past the skip", job)

    events = job.events()
    spike = next(e.loss_spike for e in events if e.HasField("loss_spike"))
    i = next(i for i, e in enumerate(events) if e.HasField("rollback"))
    paused = next(e.training_paused for e in events[i:] if e.HasField("training_paused"))
    resumed = next(e.training_resumed for e in events[i:] if e.HasField("training_resumed"))
    applied = {}
    for node in ("n0", "n1"):
        log = job.worker_log(node)
        steps = [int(m) for m in APPLIED.findall(log)]
        assert len(steps) == 1 and steps[0] >= at, (node, steps, at, log[-3000:])
        applied[node] = steps[0]
    # a rank that saw its loss spike waited at that step for the rollback (hooks.spike_wait)
    waited = [n for n in ("n0", "n1") if "waiting for the driver's verdict" in job.worker_log(n)]
    assert waited, "no rank waited at its spiked step"
    # the spike is the step the fault hit (each node applies it at `at`, or at the first
    # step after its worker saw the file when training had passed `at`)
    assert spike.step in applied.values() and not spike.non_finite, (spike, applied)
    assert spike.loss > 2 * spike.baseline, spike
    assert rollback.from_step == spike.step and rollback.to_step < spike.step, rollback
    assert rollback.skip_batches > 0 and rollback.skip_from_step > rollback.to_step, rollback
    target = paused.restore_step
    assert 0 < target <= rollback.to_step and resumed.at_step == target, (paused, resumed)

    # Every worker restored exactly the target and moved its data past the skipped batches.
    for node in ("n0", "n1"):
        log = job.worker_log(node)
        restored = [int(m) for m in RESTORED.findall(log)]
        assert restored and restored[-1] == target, (node, restored, log[-3000:])
        said = "adapter.batches_skipped" if skips else "adapter.skip_not_applied"
        assert said in log, log[-3000:]

    # The new timeline starts at the target, and its losses are back in the band of those
    # before the spike (the spoiled weights were left behind with the dead timeline).
    before: dict[int, float] = {}
    after: dict[int, float] = {}
    for node in ("n0", "n1"):
        log = job.worker_log(node)
        old, _, new = log.rpartition("flash.restored")
        before.update((s, float(x)) for s, x in losses(old or log))
        after.update((s, float(x)) for s, x in losses(new) if old)
    assert spike.step in before, sorted(before)[-10:]
    assert min(after) == target + 1 and len(after) >= 5, sorted(after)
    base = median(x for s, x in before.items() if 5 < s < spike.step)
    assert before[spike.step] > 2 * base, (before[spike.step], base)
    assert all(math.isfinite(x) and 0.8 * base < x < 1.2 * base for x in after.values()), (
        base, after,
    )  # fmt: skip
