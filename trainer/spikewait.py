"""A rank whose own loss spikes waits for the driver's verdict before its next step.

The driver calls a spike from the losses in the agents' heartbeats: on a 2-core host
0.1-0.2 s after the step, by when the tiny model had trained 3-5 steps more on the spiked
state, each of them lost to the rollback (bench-recovery, loss spikes in-job: 4-6 steps).
Every rank of the embedded engine sees the same all-reduced loss, so each can judge it the
way the driver will (`recovery.spike.SpikeDetector`, the same settings) and, when it
spikes, wait before the next step: the driver's hold then finds the job at the spiked step
itself, one step past the step the rollback restores.

The baseline outlives a world: an in-job recovery's rejoin starts the step loop again in
the same process, with the losses before it still the curve (`shared`; a restore more than
`RESTORE_RESET_STEPS` back starts a new baseline, as the driver's does). A new process
takes its peers' baseline as its world starts (`agree`).

The wait is bounded (`WAIT_S`, under the agent's 1 s hang floor): when no hold comes (the
driver judged otherwise, or this rank's baseline was not the driver's) training goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from unbroken.recovery.spike import RESTORE_RESET_STEPS, SpikeConfig, SpikeDetector
from unbroken.trainer.ncclguard import at_boundary

log = structlog.get_logger(__name__)

#: How long a rank waits for the driver's verdict on its spiked loss (the driver's hold came
#: 0.1-0.25 s after the step on a loaded 2-core host).
WAIT_S = 0.5
POLL_S = 0.005


class SpikeWait:
    """Judge each step's loss; after a spike wait up to `wait_s` for `held` to say yes.

    Args:
        held: waits up to the seconds it is given for the agent's commands and reads them;
            True once the agent holds this rank (a rollback).
        flush: sends the step report the hooks channel holds back (short steps ride along
            in the next report): the spiked loss must reach the agent before the wait.
        wait_s: the longest wait per spike.
        config: the detector's settings (the driver's defaults).
    """

    def __init__(
        self,
        held: Callable[[float], bool],
        flush: Callable[[], object] | None = None,
        *,
        wait_s: float = WAIT_S,
        config: SpikeConfig | None = None,
    ) -> None:
        self.detector = SpikeDetector(config or SpikeConfig())
        self.last_step = 0
        self.held = held
        self.flush = flush
        self.wait_s = wait_s
        self.waits = 0  # spikes this rank waited after
        self.holds = 0  # ...of which the driver's hold ended the wait

    def after(self, step: int, loss: float | None) -> bool:
        """After step `step` (its loss): True when the agent holds this rank (the caller
        leaves the step loop as for any hold); False to go on."""
        if loss is None:
            return False
        if step + RESTORE_RESET_STEPS < self.last_step:
            self.detector.reset()  # restored far back: a new timeline's curve
        self.last_step = step
        spike = self.detector.observe(step, float(loss))
        if spike is None:
            return False
        self.waits += 1
        t0 = time.monotonic()
        log.warning(
            "loss spiked; waiting for the driver's verdict",
            step=step,
            loss=spike.loss,
            baseline=round(spike.baseline, 4),
            wait_s=self.wait_s,
        )
        if self.flush is not None:
            self.flush()
        with at_boundary():  # no collective in flight: a hold is this thread's to read
            while not self.held(min(POLL_S, max(0.0, t0 + self.wait_s - time.monotonic()))):
                if time.monotonic() - t0 >= self.wait_s:
                    log.info("no hold came; training on", step=step)
                    return False
        self.holds += 1
        log.info("held after the spike", step=step, waited_s=round(time.monotonic() - t0, 3))
        return True

    def agree(self) -> None:
        """Take the longest baseline of the world's ranks (a collective: every rank calls it
        as the world starts). A replaced rank's process is new and its baseline empty; it
        did not judge the next spike (too little history), went on into the next step's
        collectives while its peers waited at the spiked one, and the rollback, finding the
        world not held at one boundary, waited out its agreement and left it (`make run`,
        2026-12-04: the loss spike resumed in 3.2 s). Every rank sees the same all-reduced
        losses, so a survivor's baseline is the newcomer's too."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.last_step, self.detector.history()))
        last_step, losses = max(everyone, key=lambda e: len(e[1]))
        if len(losses) > len(self.detector.history()):
            self.detector.adopt(losses)
            self.last_step = last_step
            log.info("spike baseline taken from a peer", losses=len(losses), step=last_step)


_shared: SpikeWait | None = None


def shared(held: Callable[[float], bool], flush: Callable[[], object] | None) -> SpikeWait:
    """This process's `SpikeWait`, its baseline kept across the worlds it trains in, reading
    the commands of the world it is in now (`held`, `flush`)."""
    global _shared
    if _shared is None:
        _shared = SpikeWait(held, flush)
    _shared.held, _shared.flush = held, flush
    return _shared
