"""Worker entry point: `python -m unbroken.trainer.run --preset tiny --dp 2 --tp 2 --steps 50`.

Usable by torchrun and by the node agent alike: it reads RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT from the environment (a single process needs none of them),
joins the process group, loads the trainer plugin named by `--trainer` from the
`unbroken.trainers` entry points, optionally resumes from a DCP checkpoint, trains, reports
every step to the local agent when one is listening (trainer/hookchannel.py), and always
closes. What it uses of a trainer beyond the `Trainer` protocol (skipping batches, the drills'
hooks, the collective phase) is named by the optional protocols of trainer/plugin.py.
Under an agent that owns a flash store (trainer/flashckpt.py) it first restores the newest
step every rank can obtain (memory, buddy replica, storage) and resumes at the next step,
and flash-saves its full sharded state every `--flash-every` steps (default 1 there),
overlapped with the next step (its optimizer step waits for the copy, nothing else does).

After a loss-spike rollback the driver names the restore point (the agent passes it on):
`UNBROKEN_RESTORE_STEP` restores the newest step at or before it (the committed rollback
target; the copies after it, a dead timeline, are discarded) and `UNBROKEN_SKIP_BATCHES`
("<from_step>:<count>") skips `count` batches before step `from_step` runs.

Drills inject faults through the file named by `UNBROKEN_FAULT_FILE`, which the agent
writes atomically (common/faults.py `WorkerFault`: `{"kind": "nan" | "loss-spike", "step": N,
"id": "..."}`). It is checked
once per step with one `os.stat`; each id is applied once (also across restarts: applied ids
are remembered next to the file), at step N, or at the next step when N is 0 or past.
`loss-spike` poisons that step's batch targets (every target a NUL byte, which text never
holds), so the loss really spikes and the bad update is applied; `nan` makes the forward non-finite.
In-job recovery: under an agent, a worker whose step fails because a peer died (a gloo
collective's "Connection closed by peer", a timeout) or that the agent tells to hold leaves
the step, drops its process groups and keeps its process; it then waits for the agent's
Rejoin (the new world's environment), re-joins torch.distributed, rebuilds the trainer and
puts back the agreed step from its node's flash ring, and trains on with the same pid.
Without a Rejoin within `HOLD_WAIT_S` (or on a stop) it exits 1, as before.
Exit codes: 0 done, 1 training failed, 2 bad flags.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import structlog

from unbroken.common.faults import (
    LOSS_SPIKE,
    SDC,
    SDC_FAULTS,
    WorkerFault,
)
from unbroken.common.logsetup import setup_worker_logging
from unbroken.common.workerenv import WorkerEnv
from unbroken.trainer import (
    devicewarm,
    keeptrainer,
    keepworld,
    ncclguard,
    spikewait,
    stepthread,
    worldpin,
)
from unbroken.trainer.config import TrainConfig
from unbroken.trainer.faultfile import FaultFile, SlowFile
from unbroken.trainer.flags import add_arguments, to_config
from unbroken.trainer.plugin import (
    Batches,
    BatchSource,
    Collectives,
    Optimizers,
    Skips,
    Throttled,
)
from unbroken.trainer.rejoin import (
    Held,
    apply_rejoin,
    forget_dry_run_caches,
    hold,
    leave_world,
    open_sockets,
    peer_failure,
    started_by_agent,
)
from unbroken.trainer.rtrace import TRACE, mark

if TYPE_CHECKING:
    from unbroken.trainer.flashckpt import FlashCheckpointer
    from unbroken.trainer.hookchannel import Hooks
    from unbroken.trainer.persistclock import PersistClock

log = structlog.get_logger(__name__)

PG_TIMEOUT = timedelta(minutes=5)
# At most one step report per 50 ms (as the hooks SDK): shorter steps ride along in the
# next. Not one per 100 ms heartbeat: at ~60 ms steps that halved the straggler detector's
# samples, and a 1.05x straggler went unnamed for 120 s (bench-detectors).
STEP_REPORT_EVERY_S = 0.05


@dataclass(frozen=True, slots=True)
class RestorePoint:
    """Where to restore after a rollback, and which batches to skip (from the environment)."""

    step: int | None = None  # None: the newest step every rank can obtain
    skip_from_step: int = 0  # before running this step...
    skip_batches: int = 0  # ...skip this many batches

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RestorePoint:
        """Parse `UNBROKEN_RESTORE_STEP` and `UNBROKEN_SKIP_BATCHES` (common/workerenv.py).

        Raises:
            ValueError: a value is malformed (the message names the variable).
        """
        w = WorkerEnv.from_env(os.environ if env is None else env)
        skip_from, skip = w.skip_batches or (0, 0)
        return cls(step=w.restore_step, skip_from_step=skip_from, skip_batches=skip)


@contextlib.contextmanager
def applied_fault(trainer: object, fault: WorkerFault) -> Iterator[None]:
    """Make the next `train_step` suffer `fault` (the trainer's loader or its forward)."""
    import torch

    undo: Callable[[], None]
    if fault.kind == LOSS_SPIKE:
        if not (isinstance(trainer, Batches) and isinstance(trainer.loader, BatchSource)):
            log.warning("loss-spike fault needs a trainer with a `loader`; not applied")
            yield
            return
        loader = trainer.loader
        original = loader.next_batch

        def poisoned() -> tuple[Any, Any]:
            inputs, targets = original()
            return inputs, torch.zeros_like(targets)  # NUL bytes: the loss really spikes

        loader.next_batch = poisoned  # type: ignore[method-assign]
        undo = lambda: delattr(loader, "next_batch")  # noqa: E731
    else:

        def to_nan(module: Any, args: Any, output: Any) -> Any:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                return output * math.nan
            return None

        handle = torch.nn.modules.module.register_module_forward_hook(to_nan)
        undo = handle.remove
    try:
        yield
    finally:
        undo()


# How often a rank other than 0 tries the store's port before joining (`wait_for_store`).
STORE_POLL_S = 0.005


def wait_for_store(host: str, port: int, timeout_s: float) -> bool:
    """Wait until something accepts connections at `host:port` (the rank-0 worker's
    TCPStore); False when nothing did within `timeout_s`.

    A rank that joins before rank 0 listens has its connection refused, and torch's
    store client then sleeps a growing backoff before trying again: rank 1 started 20 ms
    before rank 0 joined in 0.26-0.74 s, against 0.013-0.035 s when it first waited
    here (4 tries each, this VM), and a worker restart in the recovery bench lost that
    in about half its restarts (which rank's standby wakes first is chance).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(STORE_POLL_S)


def init_distributed(config: TrainConfig) -> bool:
    """Join the process group torchrun/the agent described in the environment.

    Returns:
        True when this call created the group (the caller destroys it).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    # before the group: imported later, torch.distributed.nn.functional keeps the world as a
    # default argument, its gloo threads outlive destroy_process_group (trainer/worldpin.py)
    worldpin.import_early()
    use_cuda = config.uses_cuda()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        master, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if master and port.isdigit() and os.environ.get("RANK", "0") != "0":
            if not wait_for_store(master, int(port), PG_TIMEOUT.total_seconds()):
                raise TimeoutError(
                    f"rank 0's store at {master}:{port} accepted no connection in "
                    f"{PG_TIMEOUT.total_seconds():.0f} s: is rank 0's worker running, and is "
                    "MASTER_ADDR reachable from this node?"
                )
        if use_cuda and started_by_agent():  # the agent can hold this rank (in-job recovery)
            ncclguard.nccl_keeps_process()
        # No device_id (NCCL's eager init): tried on one H200, a survivor's abort of the old
        # communicators then took 3.5 s instead of 0.5, and the new world's init failed.
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=PG_TIMEOUT)
    return True


