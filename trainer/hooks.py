"""The hooks SDK: fault tolerance for scripts under any launcher (torchrun, srun, ...).

The SDK (`init`, `report`, `save`, `restore`, `should_stop`, `should_save`, `flush`,
`close`, `collective`, `phase`, `injected_fault`) is for scripts the agent did not start.
Libraries that build on it (the adapters) also use `restored_source`, `stateful` and
`prime`. It finds the node's
agent through `UNBROKEN_AGENT_SOCKET`, else the agent's default socket (`DEFAULT_SOCKET`),
attaches over the agent's local channel (`unbroken.trainer.hookchannel`: a Hello with
`attach`, answered by a Welcome naming the node's flash store), and then saves each rank's
state into the agent's shared memory, overlapped with the next step
(`unbroken.trainer.flashckpt`, imported with torch only at the first save or restore) and
paced to a share of the step time (`unbroken.trainer.pacer`), so a killed worker restarted
by its launcher restores the newest step every rank holds (memory, then the buddy's
replica, then storage). Without a reachable agent it warns once and every call is a cheap
no-op (`restore` returns None), so the script stays portable.

`install` (the process-wide channel client of a worker the agent started: step reports,
stack dumps, dying with the agent) and the socket names come from the channel and are
part of this module's public names, so `from unbroken.trainer import hooks` is all a
script imports.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from unbroken.common.paths import DEFAULT_SOCKET, SYSTEM_SOCKET, trusted_socket
from unbroken.common.workerenv import AGENT_SOCKET as ENV_SOCKET
from unbroken.proto import hooks_pb2 as hpb
from unbroken.trainer import ncclguard, torchrunhold, worldpin
from unbroken.trainer.hookchannel import Hooks, install, stacks_on_signal
from unbroken.trainer.pacer import PERSIST_EVERY_S, SAVE_BUDGET, Pacer
from unbroken.trainer.plugin import Stateful
from unbroken.trainer.rejoin import (
    HOLD_WAIT_S,
    Held,
    apply_rejoin,
    hold,
    peer_failure,
    started_by_agent,
)

if TYPE_CHECKING:
    from unbroken.common.faults import WorkerFault
    from unbroken.trainer.faultfile import FaultFile
    from unbroken.trainer.flashckpt import FlashCheckpointer

T = TypeVar("T")

__all__ = [
    "DEFAULT_SOCKET",
    "ENV_SOCKET",
    "close",
    "collective",
    "find_socket",
    "flush",
    "init",
    "injected_fault",
    "install",
    "phase",
    "prime",
    "recovery_loop",
    "register",
    "report",
    "reset",
    "restore",
    "restored_source",
    "save",
    "should_save",
    "should_stop",
    "stateful",
]

WELCOME_TIMEOUT_S = 2.0  # an agent answers an attaching Hello within this, or is ignored
# The SDK sends at most one step report per this many seconds (the agent's heartbeat
# carries one per 100 ms): shorter steps ride along in the next report, so a 1 ms step
# loop does not wake the agent a thousand times a second.
REPORT_EVERY_S = 0.05
POLL_EVERY_S = 0.005  # the agent's commands are read at most this often


def find_socket(env: Mapping[str, str] | None = None) -> str:
    """The agent socket a script should use: `UNBROKEN_AGENT_SOCKET`, else the default (an
    agent of this user), else the system agent's (`SYSTEM_SOCKET`) when that exists."""
    e = os.environ if env is None else env
    if e.get(ENV_SOCKET):
        return e[ENV_SOCKET]
    if not os.path.exists(DEFAULT_SOCKET) and os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    return DEFAULT_SOCKET


