"""Worker-side hooks: the agent's local channel, and the hooks SDK for any launcher.

A worker (the embedded engine, a plugin trainer or any script) calls `report_step` once
per step. Each call is one datagram on the agent's unix socket (env
`UNBROKEN_AGENT_SOCKET`; the SDK sends at most one per `REPORT_EVERY_S`): no connection,
no thread, no gRPC, no torch, a few microseconds; when the agent is gone or its buffer is
full the report is dropped rather than slowing the step. `install()` also registers a
faulthandler stack dump on SIGUSR1 so the agent can dump a hung worker's Python stacks
before it kills it, and ties the worker's life to its agent's (`die_with_agent`:
PR_SET_PDEATHSIG, then a check that the parent is still the agent named in
`UNBROKEN_AGENT_PID`, which closes the race of an agent dying before the
prctl). Outside an agent (no env variable) every call is a no-op.

The SDK (`init`, `report`, `save`, `restore`, `should_stop`, `should_save`, `close`) is
for scripts the agent did not start (torchrun, srun, a Kubernetes operator). It finds the
node's agent through `UNBROKEN_AGENT_SOCKET`, else the agent's default socket
(`DEFAULT_SOCKET`), attaches (a Hello with `attach`, answered by a Welcome naming the
node's flash store), and then saves each rank's state into the agent's shared memory,
overlapped with the next step (`unbroken.trainer.flashckpt`, imported with torch only at
the first save or restore), so a killed worker restarted by its launcher restores the
newest step every rank holds (memory, then the buddy's replica, then storage). Without a
reachable agent it warns once and every call is a cheap no-op (`restore` returns None),
so the script stays portable.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import faulthandler
import math
import os
import select
import signal
import socket
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from unbroken.common.paths import DEFAULT_SOCKET, private_dir, trusted_socket
from unbroken.common.workerenv import AGENT_PID as ENV_AGENT_PID
from unbroken.common.workerenv import AGENT_SOCKET as ENV_SOCKET
from unbroken.proto import hooks_pb2 as hpb

if TYPE_CHECKING:
    from unbroken.trainer.flashckpt import FlashCheckpointer

WELCOME_TIMEOUT_S = 2.0  # an agent answers an attaching Hello within this, or is ignored
SAVE_BUDGET = 0.02  # share of the step time flash saves may cost (init(save_budget=...))
# Of the flash copies, the agent persists to storage about one per this many seconds (the
# others live in memory and the buddy's replica): persisting every copy would cost the node
# far more than the save itself (init(persist_every_s=...)).
PERSIST_EVERY_S = 30.0
CALIBRATE_CALLS = 8  # save() calls that all save, to measure a save's cost
FIRST_RETUNE_CALLS = 64  # save() calls after calibrating to the first full measurement
RETUNE_CALLS = 256  # save() calls between later re-tunings
PROBE_CALLS = 16  # saving every step, skip every this-many-th so a save's cost shows
MAX_EVERY = 1000  # never fewer saves than one per this many steps
# The SDK sends at most one step report per this many seconds (the agent's heartbeat
# carries one per 100 ms): shorter steps ride along in the next report, so a 1 ms step
# loop does not wake the agent a thousand times a second.
REPORT_EVERY_S = 0.05
POLL_EVERY_S = 0.005  # the agent's commands are read at most this often
ENV_LOCAL_RANK = "LOCAL_RANK"
STACK_SIGNAL = signal.SIGUSR1
RESTOP_SIGNAL = signal.SIGUSR2  # dump the stacks, then stop again (a stopped worker's dump)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_agent() -> bool:
    """Have the kernel SIGKILL this process when its parent (the agent) dies.

    The agent also starts workers under `setpriv --pdeathsig KILL`; this covers workers
    started some other way. Setting the signal in the worker itself is safe (no fork with
    threads involved). If the parent is already not the agent, the agent died before the
    signal was armed: exit at once instead of training as an orphan.

    Returns:
        True when the death signal is armed (Linux, under an agent).
    """
    agent = os.environ.get(ENV_AGENT_PID, "")
    if not agent.isdigit() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if int(agent) not in _ancestors():
        print(
            f"unbroken: agent {agent} is gone (parent is now {os.getppid()}); exiting",
            file=sys.stderr,
        )
        os._exit(70)
    return True


def _ancestors(limit: int = 8) -> list[int]:
    """Pids of this process's parent, grandparent, ... (a worker may run under a shell)."""
    out, pid = [], os.getppid()
    for _ in range(limit):
        if pid <= 1:
            break
        out.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