def train(
    config: TrainConfig,
    *,
    resume_from: str | None = None,
    save_to: str | None = None,
    metrics_out: str | None = None,
) -> list[dict[str, Any]]:
    """Train `config.steps` steps (counting a resumed step) inside an existing process group.

    The trainer plugin is `config.trainer`; rank 0 logs every `config.log_every` steps;
    `config.flash_every` (None: 1 under an agent with a flash store, else off; 0: off, and no
    flash restore) paces the flash saves.

    Returns:
        This rank's metrics, one dict per step run here.
    """
    import torch.distributed as dist

    from unbroken.trainer import checkpoint
    from unbroken.trainer.hookchannel import install

    hooks = install()
    # steps shorter than this ride along in the next report (their mean step time and
    # timings, their peak loss): a datagram per short step would wake the agent each time
    hooks.coalesce_s = STEP_REPORT_EVERY_S
    rank = dist.get_rank()
    history: list[dict[str, Any]] = []
    out = open(metrics_out, "a") if metrics_out and rank == 0 else None
    flash, clock, flash_every = _flash_store(config, rank)
    requests = SaveRequests(hooks)
    trainer = _trainer(config, flash)
    try:
        fingerprints = _fingerprinter(config, trainer)
        point, faults, slow = RestorePoint.from_env(), FaultFile.from_env(rank), SlowFile.from_env()
        hooks.phase("restore")  # judged by the phase limit, not the step rhythm
        step, source = _restore(trainer, flash, clock, point, resume_from)
        spikes = _spike_wait(hooks, requests)
        # the step restored (what the restart really lost) and where it came from
        hooks.phase("train", step=step, source=source)
        if isinstance(trainer, Collectives):  # a waiting rank is judged as a victim
            trainer.on_collective = hooks.collective_entered
        loop = _Loop(
            trainer=trainer,
            config=config,
            point=point,
            faults=faults,
            slow=slow,
            throttled=trainer if isinstance(trainer, Throttled) else None,
            flash=flash,
            clock=clock,
            flash_every=flash_every,
            requests=requests,
            history=history,
            hooks=hooks,
            out=out,
            rank=rank,
            fingerprints=fingerprints,
            spikes=spikes,
        )
        _run_kept(loop, step, config.steps, hooks, requests)
        if save_to:
            checkpoint.save(trainer, save_to)
    finally:
        # the last copy's write, the process group's teardown and the exit are no steps: a
        # phase of their own, so the agent's hang rule (the step rhythm) does not judge them
        hooks.phase("checkpoint")
        if flash is not None:
            flash.close()
            mark("flash_closed")
        if _MATMUL is not None:  # an injected compute fault ends with this run's training
            _MATMUL.set(0.0)
        # (in `finally`, exc_info is the exception on its way out, if any)
        # (a step left on its thread may still touch the trainer: trainer/stepthread.py)
        held = sys.exc_info()[0] is Held and not stepthread.stepping(trainer)
        if not keeptrainer.keep(trainer, held and flash is not None):
            trainer.close()
        if out is not None:
            out.close()
    return history