def _rank() -> tuple[int, int]:
    """(global rank, world size): from torch.distributed when initialised, else the env."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_dist_ready = False  # torch.distributed was seen initialized (it stays so in a step loop)


def _require_dist(what: str) -> None:
    global _dist_ready, _guard
    if _dist_ready:
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        raise RuntimeError(
            f"unbroken.hooks.{what} needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first (a single process too, with "
            "world_size=1), so every rank agrees on the step to restore"
        )
    _dist_ready = True
    s = _get()
    if _in_recovery_loop:  # this world's groups are freed once it is over (trainer/worldpin.py)
        worldpin.pin()
    if _in_recovery_loop and s is not None and _guard is None and started_by_agent():
        _guard = ncclguard.NcclGuard.start_if_nccl(s.hooks)  # NCCL: see trainer/ncclguard.py


#: The NCCL guard of the world `recovery_loop`'s body joined (None: none, or not NCCL).
_guard: ncclguard.NcclGuard | None = None


class _Bundle:
    """A user's state dict seen as a trainer (`plugin.Stateful`) by `FlashCheckpointer`.

    Values with `state_dict`/`load_state_dict` (a DDP model, an optimizer, a scheduler)
    are saved through them; plain tensors and nested dicts are saved as they are and
    restored in place. An optimizer that has not stepped yet holds no state to restore
    into, so for a restore it is primed first (`_prime`). Build it with `_bundle`.
    """

    def __init__(self, state: dict[str, Any], opts: list[Any], *, loading: bool) -> None:
        self.state = state
        self.loading = loading
        self._opts = opts

    def state_dict(self) -> dict[str, Any]:
        if self.loading:
            for opt in self._opts:
                _prime(opt)
        return {k: v.state_dict() if _stateful(v) else v for k, v in self.state.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k, v in list(self.state.items()):
            if _stateful(v):
                v.load_state_dict(state_dict[k])
            elif not isinstance(v, dict):  # dicts were filled in place
                self.state[k] = state_dict[k]


def _stateful(value: Any) -> bool:
    """`isinstance(value, Stateful)` as Python's runtime protocol check decides it, without
    recomputing the protocol's members (~20 us an object, a few times every save)."""
    return (
        getattr(value, "state_dict", None) is not None
        and getattr(value, "load_state_dict", None) is not None
    )


class _BundleOptimizers(_Bundle):
    """A state dict holding optimizers: only their steps wait for a save's copy
    (`plugin.Optimizers`)."""

    @property
    def optimizers(self) -> list[Any]:
        return self._opts


def stateful(state_dict: dict[str, Any], *, loading: bool = False) -> Stateful:
    """`state_dict` (shaped as in `save`) as one object with `state_dict` and
    `load_state_dict`, as `save` and `restore` see it: e.g. to load a
    torch.distributed.checkpoint into it (`dcp.load(s.state_dict(), ...)`, then
    `s.load_state_dict(...)`). `loading`: prime its optimizers first (see `prime`)."""
    return _bundle(state_dict, loading=loading)


def _bundle(state: dict[str, Any], *, loading: bool = False) -> _Bundle:
    """The state dict as a `_Bundle`; with no optimizer in it every optimizer of the
    process is guarded (torch's global hook)."""
    import torch

    opts = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    return (_BundleOptimizers if opts else _Bundle)(state, opts, loading=loading)


def prime(optimizer: Any) -> None:
    """Create an optimizer's per-parameter state (one step with zero gradients and lr 0),
    so that a saved state has tensors to be loaded into; a restore overwrites all of it.
    Does nothing to an optimizer that has state already."""
    _prime(optimizer)


def _prime(opt: Any) -> None:
    """`prime` (see there)."""
    import torch

    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in opt.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def own_flash_root(root: str) -> str:
    """`root` (the agent's flash store) when it is ours or not made yet; else, for a system
    agent of another user, a directory of ours beside it on the same tmpfs
    (`<first directory up that we or root own>/unbroken-u<uid>/<basename>`)."""
    me = os.geteuid()
    try:
        if os.stat(root).st_uid == me:
            return root
    except FileNotFoundError:
        return root
    except OSError:
        pass
    up = os.path.dirname(os.path.abspath(root))
    while up != "/":
        try:
            if os.stat(up).st_uid in (me, 0):
                break
        except OSError:
            pass
        up = os.path.dirname(up)
    return os.path.join(up, f"unbroken-u{me}", os.path.basename(os.path.abspath(root)))


