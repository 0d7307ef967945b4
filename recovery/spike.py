"""Loss spikes: detect them over a robust moving baseline, decide rollback and skip. Pure.

A spike is a loss above the median of the last `window` accepted losses by more than
`factor` robust standard deviations (1.4826 x MAD, floored at `min_rel_spread` of the
median so a flat loss curve does not turn noise into spikes) in `confirm` observations in a
row, or at once when it is `instant_ratio` times the median (or the newest `recent` losses'
median, when lower: a steep descent still in the window) or more, or NaN/inf. A single
moderate outlier followed by a normal loss is a noisy batch, not a spike: the tiny model's
small batches give +80 % ones every thousand steps or so, which rolled it back (and, three
in 1,000 steps, halted it); the spikes PaLM and OPT rolled back from lasted many steps.
Spiking losses never enter the baseline. The policy then picks the newest checkpoint taken
*before* the spiking step (the state after that step already contains the bad update)
and the batches to skip around it (PaLM skipped 200-500), and refuses to loop forever:
after `max_rollbacks` rollbacks within `rollback_window_steps` it asks for a halt.

The detector and policy return decisions; the driver turns them into `LossSpike` and
`Rollback` events (proto/events.proto) and the trainer skips the batches.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from statistics import median

from unbroken.proto import events_pb2 as ev

MAD_TO_SIGMA = 1.4826


#: The detector's tuning has no flags (set in code); the rollback limit has (`--spike-*`).
_TUNING = {"flag": None, "why": "loss-spike detector tuning, set in code (recovery/spike.py)"}


@dataclass(kw_only=True, slots=True)
class SpikeConfig:
    """Detector and policy settings."""

    # accepted losses in the baseline
    window: int = field(default=100, metadata=_TUNING)
    # no spike is called before this many accepted losses
    min_history: int = field(default=10, metadata=_TUNING)
    factor: float = field(default=6.0, metadata=_TUNING)  # robust sigmas above the median
    # spread floor, as a fraction of |median|: with the default factor a spike is at least 30 %
    # above the median. At 1 % (6 % above) a converged tiny model's natural bumps were called
    # spikes after 1,500 steps; real spikes (OPT, BLOOM) are jumps of tens of percent or more.
    min_rel_spread: float = field(default=0.05, metadata=_TUNING)
    # observations in a row above the threshold before a spike is called...
    confirm: int = field(default=2, metadata=_TUNING)
    # ...unless the loss is this many times the median or more: the tiny model's noisy batches
    # reached 2.0x, a poisoned batch 2.8x early in training (steps 1-33 in the window) and 7x
    # to 13x later
    instant_ratio: float = field(default=2.5, metadata=_TUNING)
    # ...of the median or of the median of the newest `recent` accepted losses, the lower:
    # early in training the window holds the steep descent (losses 10 to 4 in 11 steps),
    # whose median and spread hid a jump from 3.2 to 8.7 (the drill, a spike 21 steps after
    # a restart of every worker: never detected)
    recent: int = field(default=10, metadata=_TUNING)
    skip_before: int = field(default=0, metadata=_TUNING)  # batches before the spiking one to skip
    # batches from the spiking one on to skip
    skip_after: int = field(default=200, metadata=_TUNING)
    # the rollback target is at least this many steps before
    min_checkpoint_gap: int = field(default=0, metadata=_TUNING)
    max_rollbacks: int = field(
        default=3,
        metadata={
            "help": "rollbacks within --spike-rollback-window-steps after which a spike halts "
            "the job (restart from a checkpoint) instead of rolling back again"
        },
    )
    rollback_window_steps: int = field(
        default=1000,
        metadata={"help": "the window (steps) in which --spike-max-rollbacks are counted"},
    )

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError(f"SpikeConfig.window must be >= 3, got {self.window}")
        if not 1 <= self.min_history <= self.window:
            raise ValueError(
                f"SpikeConfig.min_history must be in [1, window={self.window}], got "
                f"{self.min_history}"
            )
        if not self.factor > 0:
            raise ValueError(f"SpikeConfig.factor must be > 0, got {self.factor}")
        if self.min_rel_spread < 0:
            raise ValueError(f"SpikeConfig.min_rel_spread must be >= 0, got {self.min_rel_spread}")
        for name in ("skip_before", "skip_after", "min_checkpoint_gap"):
            if getattr(self, name) < 0:
                raise ValueError(f"SpikeConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_rollbacks < 0:
            raise ValueError(
                "SpikeConfig.max_rollbacks (--spike-max-rollbacks) must be >= 0 (0: every spike "
                f"halts the job), got {self.max_rollbacks}"
            )
        if self.confirm < 1:
            raise ValueError(f"SpikeConfig.confirm must be >= 1, got {self.confirm}")
        if not self.instant_ratio > 1:
            raise ValueError(f"SpikeConfig.instant_ratio must be > 1, got {self.instant_ratio}")
        if not 1 <= self.recent <= self.window:
            raise ValueError(
                f"SpikeConfig.recent must be in [1, window={self.window}], got {self.recent}"
            )
        if self.rollback_window_steps < 1:
            raise ValueError(
                "SpikeConfig.rollback_window_steps (--spike-rollback-window-steps) must be >= 1, "
                f"got {self.rollback_window_steps}"
            )


@dataclass(frozen=True, slots=True)
class Spike:
    """A detected spike; maps onto the `LossSpike` event."""

    step: int
    loss: float
    baseline: float  # median of the window
    threshold: float
    factor: float
    non_finite: bool

    def to_event(self) -> ev.LossSpike:
        """The `LossSpike` payload the driver appends."""
        return ev.LossSpike(
            step=self.step,
            loss=self.loss,
            baseline=self.baseline,
            factor=self.factor,
            non_finite=self.non_finite,
        )


#: A restore further back than this many steps starts a new timeline for the loss baseline:
#: the losses before it belong to later training and would flag the earlier, higher losses
#: as spikes (the driver's `LossWatch` and the agent's loss window both start again).
RESTORE_RESET_STEPS = 16


@dataclass(frozen=True, slots=True)
class Prior:
    """A loss baseline measured elsewhere: the median and MAD of `n` recent losses."""

    median: float
    mad: float
    n: int


@dataclass(slots=True)
class SpikeDetector:
    """Feeds on (step, loss) and reports spikes."""

    config: SpikeConfig
    _window: deque[float] = field(default_factory=deque)
    _pending: list[tuple[int, float]] = field(default_factory=list)  # high, not yet confirmed

    def baseline(self, prior: Prior | None = None) -> tuple[float, float] | None:
        """(median, threshold) of the current window, or None before `min_history`; before
        it, a `prior` of at least `min_history` losses stands in."""
        if len(self._window) < self.config.min_history:
            if prior is None or prior.n < self.config.min_history:
                return None
            med, mad = prior.median, prior.mad
        else:
            xs = list(self._window)
            med = median(xs)
            mad = median(abs(x - med) for x in xs)
        spread = max(MAD_TO_SIGMA * mad, self.config.min_rel_spread * abs(med))
        return med, med + self.config.factor * spread

    def observe(self, step: int, loss: float, prior: Prior | None = None) -> Spike | None:
        """Judge one loss; accepted losses extend the baseline, spikes do not. `prior`: a
        baseline from elsewhere for while this detector has too little history of its own
        (a driver that has just taken the lead: the workers' own recent losses)."""
        base = self.baseline(prior)
        if not math.isfinite(loss):
            med = base[0] if base else math.nan
            thr = base[1] if base else math.nan
            return Spike(step, loss, med, thr, self.config.factor, True)
        instant = base is not None and self._instant(loss, base[0])
        if base is not None and (loss > base[1] or instant):
            med, thr = base
            c = self.config
            self._pending.append((step, loss))
            if len(self._pending) >= c.confirm or instant:
                first = self._pending[0]  # where it began: the rollback goes before it
                self._pending.clear()
                return Spike(first[0], first[1], med, thr, c.factor, False)
            return None
        self._pending.clear()  # a lone outlier (kept out of the baseline): noise
        self._window.append(loss)
        if len(self._window) > self.config.window:
            self._window.popleft()
        return None

    def _instant(self, loss: float, med: float) -> bool:
        """Whether `loss` is `instant_ratio` times the level or more: the window's median,
        or the newest `recent` accepted losses' when lower (a descent in the window)."""
        level, n = med, self.config.recent
        if len(self._window) >= n:
            level = min(level, median(islice(self._window, len(self._window) - n, None)))
        return level > 0 and loss >= self.config.instant_ratio * level

    def history(self) -> list[float]:
        """The accepted losses of the baseline, oldest first."""
        return list(self._window)

    def adopt(self, losses: list[float]) -> None:
        """Take `losses` (another detector's `history`) as this baseline."""
        self._window = deque(losses[-self.config.window :])
        self._pending.clear()

    def reset(self) -> None:
        """Forget the baseline (e.g. after a change of learning-rate schedule)."""
        self._window.clear()
        self._pending.clear()


@dataclass(frozen=True, slots=True)
class RollbackDecision:
    """Maps onto the `Rollback` event; `halt` means stop and call a human."""

    from_step: int
    to_step: int
    skip_first: int  # first batch index to skip (batch i is consumed by step i)
    skip_last: int  # last batch index to skip, inclusive
    reason: str
    halt: bool = False

    @property
    def skip_batches(self) -> int:
        """How many batches are skipped."""
        return max(0, self.skip_last - self.skip_first + 1)

    def skips(self, batch: int) -> bool:
        """Whether the data loader must skip batch index `batch`."""
        return self.skip_first <= batch <= self.skip_last

    def to_event(self) -> ev.Rollback:
        """The `Rollback` payload the driver appends (not for a halt)."""
        assert not self.halt, "a halt is not a rollback"
        return ev.Rollback(
            from_step=self.from_step,
            to_step=self.to_step,
            skip_batches=self.skip_batches,
            reason=self.reason,
            skip_from_step=self.skip_first if self.skip_batches else 0,
        )


@dataclass(slots=True)
class RollbackPolicy:
    """Decides where to roll back to after a spike, and which batches to skip."""

    config: SpikeConfig
    _history: list[int] = field(default_factory=list)  # spike steps that caused rollbacks

    def decide(self, spike: Spike, checkpoints: Sequence[int]) -> RollbackDecision:
        """The rollback for `spike`, given the committed/available checkpoint steps.

        Step `s`'s checkpoint holds the state after batch `s` was applied; batch
        `spike.step` produced the spike, so the newest usable checkpoint is the newest
        step `<= spike.step - 1 - min_checkpoint_gap`.
        """
        cfg = self.config
        reason = (
            f"non-finite loss {spike.loss} at step {spike.step}"
            if spike.non_finite
            else f"loss {spike.loss:.6g} > {spike.threshold:.6g} (median {spike.baseline:.6g}, "
            f"{cfg.factor} robust sigmas) at step {spike.step}"
        )
        limit = spike.step - 1 - cfg.min_checkpoint_gap
        usable = [c for c in checkpoints if c <= limit]
        recent = [s for s in self._history if spike.step - s < cfg.rollback_window_steps]
        if not usable:
            return RollbackDecision(
                spike.step, spike.step, 0, -1, reason + "; no checkpoint before it", halt=True
            )
        if len(recent) >= cfg.max_rollbacks:
            return RollbackDecision(
                spike.step,
                spike.step,
                0,
                -1,
                reason + f"; {len(recent)} rollbacks within {cfg.rollback_window_steps} steps",
                halt=True,
            )
        target = max(usable)
        self._history.append(spike.step)
        first = max(target + 1, spike.step - cfg.skip_before)
        last = spike.step + cfg.skip_after - 1 if cfg.skip_after else spike.step - 1
        if cfg.skip_before == 0 and cfg.skip_after == 0:
            first, last = 0, -1
        return RollbackDecision(spike.step, target, first, last, reason)