def _spike_wait(hooks: Hooks, requests: SaveRequests) -> spikewait.SpikeWait | None:
    """The spike wait of a rank an agent holds (its driver decides rollbacks; None for any
    other), its baseline agreed with the world's (a new process takes its peers')."""
    import torch.distributed as dist

    if not hooks.replies:
        return None
    spikes = spikewait.shared(requests.held, hooks.flush_steps)
    if dist.get_world_size() > 1:
        spikes.agree()
    return spikes


def _trainer(config: TrainConfig, flash: FlashCheckpointer | None) -> Any:
    """This world's trainer: the one kept from the last (trainer/keeptrainer.py; only under
    a flash store, whose restore brings every rank to one step), else a new one, set up."""
    from unbroken.trainer.plugin import load_trainer

    if flash is None:
        keeptrainer.drop()
    kept = keeptrainer.take(config) if flash is not None else None
    if kept is not None:
        return kept
    trainer = load_trainer(config.trainer)
    _setup(trainer, config, flash)
    return trainer


def _setup(trainer: Any, config: TrainConfig, flash: FlashCheckpointer | None) -> None:
    """Set the trainer up for `config`. With a flash store a restore is likely to overwrite
    the weights: the embedded engine then allocates them without computing their initial
    values (`defer_init`; `_restore` fills them when nothing was restored)."""
    if flash is not None and hasattr(trainer, "defer_init"):
        trainer.defer_init = True
    trainer.setup(config)
    mark("setup", cpu_s=round(time.process_time(), 4))


def _run_kept(loop: _Loop, step: int, steps: int, hooks: Hooks, requests: SaveRequests) -> None:
    """`_run_steps`, keeping the world through a rollback's hold where it can (`_keep`)."""
    while True:
        try:
            _run_steps(loop, step, steps, hooks, requests)
            return
        except Held as h:
            step = _keep(h, loop)  # the world kept (else `h` is raised again)


def _keep(h: Held, lp: _Loop) -> int:
    """Keep this world through the hold `h` and restore the Rejoin's step in place (see
    trainer/keepworld.py); the step restored. Raises `h` again, with the Rejoin or the stop
    it got, when the world is to be left."""
    out = keepworld.hold_in_place(h, lp.hooks) if lp.flash is not None else None
    if out is None:
        raise h
    if not out.kept:
        h.rejoin, h.stopped = out.rejoin, out.stopped
        raise h
    lp.requests.hold, lp.spiked, lp.turn_at = None, False, None
    lp.point = RestorePoint.from_env()
    lp.hooks.phase("restore")
    step, source = _restore(lp.trainer, lp.flash, lp.clock, lp.point, None)
    lp.hooks.phase("train", step=step, source=source)
    return step