class Session:
    """One process's attachment to its node's agent (the SDK's state)."""

    def __init__(self, hooks: Hooks, welcome: hpb.Welcome) -> None:
        self.hooks = hooks
        self.welcome = welcome
        self.stop_reason = ""  # pause or stop received, no resume since
        self.stopped = False  # a stop (eviction, shutdown) is final
        self.save_at: int | None = None  # a FlashSave's step, until a save reaches it
        self.pending: list[hpb.WorkerCommand] = []
        self.flash: FlashCheckpointer | None = None
        self.flash_off = not welcome.flash_root
        self.restored_step: int | None = None
        self.restored_source = ""  # where the restored state came from (memory, ...)
        self.save_budget = SAVE_BUDGET
        self.persist_every_s = PERSIST_EVERY_S
        self.pacer: Pacer | None = None
        self.last: Any = None  # the newest save's handle
        self.held = ""  # the agent's hold (in-job recovery), until the world is left
        self._polled = -math.inf  # when the socket was last read

    def poll(self) -> None:
        """Apply the commands the agent sent since the last poll (non-blocking; the socket
        is read at most once per `POLL_EVERY_S`, so a step loop calling this twice a step
        costs a clock read, not two system calls)."""
        now = time.monotonic()
        if not self.pending and now - self._polled < POLL_EVERY_S:
            return
        self._polled = now
        cmds, self.pending = [*self.pending, *self.hooks.commands()], []
        for c in cmds:
            kind = c.WhichOneof("kind")
            if kind == "pause" and not self.stopped:
                self.stop_reason = c.pause
            elif kind == "stop":  # eviction or shutdown: no resume follows
                self.stop_reason, self.stopped = c.stop or "stop", True
            elif kind == "resume" and not self.stopped:
                self.stop_reason = ""
            elif kind == "flash_save":
                step = c.flash_save
                self.save_at = step if self.save_at is None else min(self.save_at, step)
            elif kind == "hold":
                self.held = c.hold or "hold"

    def checkpointer(self) -> FlashCheckpointer | None:
        """The flash checkpointer over the agent's store (created at first use)."""
        if self.flash is None and not self.flash_off:
            import logging

            import structlog

            from unbroken.common.logsetup import setup_worker_logging
            from unbroken.trainer.flashckpt import FlashCheckpointer, FlashEnv

            if not structlog.is_configured():  # a debug line per save would flood the output
                setup_worker_logging(logging.INFO)

            w = self.welcome
            root = own_flash_root(w.flash_root)
            if root != w.flash_root:
                _warn_once(
                    f"the agent's flash store {w.flash_root} belongs to its own user: saves "
                    f"go to {root} in this node's memory instead, restored from there, "
                    "without the agent's buddy copy or persistence"
                )
            env = FlashEnv(root=root, job=w.flash_job, node=w.flash_node, persist_url=w.persist_url)
            self.flash = FlashCheckpointer(env, _rank()[0])
            self.pacer = Pacer(self.save_budget, f"flash-{self.flash.rank}_", self.persist_every_s)
        return self.flash

    def close(self) -> None:
        if self.flash is not None:
            self.flash.close()
            self.flash = None
        self.hooks.close()