class Hooks:
    """A connectionless client of the agent's local channel."""

    def __init__(
        self,
        socket_path: str | None = None,
        local_rank: int | None = None,
        *,
        coalesce_s: float = 0.0,
    ) -> None:
        """A client of the agent at `socket_path` (default: `UNBROKEN_AGENT_SOCKET`).

        Args:
            socket_path: the agent's socket; empty: every call is a no-op.
            local_rank: this worker's local rank (default: `LOCAL_RANK`).
            coalesce_s: send at most one step report per this many seconds; the steps in
                between ride along in the next report (their mean step time, their peak
                loss). 0 sends every step.
        """
        self.path = socket_path if socket_path is not None else os.environ.get(ENV_SOCKET, "")
        rank = local_rank if local_rank is not None else os.environ.get(ENV_LOCAL_RANK, "0")
        self.local_rank = int(rank)
        self.pid = os.getpid()
        self.coalesce_s = coalesce_s
        self._last_t: float | None = None
        self._sent_t: float | None = None  # when the last step report went out
        self._held: tuple[int, float | None, dict[str, float]] | None = None  # newest unsent
        self._held_steps = 0
        self._held_ms = 0.0  # their summed step time
        self._peak: tuple[float, int] | None = None  # their highest (or non-finite) loss
        self._wait_ms = 0.0  # collective waits marked since the last step (`collective`)
        self._sock: socket.socket | None = None
        self._reply = ""
        if self.path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            # The agent's replies come to a socket file in this user's private runtime
            # directory: unlike an abstract-namespace name, no other user can send to it.
            try:
                reply = os.path.join(private_dir(), f"w-{self.pid}-{id(self):x}.sock")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(reply)
                self._sock.bind(reply)
                os.chmod(reply, 0o600)
                self._reply = reply
            except OSError as e:
                _warn_once(f"no private reply socket ({e}); agent commands cannot reach us")
                self._reply = ""

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def _send(self, report: hpb.WorkerReport) -> bool:
        if self._sock is None:
            return False
        report.local_rank = self.local_rank
        report.pid = self.pid
        try:
            self._sock.sendto(report.SerializeToString(), self.path)
            return True
        except OSError:  # agent gone or its buffer full: drop, never block the step
            return False

    def hello(self, *, stack_signal: bool, restop_signal: bool = False) -> bool:
        """Tell the agent where to send commands and which signals dump stacks."""
        return self._send(
            hpb.WorkerReport(
                hello=hpb.Hello(
                    reply_socket=self._reply,
                    stack_signal=stack_signal,
                    restop_signal=restop_signal,
                )
            )
        )

    def phase(self, name: str) -> bool:
        """Tell the agent this rank enters phase `name` (now).

        "train" is judged for hangs by the rank's step rhythm (about a second at 100 ms
        steps); any other name ("restore", "checkpoint", "eval") by the agent's longer
        phase limit, so a slow restore or evaluation is not a hang. The next step report
        puts the rank back into "train".
        """
        return self._send(hpb.WorkerReport(phase=hpb.PhaseReport(name=name)))

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Mark a wait for peers (an all-reduce, a barrier): its time is reported as
        `collective_wait` and the rest of the step as `compute`, for straggler detection."""
        self.phase("collective")  # a long wait here is a peer's hang, judged as such
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._wait_ms += (time.monotonic() - t0) * 1000.0

    def step(
        self,
        step: int,
        loss: float | None = None,
        step_time_ms: float | None = None,
        **timings_ms: float,
    ) -> bool:
        """Report a finished step; `step_time_ms` defaults to the time since the last report.

        Args:
            step: the step just finished (non-decreasing).
            loss: its loss (None when unknown).
            step_time_ms: its duration in ms (default: measured between reports).
            **timings_ms: named phase durations in ms ("forward", "backward", ...).

        Returns:
            True when a datagram was sent now; False when the step is held for the next
            report (`coalesce_s`) or the datagram was dropped.
        """
        now = time.monotonic()
        if step_time_ms is None:
            step_time_ms = 0.0 if self._last_t is None else (now - self._last_t) * 1000.0
        self._last_t = now
        if self._wait_ms and "collective_wait" not in timings_ms:  # marked by `collective`
            wait = min(self._wait_ms, step_time_ms)
            timings_ms = {**timings_ms, "compute": step_time_ms - wait, "collective_wait": wait}
        self._wait_ms = 0.0
        if loss is not None:
            loss = float(loss)
            p = self._peak  # a non-finite loss, once held, is never replaced
            if p is None or (math.isfinite(p[0]) and (not math.isfinite(loss) or loss > p[0])):
                self._peak = (loss, step)
        # the newest step, as plain values: the message is built only when it is sent
        self._held = (step, loss, timings_ms)
        self._held_steps += 1
        self._held_ms += step_time_ms
        if (
            self.coalesce_s > 0
            and self._sent_t is not None
            and now - self._sent_t < self.coalesce_s
            and (loss is None or math.isfinite(loss))
        ):
            return False
        return self.flush_steps(now)

    def flush_steps(self, now: float | None = None) -> bool:
        """Send the held step report, if any (True when a datagram went out)."""
        if self._held is None:
            return False
        step, loss, timings_ms = self._held
        rep = hpb.StepReport(
            step=step, steps=self._held_steps, step_time_ms=self._held_ms / self._held_steps
        )
        if loss is not None:
            rep.loss, rep.has_loss = loss, True
        for k, v in timings_ms.items():
            rep.timings_ms[k] = float(v)
        if self._peak is not None:
            rep.has_peak, (rep.peak_loss, rep.peak_step) = True, self._peak
        self._held, self._held_steps, self._held_ms, self._peak = None, 0, 0.0, None
        self._sent_t = time.monotonic() if now is None else now
        return self._send(hpb.WorkerReport(step=rep))

    def commands(self) -> list[hpb.WorkerCommand]:
        """Commands the agent sent (pause, resume, flash-save), without blocking."""
        out: list[hpb.WorkerCommand] = []
        if self._sock is None:
            return out
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, OSError):
                return out
            with contextlib.suppress(Exception):
                out.append(hpb.WorkerCommand.FromString(data))

    def close(self) -> None:
        if self._sock is not None:
            self.flush_steps()
            self._sock.close()
            self._sock = None
            if self._reply:
                with contextlib.suppress(OSError):
                    os.unlink(self._reply)


_default: Hooks | None = None


def install(*, stack_signal: bool = True) -> Hooks:
    """The process-wide hooks client; registers the SIGUSR1 stack dump and says hello."""
    global _default
    if _default is None:
        _default = Hooks()
        if _default.enabled:
            die_with_agent()
        restop = False
        if stack_signal and _default.enabled:
            faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
            restop = _install_restop()
        _default.hello(stack_signal=stack_signal and _default.enabled, restop_signal=restop)
    return _default


def _dump_and_stop(signum: int, frame: Any) -> None:
    """SIGUSR2: the agent continued this stopped process only to read its stacks.

    A Python-level handler runs at the first bytecode after SIGCONT (an interrupted sleep
    returns into it), so the stacks show where it was stopped and no step runs before the
    process stops itself again.
    """
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def _install_restop() -> bool:
    """Register `_dump_and_stop` unless the script owns SIGUSR2 or this is not the main thread."""
    try:
        if signal.getsignal(RESTOP_SIGNAL) is not signal.SIG_DFL:
            return False
        signal.signal(RESTOP_SIGNAL, _dump_and_stop)
    except ValueError:  # not the main thread
        return False
    return True


def report_step(
    step: int, loss: float | None = None, step_time_ms: float | None = None, **timings_ms: float
) -> bool:
    """Report a finished step through the process-wide client (see `Hooks.step`)."""
    return install().step(step, loss, step_time_ms, **timings_ms)


# ---------------------------------------------------------------- the SDK for any launcher


def find_socket(env: Mapping[str, str] | None = None) -> str:
    """The agent socket a script should use: `UNBROKEN_AGENT_SOCKET`, else the default."""
    e = os.environ if env is None else env
    return e.get(ENV_SOCKET) or DEFAULT_SOCKET


def _rank() -> tuple[int, int]:
    """(global rank, world size): from torch.distributed when initialised, else the env."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_dist_ready = False  # torch.distributed was seen initialized (it stays so in a step loop)


