"""Hang detection from each rank's own rhythm and phase (pure; the agent's heartbeat calls it).

A rank is hung when it has made no progress for longer than its own threshold:

- in phase "train" (the default), max(`floor_ms`, `k` x the `quantile` of its recent step
  times): a 100 ms-step job is judged hung after about a second, a 20 s-step job after k
  slow steps, and neither needs a job-wide constant;
- waiting in a collective ("collective", reported as it enters one), `collective_k` times
  that: a rank that waits for a peer is a victim, and the peer that stopped (in its own
  compute) is named first; a collective that never completes is still a hang;
- in a phase the worker announced as long and irregular ("restore", "checkpoint", "eval",
  "startup"), and before its first step after a (re)start (there is no rhythm yet),
  `phase_limit_ms`: these are excluded from the rhythm rule by the worker's own report.

Time the rank spent runnable but not running (the kernel's run-queue delay of its main
thread, /proc/<pid>/schedstat) is added to its threshold: a rank starved of CPU by a
loaded machine is slow, not hung (the detector knows its node's health).

The agent knows the time since progress per rank without any cross-host clock, so the
decision is made on the node and only its verdict (a flag in the heartbeat) travels: the
driver looks only at flagged heartbeats, never sweeps every rank
(docs/architecture.md#the-live-view).
Stacks are dumped once per hang episode and capped (`cap_stacks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

#: phases judged by the step rhythm; every other phase name gets `phase_limit_ms`
RHYTHM_PHASES = frozenset({"", "train", "collective"})
MAX_STACKS_CHARS = 48 * 1024  # the stacks of a whole node in one HangSuspected


@dataclass(frozen=True, kw_only=True, slots=True)
class HangConfig:
    """Thresholds of the agent's hang detector."""

    floor_ms: float = field(
        default=1_000.0,
        metadata={"help": "a rank is hung after no progress for max(this, k x its p90 step time)"},
    )
    k: float = field(default=5.0, metadata={"help": "k of the rule above"})
    quantile: float = field(
        default=0.9, metadata={"help": "the step-time quantile of the rule above"}
    )
    phase_limit_ms: float = field(
        default=300_000.0,
        metadata={
            "help": "the limit in restore / checkpoint / eval / startup and before the first steps"
        },
    )
    min_steps: int = field(
        default=3, metadata={"help": "step times needed before the rhythm rule applies"}
    )
    collective_k: float = field(
        default=3.0, metadata={"help": "a rank waiting in a collective gets this many times longer"}
    )

    def __post_init__(self) -> None:
        if not self.floor_ms >= 10.0:
            raise ValueError(f"hang floor_ms must be >= 10, got {self.floor_ms}")
        if not self.k >= 1.0:
            raise ValueError(f"hang k must be >= 1, got {self.k}")
        if not 0.5 <= self.quantile <= 1.0:
            raise ValueError(f"hang quantile must be in [0.5, 1], got {self.quantile}")
        if not self.phase_limit_ms >= self.floor_ms:
            raise ValueError(
                f"hang phase_limit_ms ({self.phase_limit_ms}) must be >= floor_ms ({self.floor_ms})"
            )
        if self.min_steps < 1:
            raise ValueError(f"hang min_steps must be >= 1, got {self.min_steps}")


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank, upper), 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    i = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[i]


def threshold_ms(step_times_ms: Sequence[float], phase: str, config: HangConfig) -> float:
    """How long the rank may go without progress before it is hung.

    Args:
        step_times_ms: the rank's recent step times (its rhythm), oldest first.
        phase: its own phase report ("" or "train": judged by the rhythm).
        config: the thresholds.

    Returns:
        The threshold in ms.
    """
    if phase not in RHYTHM_PHASES or len(step_times_ms) < config.min_steps:
        return config.phase_limit_ms
    rhythm = max(config.floor_ms, config.k * quantile(step_times_ms, config.quantile))
    return rhythm * config.collective_k if phase == "collective" else rhythm


def is_hung(since_progress_ms: float, threshold: float, starved_ms: float = 0.0) -> bool:
    """True when the silence, less the time the rank waited for a CPU, passed the threshold."""
    return since_progress_ms - starved_ms > threshold


def run_delay_ms(pid: int) -> float:
    """The kernel's run-queue delay of `pid`'s main thread so far, in ms (0.0 if unknown)."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


#: A rank whose process has stayed stopped this long is hung: no rhythm to wait for, and it
#: must be named before its peers, which wait for it (they pass the floor later). The stop is
#: timed from when the agent's watch (`Supervisor.watch_stops`, every `STOP_POLL_S`) first saw
#: it, so a debugger's or py-spy's brief trace stop is not a hang. Judged at the heartbeat
#: slots from the last progress (250 ms, the rule before), a SIGSTOP was named 0.4 s after it.
STOPPED_AFTER_MS = 100.0
#: How often the watch reads the workers' process states (one /proc read per worker).
STOP_POLL_S = 0.02
#: Without the watch (a supervisor run on its own), a stopped rank is hung once it has been
#: silent this long: its stop cannot be timed, only seen at the slots.
STOPPED_SILENT_MS = 250.0


def process_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, a job-control stop, a debugger's trace stop).

    A hung rank whose process is stopped is the culprit, whatever phase it last reported:
    the driver restarts it without a diagnosis (driver/machine.py `hang_diagnose_after`).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return False
    # pid (comm) state ...: comm may hold spaces and parentheses; the state follows the last ")"
    state = raw[raw.rfind(b")") + 2 : raw.rfind(b")") + 3]
    return state in (b"T", b"t")


def cap_stacks(dumps: dict[int, str], limit: int = MAX_STACKS_CHARS) -> str:
    """One text of every rank's stacks, each rank given an equal share of `limit`.

    A rank's dump is cut from the top (the innermost frames, where faulthandler ends, are
    the ones that say where it is stuck), and the cut is marked.
    """
    if not dumps:
        return ""
    share = max(256, limit // len(dumps))
    parts = []
    for rank in sorted(dumps):
        text = dumps[rank].strip() or "(no stacks: the worker did not answer)"
        head = f"--- local rank {rank} ---\n"
        room = share - len(head)
        if len(text) > room:
            text = "...[cut]\n" + text[len(text) - room + 9 :]
        parts.append(head + text)
    return "\n".join(parts)[:limit]