_session: Session | None = None
_tried = False  # init ran (attached or not): later calls never look again
_warned = False


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"unbroken.hooks: {message}", RuntimeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside this module (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def _attach(path: str, timeout_s: float) -> Session | None:
    """Say an attaching Hello on `path` and wait for the Welcome; None when nobody answers."""
    rank, world = _rank()
    why = trusted_socket(path) if os.path.exists(path) else ""
    if why:
        _warn_once(
            f"not attaching to the agent socket {path}: {why}; running without fault "
            "tolerance (an agent's socket belongs to its user, in a private directory)"
        )
        return None
    hooks = Hooks(socket_path=path, coalesce_s=REPORT_EVERY_S)
    if hooks.reply_error:
        _warn_once(hooks.reply_error)
    if not hooks.replies or not hooks.hello(
        stack_signal=False, attach=True, rank=rank, world_size=world
    ):
        hooks.close()
        _warn_once(
            f"no agent at {path} (set {ENV_SOCKET} to the node agent's --socket, or start "
            "`unbroken agent` on this node); running without fault tolerance: save, restore "
            "and report do nothing"
        )
        return None
    deadline = time.monotonic() + timeout_s
    early: list[hpb.WorkerCommand] = []
    while (left := deadline - time.monotonic()) > 0:
        hooks.wait(left)
        for c in hooks.commands():
            if c.WhichOneof("kind") == "welcome":
                session = Session(hooks, c.welcome)
                session.pending = early
                stacks_on_signal()  # a hung worker's stacks, as the agent's own workers give
                import structlog  # here, not at import: importing this module stays cheap

                structlog.get_logger(__name__).info(
                    "hooks.attached",
                    socket=path,
                    rank=rank,
                    node=c.welcome.node_id,
                    flash=c.welcome.flash_root or None,
                )
                if session.flash_off:
                    _warn_once(
                        f"the agent at {path} owns no flash store (started without "
                        "--worker-cmd, or with --no-flash): save and restore do nothing"
                    )
                return session
            early.append(c)
    hooks.close()
    _warn_once(
        f"the agent at {path} did not answer within {timeout_s} s (an older agent, or "
        "overloaded); running without fault tolerance: save, restore and report do nothing"
    )
    return None


def init(
    socket_path: str | None = None,
    *,
    timeout_s: float = WELCOME_TIMEOUT_S,
    save_budget: float = SAVE_BUDGET,
    persist_every_s: float = PERSIST_EVERY_S,
) -> bool:
    """Attach this process to its node's agent (idempotent; the other calls do it lazily).

    Args:
        socket_path: the agent's socket (default: `UNBROKEN_AGENT_SOCKET`, else
            `DEFAULT_SOCKET`).
        timeout_s: how long to wait for the agent's answer.
        save_budget: the share of step time flash saves may cost (see `save`).
        persist_every_s: about how often a save is also persisted to storage by the agent
            (the others stay in memory and in the buddy's replica; see `save`).

    Returns:
        True when attached; False (after one warning) when no agent answered, in which
        case every other call is a no-op.
    """
    global _session, _tried
    if not 0 < save_budget < 1:
        raise ValueError(f"save_budget must be in (0, 1), got {save_budget}")
    if not persist_every_s > 0:
        raise ValueError(f"persist_every_s must be > 0, got {persist_every_s}")
    if not _tried:
        _tried = True
        _session = _attach(socket_path or find_socket(), timeout_s)
        if _session is not None:
            _session.save_budget = save_budget
            _session.persist_every_s = persist_every_s
            atexit.register(close)
    return _session is not None


register = init  # the name for it


def _get() -> Session | None:
    if not _tried:
        init()
    return _session


@contextlib.contextmanager
def collective() -> Iterator[None]:
    """Mark a wait for peers in a script (`with hooks.collective(): dist.all_reduce(t)`):
    its time is reported as the step's `collective_wait`, the rest as `compute`."""
    s = _get()
    if s is None:
        yield
        return
    with s.hooks.collective():
        yield


def phase(name: str, step: int | None = None, source: str | None = None) -> bool:
    """Announce a phase ("eval", "checkpoint", "restore"; "train" to go back): the agent
    judges a hang in it by its phase limit, not the step rhythm (see `Hooks.phase`). Give
    `step` with the first "train" after a restore (the step restored): the driver's
    RestoreFinished then says what the restart really lost. `source`: where that state
    came from ("memory", "buddy", "storage"); by default what `restore` said it loaded."""
    s = _get()
    if s is None:
        return False
    if source is None:
        source = s.restored_source if step is not None and step == s.restored_step else ""
    return s.hooks.phase(name, step, source)


def report(step: int, loss: float | None = None, **timings_ms: float) -> bool:
    """Report a finished step to the agent: one datagram, dropped rather than blocking.

    Args:
        step: the step just finished.
        loss: its loss (a float, or a 0-d tensor: `.item()` is taken).
        **timings_ms: named phase durations in ms ("forward", ...); the step time is
            measured between reports. "data_loading" (waiting for the batch) and
            "checkpoint_save" (blocked saving) are charged as goodput's in-loop badput.

    Steps shorter than `REPORT_EVERY_S` are held and sent with the next report (the newest
    step and loss, their mean step time and their highest loss), so the agent is woken at
    most 20 times a second however short the steps; `close` sends what is held.

    Returns:
        True when a report was sent now (False: held for the next one, or no agent).
    """
    s = _get()
    if s is None:
        return False
    return s.hooks.step(step, None if loss is None else float(loss), **timings_ms)


def save(step: int, state_dict: dict[str, Any], *, force: bool = False) -> bool:
    """Flash-save `state_dict` as the state after `step` into the agent's memory.

    Call it after every step, on every rank (it is collective now and then). Overlapped:
    this returns after a snapshot of the small values, the tensors are copied on a
    background thread during the next forward and backward, and the next
    `optimizer.step()` (of an optimizer in `state_dict`, else of every optimizer) waits for
    that copy. Do not change saved tensors in place before the next optimizer step. Models
    and optimizers whose `state_dict` is torch's own are not asked for it every save:
    their tensors' identities are checked and the small values read
    (trainer/bundlesnap.py); a replaced tensor is noticed and saved from where it is.

    Paced so that saving costs at most `save_budget` of the step time (`init`; 2 %): the
    first calls all save and measure, then every rank saves each `every`-th step (the
    same steps on every rank), every step when saves are cheap against the step. About
    one save per `persist_every_s` (`init`; 30 s), again the same steps on every rank, is
    also persisted to storage by the agent, as is a forced or requested save; the others
    live in the agent's memory and the buddy's replica.

    Args:
        step: the step this state belongs to (the one just finished).
        state_dict: name -> a model (DDP or not), optimizer, scheduler (anything with
            `state_dict`/`load_state_dict`), a tensor, or a nested dict of tensors and
            small values. Pass the same dict to `restore`.
        force: save this step regardless of the pacing (call it on every rank).

    Returns:
        True when a save started (False when paced out, or without an agent or its flash
        store).
    """
    s = _get()
    ckpt = s.checkpointer() if s is not None else None
    if s is None or ckpt is None:
        return False
    assert s.pacer is not None, "created with the checkpointer"
    _require_dist("save")
    if ncclguard.tripped():  # the step ran on an aborted NCCL world: nothing of it is kept
        raise Held(f"NCCL world aborted: {ncclguard.tripped()}", step)
    if _in_recovery_loop:  # a group made since the world was first seen (trainer/worldpin.py)
        worldpin.refresh()
    s.poll()  # a FlashSave request counts even when the script never asks should_save()
    requested = s.save_at is not None and step >= s.save_at
    due = s.pacer.due(step) or force or requested
    if due:
        from unbroken.recovery.persist import PERSIST_META, TIMELINE_META, current_timeline
        from unbroken.recovery.sources import LAYOUT_META
        from unbroken.trainer import bundlesnap
        from unbroken.trainer.flashckpt import KEY

        bundle = _bundle(state_dict)
        ckpt.guard(bundle)
        meta = {
            LAYOUT_META: ckpt.layout(bundle),
            PERSIST_META: force or requested or s.pacer.persist(step),
            TIMELINE_META: current_timeline(),
        }
        snap = bundlesnap.snapshot(KEY, state_dict, bundle)  # state_dict() skipped
        handle = ckpt.writer.save_async(snap or {KEY: bundle}, step, meta=meta)
        s.pacer.saved(handle)
        s.last = handle
        if requested:
            s.save_at = None
    wanted = s.pacer.measure()  # at the same call on every rank, saved or not
    if wanted is not None:
        s.pacer.agreed(*_agree(wanted, s.pacer.persist_wanted))
    return due


def _agree(*wanted: int) -> tuple[int, ...]:
    """The largest of each interval any rank wants (collective)."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wanted)
    return tuple(max(int(w[i]) for w in everyone) for i in range(len(wanted)))


def restore(state_dict: dict[str, Any], *, not_after: int | None = None) -> int | None:
    """Load the newest step every rank holds into `state_dict` (in place).

    Collective under torch.distributed: call it on every rank, after
    `init_process_group` and after building the model and optimizer. Sources in order:
    this node's agent memory, the buddy's replica, storage.

    Args:
        state_dict: shaped as in `save` (the same objects).
        not_after: restore the newest step at or before this one and discard this
            rank's newer copies (a rollback: they are a dead timeline). A loss-spike
            rollback names it in `UNBROKEN_RESTORE_STEP`.

    Returns:
        The restored step (continue with the next one), or None: nothing saved yet, no
        agent, or no flash store. `restored_source` says where it came from.
    """
    s = _get()
    ckpt = s.checkpointer() if s is not None else None
    if s is None or ckpt is None:
        return None
    _require_dist("restore")
    done = ckpt.restore(_bundle(state_dict, loading=True), not_after=not_after)
    s.restored_step = done.step if done is not None else None
    s.restored_source = done.source if done is not None else ""
    if done is not None and not_after is not None:
        ckpt.discard_after(done.step)
    return s.restored_step


def restored_source() -> str:
    """Where the last `restore` found its step: "memory", "buddy", "storage", or ""
    (nothing restored, or no agent)."""
    s = _session
    return s.restored_source if s is not None else ""


_faults: FaultFile | None = None
_faults_read = False  # the environment was looked at (no fault file: never again)


def injected_fault(next_step: int) -> WorkerFault | None:
    """The fault injected for `next_step` (`unbroken inject nan|loss-spike`), once.

    Call it before each step's forward with the step about to run: it returns the fault
    when it is due (its step, or the first step after a fault for a past step), and never
    again for the same injection, also after this worker restarts. The agent writes the
    fault to the file its workers find in `UNBROKEN_FAULT_FILE`; without that variable
    (not started by an agent) this is one global read and None. Apply it to the step
    (`kind` "loss-spike": the step's loss must really spike; "nan": its forward turns
    non-finite), and the agent's detectors and the driver do the rest.
    """
    global _faults, _faults_read
    if not _faults_read:
        _faults_read = True
        from unbroken.trainer.faultfile import FaultFile

        _faults = FaultFile.from_env(_rank()[0])
    if _faults is None:
        return None
    return _faults.due(next_step)


def should_stop() -> bool:
    """Whether the driver or agent asked this job to stop (pause, eviction, shutdown).

    Save and leave the loop when it turns True; a resume turns it False again.
    """
    if _in_recovery_loop and _torchrun_dir and torchrunhold.world_pending(_torchrun_dir):
        raise Held("held by torchrun's agent: another node's worker failed", -1)
    s = _get()
    if s is None:
        return False
    s.poll()
    if s.held and _in_recovery_loop:
        raise Held(f"held by the agent: {s.held}", -1)
    return bool(s.stop_reason)


def spike_wait(step: int, loss: float | None) -> bool:
    """After a step's `report` and `save`: when this rank's loss spikes, judged as the
    driver judges it, wait at that step (0.5 s at most) for the agent's hold, so the rollback
    finds the job one step past its target, not several (trainer/spikewait.py). Only in a
    process an agent started: its driver decides rollbacks. True when held or stopped."""
    s = _get()
    if s is None or loss is None or not s.hooks.replies or not started_by_agent():
        return False
    from unbroken.trainer import spikewait

    sess = s

    def held(timeout_s: float) -> bool:
        sess.hooks.wait(timeout_s)
        sess._polled = -math.inf  # read now, not at the next poll interval
        sess.poll()
        return bool(sess.held or sess.stop_reason)

    return spikewait.shared(held, sess.hooks.flush_steps).after(step, loss)


def should_save() -> bool:
    """Whether the driver asked for a flash save (FlashSave, e.g. `RequestCheckpoint`) that
    no `save` has served yet: save after the step that just finished, then it turns False.
    """
    s = _get()
    if s is None:
        return False
    s.poll()
    return s.save_at is not None


def flush(timeout_s: float = 600.0) -> None:
    """Wait until the newest save is a valid copy in the agent's memory (e.g. before exit).

    Raises:
        TimeoutError: not done within `timeout_s`.
    """
    s = _session
    if s is not None and s.last is not None:
        s.last.wait(timeout_s)


def close() -> None:
    """Finish the save in flight and detach (also run at exit)."""
    global _session
    if _session is not None:
        session, _session = _session, None
        session.close()


_in_recovery_loop = False
_torchrun_dir = ""  # torchrun's in-job directory, in a recovery loop under it (torchrunhold)


def recovery_loop(body: Callable[[], T], *, hold_s: float = HOLD_WAIT_S) -> T:
    """Run `body` and keep this process through a peer's failure (in-job recovery).

    `body` is the script's whole distributed part: `init_process_group` (from the
    environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), building the model and
    optimizer, `restore`, and the step loop (calling `should_stop` once a step). When a
    step fails because a peer died (a collective's connection closed or reset, a timeout),
    or the agent tells this process to hold (then `should_stop` raises), the process
    leaves its world: its process groups are dropped, the agent hears it is held, and it
    waits for the agent's Rejoin. The new world's environment is then applied and `body`
    runs again in the same process (same pid, imports kept), restoring the agreed step.

    Under torchrun with `--rdzv-backend=unbroken --rdzv-conf in_job=1`, torchrun's agent
    plays that part (trainer/torchrunhold.py): the new world's MASTER_ADDR and MASTER_PORT
    come from it, and only the failed node's workers are restarted. Under another launcher,
    or without an agent, `body` runs once and its errors propagate as before.

    Returns:
        What `body` returned.

    Raises:
        SystemExit: held, but no Rejoin came within `hold_s` (or a stop came): exit code 1,
            so the launcher or agent restarts the process as before.
    """
    global _in_recovery_loop, _dist_ready, _guard, _torchrun_dir
    _torchrun_dir = torchrunhold.directory()  # under torchrun with the backend's in_job=1
    if started_by_agent() or _torchrun_dir:  # an NCCL peer's failure must not end this process
        ncclguard.nccl_keeps_process()
    # no world's group held for ever by torch's defaults: with none held, the last world's
    # group is freed (its threads joined) before the interpreter ends, where a gloo thread
    # still wanting the GIL would abort the process
    worldpin.import_early()
    # What exists now (the imports) lives as long as the process: out of the collector's
    # sight, the full collections of a recovery (freeing the old world's groups) are cheap.
    gc.freeze()
    while True:
        s = _get()
        _in_recovery_loop = True
        try:
            out = body()
        except Exception as e:
            by_agent = s is not None and s.hooks.replies and started_by_agent()
            if not by_agent and not _torchrun_dir:
                raise
            if isinstance(e, Held):
                held = e
            elif peer_failure(e) or ncclguard.tripped():
                held = Held(f"{type(e).__name__}: {e}", -1)
            else:
                raise
        else:  # the world's groups are freed here, not by a DDP Reducer (GIL held), even
            gc.collect()  # when a cycle holds the model (trainer/worldpin.py)
            worldpin.release()
            return out
        finally:
            _in_recovery_loop = False
            if _guard is not None:  # an abort it began ends before the world is left
                _guard.stop()
                _guard = None
        # the flash checkpointer and the pacer belong to the old world (its ranks)
        if s is not None:
            if s.flash is not None:
                with contextlib.suppress(Exception):
                    s.flash.close()
                s.flash = None
            s.pacer, s.last, s.held, s.stop_reason = None, None, "", ""
        _dist_ready = False
        if by_agent:
            rejoin = hold(held, s.hooks, hold_s)  # type: ignore[union-attr]
        else:
            rejoin = torchrunhold.hold(held, hold_s)
        worldpin.release(background=True)  # the old world's groups, left and forgotten
        if rejoin is None:
            raise SystemExit(1)
        apply_rejoin(rejoin)


def reset() -> None:
    """Forget the attachment and the warning, so `init` looks again (for tests)."""
    global _tried, _warned, _dist_ready, _faults, _faults_read
    close()
    _faults, _faults_read = None, False
    _tried = False
    _warned = False
    _dist_ready = False