def _fingerprinter(config: TrainConfig, trainer: Any) -> Any:
    """The state fingerprints of a trainer that exposes its optimizers, when asked for."""
    if config.fingerprint_every and isinstance(trainer, Optimizers):
        from unbroken.trainer.sdc import Fingerprinter

        return Fingerprinter(trainer)
    return None


def _flash_store(
    config: TrainConfig, rank: int
) -> tuple[FlashCheckpointer | None, PersistClock | None, int]:
    """The rank's flash checkpointer (None: off), its persistence clock, and the save pace.

    Raises:
        ValueError: flash saves asked for without an agent's flash store.
    """
    from unbroken.trainer.flashckpt import FlashCheckpointer, FlashEnv
    from unbroken.trainer.persistclock import PersistClock, persist_every_s_from_env

    env = FlashEnv.from_env()
    flash_every = config.flash_every
    if flash_every is None:
        flash_every = 1 if env is not None else 0
    if flash_every and env is None:
        raise ValueError("--flash-every needs an agent's flash store (run under `unbroken agent`)")
    flash = FlashCheckpointer(env, rank) if flash_every and env is not None else None
    clock = PersistClock(persist_every_s_from_env()) if flash is not None else None
    return flash, clock, flash_every


def _restore(
    trainer: Any,
    flash: FlashCheckpointer | None,
    clock: PersistClock | None,
    point: RestorePoint,
    resume_from: str | None,
) -> tuple[int, str]:
    """Restore the trainer's state: from flash (not past the restore point), else from
    `resume_from`, else none; the step it starts from and where its state came from."""
    from unbroken.trainer import checkpoint

    step = 0
    restored = flash.restore(trainer, not_after=point.step) if flash is not None else None
    keeptrainer.restored(trainer, restored is not None)  # a kept one, if nothing: afresh
    if restored is None and getattr(trainer, "uninitialized", False):
        trainer.init_weights()  # nothing restored: the initial weights after all
    mark("loaded", cpu_s=round(time.process_time(), 4))
    if restored is not None:
        step = restored.step
        if clock is not None:
            clock.persist_first = False  # the restored step is committed or in memory
        if flash is not None and point.step is not None:
            flash.discard_after(step)  # a rollback: newer copies are a dead timeline
    elif resume_from:
        checkpoint.load(trainer, resume_from)
        step = int(trainer.state_dict()["step"])
        if clock is not None:
            clock.persist_first = False
    if flash is not None:
        flash.guard(trainer)  # once: every optimizer step waits for the copy in flight
        if restored is not None:  # the state is whole (optimizer state included): size
            flash.prepare(trainer)  # and map the ring now, not inside the first save
            mark("prepared", cpu_s=round(time.process_time(), 4))
        if restored is not None and restored.resharded:
            # The restored step, in the new layout, into the ring at once: the old layout's
            # copies do not stay (each rank's ring is sized anew), and without it a rollback
            # soon after the reshard found no step before the spike in any ring and went
            # back to the last commit (bench-recovery, replica mode: a spike one step after
            # a shrink rolled back to step 1, 447 steps)
            flash.save(trainer, step, persist=False)  # committed steps stay whole
    mark("restored", step=step, how=restored.source if restored is not None else "none")
    if getattr(getattr(trainer, "device", None), "type", "") == "cuda":
        import torch.distributed as dist

        if dist.get_world_size() > 1:
            keepworld.all_restored()  # no rank spins on the device while a peer restores
    return step, restored.source if restored is not None else ""


def _run_steps(loop: _Loop, step: int, steps: int, hooks: Hooks, requests: SaveRequests) -> None:
    """Run the loop's steps until `steps`; `Held` when the agent holds this rank (it asked,
    or a peer failed under an agent that can recover in the job)."""
    first = True
    while step < steps:
        try:
            if first and os.environ.get(TRACE) and hasattr(loop.trainer, "trace_step"):
                loop.trainer.trace_step = True  # the embedded engine marks its phases
            step = loop.step(step)
            if first:
                mark("first_step", step=step)
                first = False
        except Held:
            raise
        except Exception as e:
            if hooks.replies and started_by_agent() and (peer_failure(e) or ncclguard.tripped()):
                raise Held(f"{type(e).__name__}: {e}", step) from e
            raise
        if requests.hold is not None:  # at a boundary when it came in a spike's wait
            raise Held(f"held by the agent: {requests.hold}", step, boundary=loop.spiked)