def _require_dist(what: str) -> None:
    global _dist_ready
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


class _Bundle:
    """A user's state dict seen as a trainer by `FlashCheckpointer`.

    Values with `state_dict`/`load_state_dict` (a DDP model, an optimizer, a scheduler)
    are saved through them; plain tensors and nested dicts are saved as they are and
    restored in place. An optimizer that has not stepped yet holds no state to restore
    into, so for a restore it is primed first (`_prime`).
    """

    def __init__(self, state: dict[str, Any], *, loading: bool = False) -> None:
        import torch

        self.state = state
        self.loading = loading
        opts = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
        # none in the state: guard every optimizer of the process (torch's global hook)
        self.optimizers: list[Any] | None = opts or None

    def state_dict(self) -> dict[str, Any]:
        if self.loading:
            for opt in self.optimizers or ():
                _prime(opt)
        return {k: v.state_dict() if _stateful(v) else v for k, v in self.state.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k, v in list(self.state.items()):
            if _stateful(v):
                v.load_state_dict(state_dict[k])
            elif not isinstance(v, dict):  # dicts were filled in place
                self.state[k] = state_dict[k]


def _stateful(v: object) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(
        getattr(v, "load_state_dict", None)
    )


def _prime(opt: Any) -> None:
    """Create an optimizer's per-parameter state (one step with zero gradients and lr 0)
    so a saved state has tensors to be copied into; the restore overwrites all of it."""
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


def save_interval(cost_s: float, step_s: float, budget: float, max_every: int = MAX_EVERY) -> int:
    """Steps between flash saves so that their cost stays within `budget` of the step time.

    Args:
        cost_s: what one save costs the training: the time it blocks the step plus the CPU
            time its background copy, checksum and manifest take (on a machine without a
            spare core that CPU is taken from training).
        step_s: the time of one step without saving.
        budget: the share of step time saves may take (0.02: 2 %).
        max_every: the longest interval, in steps.

    Returns:
        1 (save every step) when a save is cheap enough, else the smallest interval within
        budget, at most `max_every`.
    """
    if cost_s <= 0:
        return 1
    if step_s <= 0:
        return max_every
    return max(1, min(max_every, math.ceil(cost_s / (budget * step_s) - 1e-9)))


def _thread_cpu_s(prefix: str) -> float:
    """CPU seconds used so far by this process's threads whose name starts with `prefix`."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.ident is not None:
            with contextlib.suppress(OSError, AttributeError):
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return total


class Pacer:
    """Which `save` calls really save: all while calibrating, then one per `every` steps.

    Every rank must choose the same steps (a restore needs a step every rank holds), so
    the interval is agreed on collectively: each rank measures what its saves cost and what
    a step costs over a window of calls, and the ranks take the largest interval any of
    them needs. Calls are counted, not timed, so the ranks tune at the same call.

    A save costs more than the time it blocks: its background copy takes CPU (on a node
    without a spare core, from training), and copying megabytes evicts the step's data
    from the caches. So the cost is measured in this process's CPU time (every thread,
    which is also what other processes on the machine do not change): the CPU of the
    steps that carried a save's copy (the step after it; the latest 32) less that of the
    others (the latest 512), medians, so that a pause between two calls (an evaluation,
    a data stall) weighs no more than any other step. The interval is the
    larger of that CPU cost over `budget` of a step's CPU, and of the blocking over
    `budget` of a step's wall time. The calibrating window (every call saves, so no step
    is free of a save) falls back to the blocking plus the flash writer thread's CPU; the
    next window, `FIRST_RETUNE_CALLS` later, measures the whole cost. Saving every step,
    every `PROBE_CALLS`-th call skips its save so that the comparison stays possible.
    """

    def __init__(
        self, budget: float, writer_threads: str, persist_every_s: float = PERSIST_EVERY_S
    ) -> None:
        if not 0 < budget < 1:
            raise ValueError(f"save_budget must be in (0, 1), got {budget}")
        self.budget = budget
        self.writer_threads = writer_threads
        self.persist_every_s = persist_every_s
        self.every = 1
        self.persist_every = 0  # steps between persisted saves, agreed (0: none yet)
        self.persist_wanted = 0  # this rank's wish: persist_every_s over its step time
        self.calls = 0
        self.saves = 0
        self.blocked_s = 0.0  # of the saves of finished windows
        self.cost_s = 0.0  # the newest window's estimate of one save's cost (CPU s)
        self.step_cpu_s = 0.0  # and of one step's CPU without a save
        self._handles: list[Any] = []  # this window's saves (their blocked_s grows later)
        self._last: tuple[float, float] | None = None  # the previous call's (wall, CPU)
        self._prev_saved = False  # whether the previous call saved
        # this window's steps (time between calls): (wall s, CPU s, followed a save)
        self._steps: list[tuple[float, float, bool]] = []
        self._cpu0 = 0.0
        # CPU s of the latest steps that carried a save's copy, and of the others
        self._carried: collections.deque[float] = collections.deque(maxlen=32)
        self._free: collections.deque[float] = collections.deque(maxlen=512)

    def due(self, step: int) -> bool:
        """Whether the call for `step` saves (counts the call)."""
        self.calls += 1
        now = (time.perf_counter(), time.process_time())
        if self._last is None:
            self._cpu0 = _thread_cpu_s(self.writer_threads)
        else:
            self._steps.append((now[0] - self._last[0], now[1] - self._last[1], self._prev_saved))
        self._last, self._prev_saved = now, False
        if self.calls <= CALIBRATE_CALLS:
            return True
        if self.every == 1:  # all but every PROBE_CALLS-th, so some steps follow no save
            return self.calls % PROBE_CALLS != 0
        return step % self.every == 0

    def saved(self, handle: Any) -> None:
        if handle is not None:
            self._handles.append(handle)
            self.saves += 1
            self._prev_saved = True

    def _window_ends(self) -> bool:
        n = self.calls - CALIBRATE_CALLS
        return n == 0 or n == FIRST_RETUNE_CALLS or (n > 0 and n % RETUNE_CALLS == 0)

    def measure(self) -> int | None:
        """This rank's wanted interval when a window ends at this call, else None."""
        if not self._window_ends():
            return None
        cpu = _thread_cpu_s(self.writer_threads)
        steps, handles = self._steps, self._handles
        blocked = sum(h.blocked_s for h in handles)
        self.blocked_s += blocked
        self._handles, self._steps, self._cpu0, writer_cpu = [], [], cpu, cpu - self._cpu0
        free = [s for s in steps if not s[2]]
        if free:  # (not the calibrating window: its steps are the slower first ones)
            self._carried.extend(s[1] for s in steps if s[2])
            self._free.extend(s[1] for s in free)
        if self._carried and self._free:
            self.step_cpu_s = statistics.median(self._free)
            self.cost_s = max(0.0, statistics.median(self._carried) - self.step_cpu_s)
            wanted = save_interval(self.cost_s, self.step_cpu_s, self.budget)
            if free:
                wall = statistics.median(s[0] for s in free)
                self._wish_persist(wall)
                if handles:
                    blocking = save_interval(blocked / len(handles), wall, self.budget)
                    wanted = max(wanted, blocking)
            return wanted
        if not handles:  # nothing saved yet: nothing to learn
            return self.every
        # Every step followed a save (calibration): its blocking and the writer's CPU,
        # against the median time between calls less that cost.
        self.cost_s = (blocked + writer_cpu) / len(handles)
        gap = statistics.median(s[0] for s in steps) if steps else 0.0
        self._wish_persist(max(0.0, gap - self.cost_s))
        return save_interval(self.cost_s, max(0.0, gap - self.cost_s), self.budget)

    def _wish_persist(self, step_s: float) -> None:
        every = math.ceil(self.persist_every_s / step_s) if step_s > 0 else MAX_EVERY
        self.persist_wanted = max(1, every)

    def agreed(self, every: int, persist_every: int) -> None:
        """Take the intervals all ranks agreed on; persisted saves fall on saved steps."""
        self.every = every
        self.persist_every = every * math.ceil(persist_every / every)

    def persist(self, step: int) -> bool:
        """Whether the save of `step` is one for the agent to persist."""
        return self.persist_every > 0 and step % self.persist_every == 0


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
        self.save_budget = SAVE_BUDGET
        self.persist_every_s = PERSIST_EVERY_S
        self.pacer: Pacer | None = None
        self.last: Any = None  # the newest save's handle
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

    def checkpointer(self) -> FlashCheckpointer | None:
        """The flash checkpointer over the agent's store (created at first use)."""
        if self.flash is None and not self.flash_off:
            import logging

            import structlog

            from unbroken.trainer.flashckpt import FlashCheckpointer, FlashEnv

            if not structlog.is_configured():  # a debug line per save would flood the output
                structlog.configure(
                    wrapper_class=structlog.make_filtering_bound_logger(logging.INFO)
                )

            w = self.welcome
            env = FlashEnv(
                root=w.flash_root, job=w.flash_job, node=w.flash_node, persist_url=w.persist_url
            )
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
    hello = hpb.Hello(
        reply_socket=hooks._reply, stack_signal=False, attach=True, rank=rank, world_size=world
    )
    if not hooks._reply or not hooks._send(hpb.WorkerReport(hello=hello)):
        hooks.close()
        _warn_once(
            f"no agent at {path} (set {ENV_SOCKET} to the node agent's --socket, or start "
            "`unbroken agent` on this node); running without fault tolerance: save, restore "
            "and report do nothing"
        )
        return None
    assert hooks._sock is not None
    deadline = time.monotonic() + timeout_s
    early: list[hpb.WorkerCommand] = []
    while (left := deadline - time.monotonic()) > 0:
        select.select([hooks._sock], [], [], left)
        for c in hooks.commands():
            if c.WhichOneof("kind") == "welcome":
                session = Session(hooks, c.welcome)
                session.pending = early
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


def phase(name: str) -> bool:
    """Announce a phase ("eval", "checkpoint", "restore"; "train" to go back): the agent
    judges a hang in it by its phase limit, not the step rhythm (see `Hooks.phase`)."""
    s = _get()
    return s.hooks.phase(name) if s is not None else False


def report(step: int, loss: float | None = None, **timings_ms: float) -> bool:
    """Report a finished step to the agent: one datagram, dropped rather than blocking.

    Args:
        step: the step just finished.
        loss: its loss (a float, or a 0-d tensor: `.item()` is taken).
        **timings_ms: named phase durations in ms ("data", "forward", ...); the step time
            is measured between reports.

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
    that copy. Do not change saved tensors in place before the next optimizer step.

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
    s.poll()  # a FlashSave request counts even when the script never asks should_save()
    requested = s.save_at is not None and step >= s.save_at
    due = s.pacer.due(step) or force or requested
    if due:
        from unbroken.recovery.persist import PERSIST_META, TIMELINE_META, current_timeline
        from unbroken.recovery.sources import LAYOUT_META
        from unbroken.trainer.flashckpt import KEY

        bundle = _Bundle(state_dict)
        ckpt.guard(bundle)  # type: ignore[arg-type]
        meta = {
            LAYOUT_META: ckpt.layout(bundle),  # type: ignore[arg-type]
            PERSIST_META: force or requested or s.pacer.persist(step),
            TIMELINE_META: current_timeline(),
        }
        handle = ckpt.writer.save_async({KEY: bundle}, step, meta=meta)
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


def restore(state_dict: dict[str, Any]) -> int | None:
    """Load the newest step every rank holds into `state_dict` (in place).

    Collective under torch.distributed: call it on every rank, after
    `init_process_group` and after building the model and optimizer. Sources in order:
    this node's agent memory, the buddy's replica, storage.

    Args:
        state_dict: shaped as in `save` (the same objects).

    Returns:
        The restored step (continue with the next one), or None: nothing saved yet, no
        agent, or no flash store.
    """
    s = _get()
    ckpt = s.checkpointer() if s is not None else None
    if s is None or ckpt is None:
        return None
    _require_dist("restore")
    done = ckpt.restore(_Bundle(state_dict, loading=True))  # type: ignore[arg-type]
    s.restored_step = done.step if done is not None else None
    return s.restored_step


def should_stop() -> bool:
    """Whether the driver or agent asked this job to stop (pause, eviction, shutdown).

    Save and leave the loop when it turns True; a resume turns it False again.
    """
    s = _get()
    if s is None:
        return False
    s.poll()
    return bool(s.stop_reason)


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


def reset() -> None:
    """Forget the attachment and the warning, so `init` looks again (for tests)."""
    global _tried, _warned, _dist_ready
    close()
    _tried = False
    _warned = False
    _dist_ready = False