@dataclass(slots=True)
class _Loop:
    """What one step of `train` uses."""

    trainer: Any
    config: TrainConfig
    point: RestorePoint
    faults: FaultFile | None
    slow: SlowFile | None
    throttled: Any
    flash: Any
    clock: Any
    flash_every: int
    requests: SaveRequests
    history: list[dict[str, Any]]
    hooks: Hooks
    out: Any
    rank: int
    fingerprints: Any = None  # trainer/sdc.py Fingerprinter (None: off)
    spikes: spikewait.SpikeWait | None = None  # waits for the driver's verdict after a spiked loss
    spiked: bool = False  # the last step's loss spiked and the agent held this rank after it
    copy_flip: Any = None  # an sdc flip waiting for the next fingerprinted copy
    # when the last loop turn ended (its report; `turn_s`); None: the next turn is the
    # first of a run of steps (a start, a restore, a wait for a spike's verdict)
    turn_at: float | None = None

    def step(self, step: int) -> int:
        """Run one step, save and report it; return the step reached."""
        return _one_step(self, step)


def _one_step(lp: _Loop, step: int) -> int:
    """Run one step, save and report it; return the step reached."""
    trainer, config, point, faults, slow = lp.trainer, lp.config, lp.point, lp.faults, lp.slow
    throttled, flash, clock, flash_every = lp.throttled, lp.flash, lp.clock, lp.flash_every
    requests, history, hooks = lp.requests, lp.history, lp.hooks
    if point.skip_batches and step + 1 == point.skip_from_step:
        _skip(trainer, point.skip_batches, step + 1)
    if slow is not None and throttled is not None:
        throttled.slow_factor = slow.current()
    fault = faults.due(step + 1) if faults is not None else None
    sdc_fault = None
    if fault is not None and fault.kind in SDC_FAULTS:
        sdc_fault, fault = fault, None
        if not _mine(sdc_fault):
            sdc_fault = None
        elif sdc_fault.kind != SDC:  # a compute fault: this step's matmuls already
            _apply_sdc(trainer, sdc_fault, step + 1)
    if fault is not None:
        log.warning("fault applied", kind=fault.kind, step=step + 1, id=fault.id)
        with applied_fault(trainer, fault):
            m = stepthread.run(trainer.train_step, trainer)
    else:
        m = stepthread.run(trainer.train_step, trainer)
    if ncclguard.tripped():  # the step ran on an aborted (NCCL) or shut (gloo) world
        raise Held(f"world aborted by its guard: {ncclguard.tripped()}", step)
    stepped = time.perf_counter()
    step = int(m["step"])
    copy_flip = sdc_fault is not None and sdc_fault.kind == SDC and _in_copy(sdc_fault)
    if sdc_fault is not None and sdc_fault.kind == SDC and not copy_flip:
        _apply_sdc(trainer, sdc_fault, step)  # a flip of the state after the step
    persist = False
    if flash is not None and clock is not None:
        # every rank calls the clock at every step (it agrees collectively)
        timed, asked = clock.due(step), requests.due(step)
        persist = timed or asked or step == config.steps
    fp = lp.fingerprints
    if fp is not None and (step % config.fingerprint_every == 0 or persist):
        # before the save: a persisted step is always fingerprinted, so it can be verified
        t = time.perf_counter()
        hooks.fingerprint(step, fp.compute())
        m["fingerprint_s"] = time.perf_counter() - t
        fp_meta = fp.copy_meta(step, flash.entry_names) if flash is not None else None
    else:
        fp_meta = None
    if copy_flip:
        lp.copy_flip = sdc_fault  # into the next copy its buddy checks (fingerprinted)
    undo, flipped = None, lp.copy_flip
    if flipped is not None and fp_meta is not None:
        undo, lp.copy_flip = _apply_sdc(trainer, flipped, step), None
    if flash is not None and clock is not None:
        if config.flash_ab:  # a cost measurement: memory saves in alternate blocks
            m["flash_block"] = (step // config.flash_ab) % 2 == 0
        due = step % flash_every == 0 and m.get("flash_block", True)
        if persist or fp_meta is not None or due:  # a fingerprinted step's copy is checked
            t = time.perf_counter()
            flash.save(trainer, step, persist=persist, sdc=fp_meta)
            m["flash_save_s"] = time.perf_counter() - t
    if undo is not None and flash is not None:  # the flip stays in the copy alone
        flash.writer.wait_copied()
        _apply_sdc(trainer, flipped, step, at=undo)
    history.append(m)
    _report(lp, step, m, stepped)
    requests.poll()
    if lp.spikes is not None:  # a hold it waited for ends the loop
        waits = lp.spikes.waits
        lp.spiked = lp.spikes.after(step, m.get("loss"))
        if lp.spikes.waits != waits:  # it waited for a verdict: no training, not a turn
            lp.turn_at = None
    return step


def _report(lp: _Loop, step: int, m: dict[str, Any], stepped: float) -> None:
    """Tell the agent about the step, and write and log its metrics."""
    timings = {
        name: m[key] * 1000.0
        for name, key in (
            ("compute", "compute_s"),
            ("collective_wait", "collective_wait_s"),
            ("data_loading", "data_s"),
            ("checkpoint_save", "flash_save_s"),
        )
        if m.get(key) is not None
    }
    lp.hooks.step(step, m["loss"], m["step_time_s"] * 1000.0, **timings)
    # the loop's own time between this step and the next (the save, the report):
    # no training happens in it, so it is what the goodput figures lose per step
    now = time.perf_counter()
    m["host_s"] = now - stepped
    # the whole loop turn, from the last one's report to this one's: the step, the save,
    # the report, and what host_s leaves out (the last turn's metrics line, its command
    # poll and loss check, and this turn's fault checks); the first turn of a run has none
    if lp.turn_at is not None:
        m["turn_s"] = now - lp.turn_at
    lp.turn_at = now
    m["end_unix_s"] = time.time()  # when this step's loop turn ended (an outside account)
    if lp.out is not None:
        lp.out.write(json.dumps(m) + "\n")
        lp.out.flush()
    if lp.rank == 0 and (step % lp.config.log_every == 0 or step == lp.config.steps):
        log.info("step", **{k: v for k, v in m.items() if v is not None})


class SaveRequests:
    """FlashSave requests from the driver (`RequestCheckpoint`), read from the hooks socket.

    The socket is read at most every `POLL_S`; a request for step s makes the first save at
    or after s a persisted one. Only the lowest requested step is remembered.
    """

    POLL_S = 0.05

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks
        self.at: int | None = None
        self.hold: str | None = None  # the agent's hold (in-job recovery): leave the step
        self._polled = 0.0

    def poll(self, *, now: bool = False) -> None:
        """Read the agent's commands (at most every `POLL_S`, unless `now`)."""
        t = time.monotonic()
        if not now and t - self._polled < self.POLL_S:
            return
        self._polled = t
        for c in self.hooks.commands():
            kind = c.WhichOneof("kind")
            if kind == "flash_save":
                want = int(c.flash_save)
                self.at = want if self.at is None else min(self.at, want)
            elif kind == "hold":
                self.hold = c.hold or "hold"

    def held(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a command, read what came: whether the agent holds."""
        if self.hold is None:
            self.hooks.wait(timeout_s)
            self.poll(now=True)
        return self.hold is not None

    def due(self, step: int) -> bool:
        self.poll()
        if self.at is not None and step >= self.at:
            self.at = None
            return True
        return False


# this process's injected compute fault (`unbroken inject sdc-matmul`), on until 0
_MATMUL: Any = None


def _mine(fault: WorkerFault) -> bool:
    """Whether this worker is the one an sdc fault names (its local rank)."""
    want = fault.sdc.local_rank if fault.sdc is not None else -1
    return want < 0 or want == int(os.environ.get("LOCAL_RANK", "0"))


def _in_copy(fault: WorkerFault) -> bool:
    """Whether an sdc flip is meant for the rank's flash copy of the step alone."""
    return fault.sdc is not None and fault.sdc.target == "copy"


def _apply_sdc(
    trainer: object, fault: WorkerFault, step: int, at: tuple[str, int, int] | None = None
) -> tuple[str, int, int] | None:
    """Corrupt this rank as `fault` says (trainer/sdc.py), and say so in the log; returns a
    flip's place (`at`: flip that place back, quietly)."""
    global _MATMUL
    from unbroken.common.faults import SdcDetail
    from unbroken.trainer import sdc

    d = fault.sdc or SdcDetail()
    where = None
    try:
        if fault.kind == SDC:
            what, where = sdc.flip_bit(trainer, tensor=d.tensor, bit=d.bit, target=d.target, at=at)
            if at is not None:
                return None
        else:
            if _MATMUL is None:
                _MATMUL = sdc.MatmulFault()
            _MATMUL.set(d.size)
            what = f"every matmul x (1 + {d.size:g})" if d.size else "matmuls exact again"
    except ValueError as e:
        log.warning("sdc fault not applied", kind=fault.kind, error=str(e))
        return None
    in_copy = " (in the flash copy alone)" if _in_copy(fault) else ""
    log.warning("sdc fault applied", kind=fault.kind, step=step, what=what + in_copy, id=fault.id)
    return where


def _skip(trainer: object, n: int, before_step: int) -> None:
    """Skip `n` batches (loss-spike recovery); a trainer without `skip` cannot."""
    if not isinstance(trainer, Skips):
        log.warning("the trainer has no skip(n); batches not skipped", batches=n)
        return
    trainer.skip(n)
    log.info("batches skipped", batches=n, before_step=before_step)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, join the group, train, always clean up. Returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m unbroken.trainer.run", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not structlog.is_configured():  # per-step debug lines (flash saves) would flood logs
        setup_worker_logging(logging.INFO)
    try:
        config = to_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from unbroken.trainer.hookchannel import install

    # Said before the rendezvous, so the agent judges this rank from its start: a rank
    # stopped while it joins the group (or sets up) is flagged hung within a second, where
    # a rank that had said nothing yet was never judged and its peers and the driver's
    # restore waited minutes (bench-recovery: a hang injected 3 s into a restart stalled
    # the job 80 s, until a driver kill's new decision restarted the world).
    hooks = install()
    hooks.phase("startup")
    mark("start")
    # The imports' objects live as long as the process: out of the collector's sight, the
    # full collections of an in-job recovery (which frees the old world's groups) scan only
    # what the trainer made, about 1 ms instead of 1.6-2 s on a loaded 2-core host.
    gc.freeze()
    forget_dry_run_caches()  # a warm standby's dry run may have guessed another rank
    devicewarm.start(config, int(os.environ.get("LOCAL_RANK", "0") or 0))  # its own thread
    while True:
        before_world = open_sockets()  # what is not the world's: kept when it is left
        owns = init_distributed(config)
        keepworld.new_world()
        mark("pg_init")
        guard = ncclguard.start_guard(hooks, before_world) if started_by_agent() else None
        try:
            config.check_world(dist.get_world_size())
            try:
                train(
                    config,
                    resume_from=args.resume_from,
                    save_to=args.save_to,
                    metrics_out=args.metrics_out,
                )
                dist.barrier()  # every rank done with its last collective before teardown
            except Held:
                raise
            except Exception as e:  # the final barrier: a peer that died there
                if hooks.replies and started_by_agent() and peer_failure(e):
                    raise Held(f"{type(e).__name__}: {e}", -1) from e
                raise
            return 0
        except ValueError as e:
            log.error("bad configuration", error=str(e))
            return 2
        except Held as h:
            mark("closed", step=h.step)
            if guard is not None:  # an abort it began ends before the world is left
                guard.stop()
            rejoin = _leave(h, hooks, before_world)
            if rejoin is None:
                return 1
            mark("rejoin")
            apply_rejoin(rejoin)
            args = parser.parse_args(argv)
            try:
                config = to_config(args)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            hooks.phase("startup")
        finally:
            if guard is not None:
                guard.stop()
            if owns and dist.is_initialized():
                gc.collect()  # free DDP/FSDP state before the group goes away
                dist.destroy_process_group()


def _leave(h: Held, hooks: Hooks, world_since: frozenset[tuple[int, str]]) -> Any:
    """Leave the world `h` ended and wait for the next: its Rejoin (None: a stop, or none
    came). A rank that kept its world (trainer/keepworld.py) has its Rejoin or stop already."""
    if h.stopped:
        return None
    if h.rejoin is not None:  # the Rejoin named another world than the one kept
        leave_world(h, world_since)
        return h.rejoin
    return hold(h, hooks, world_since=world_since)


if __name__ == "__main__":
    sys.exit(main())
