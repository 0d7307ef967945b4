"""The hooks SDK against the agent's real hook server, in one process.

No agent: one warning, then every call is a no-op. With the agent's `HookServer` (on an
asyncio loop in a thread, as in the agent): a script attaches and gets the node's flash
store, its step reports land in the agent's table of attached workers, the agent's pause,
resume, flash-save and stop commands reach `should_stop` / `should_save`, and a flash save
of a model + AdamW restores exactly into a fresh model and an optimizer that never
stepped. The agent claims the default socket path only when no live agent holds it.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import difflib
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tests.astparse import parse
from unbroken.agent import hookserver
from unbroken.agent.hookserver import HookServer
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor
from unbroken.common.workerenv import FLASH_JOB, FLASH_NODE, FLASH_ROOT
from unbroken.proto import hooks_pb2 as hpb
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.trainer import examples, hookchannel, hooks
from unbroken.trainer import pacer as pacing

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh_sdk() -> Iterator[None]:
    hooks.reset()
    yield
    hooks.reset()


class Agent:
    """The agent's hook server on its own event loop thread."""

    def __init__(self, tmp: Path, path: str) -> None:
        self.flash_root = str(tmp / "shm")
        FlashOwner(FlashConfig(root=self.flash_root, job="sdk"))  # the agent creates it
        spec = WorkerSpec(
            cmd=["true"],
            nproc=2,
            log_dir=str(tmp / "logs"),
            extra_env={FLASH_ROOT: self.flash_root, FLASH_JOB: "sdk", FLASH_NODE: "n0"},
        )
        self.server = HookServer(path, Supervisor(spec, path), "n0")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.server.start())

    def call(self, coro: Any) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(10.0)

    def send(self, cmd: hpb.WorkerCommand) -> int:
        async def go() -> int:
            return self.server.send(cmd)

        return int(self.call(go()))

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        self.loop.close()


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    a = Agent(tmp_path, str(tmp_path / "agent.sock"))
    monkeypatch.setenv(hooks.ENV_SOCKET, a.server.path)  # what a script finds it by
    try:
        yield a
    finally:
        a.close()


def _until(cond: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_find_socket_prefers_the_env_then_the_default() -> None:
    assert hooks.find_socket({"UNBROKEN_AGENT_SOCKET": "/x/a.sock"}) == "/x/a.sock"
    assert hooks.find_socket({}) == hooks.DEFAULT_SOCKET == hookserver.DEFAULT_SOCKET


def test_no_agent_warns_once_and_every_call_is_a_noop(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hooks.init(str(tmp_path / "nobody.sock")) is False
        for step in range(3):
            assert hooks.report(step, 1.0, data=2.0) is False
            assert hooks.save(step, {"x": object()}) is False
            assert hooks.restore({"x": object()}) is None
            assert hooks.should_stop() is False
            assert hooks.should_save() is False
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "no agent at" in str(caught[0].message)
    assert "UNBROKEN_AGENT_SOCKET" in str(caught[0].message)  # says what to do
    assert caught[0].filename == __file__  # points at the caller, not at the SDK


def test_stale_socket_of_a_dead_agent_counts_as_no_agent(tmp_path: Path) -> None:
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.close()  # the file stays, nobody listens
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hooks.init(path) is False
    assert len(caught) == 1


def test_attach_reports_and_commands(agent: Agent) -> None:
    assert hooks.init() is True
    session = hooks._session
    assert session is not None
    assert session.welcome.flash_root == agent.flash_root
    assert session.welcome.node_id == "n0"
    pid = os.getpid()
    assert pid in agent.server.attached
    assert hooks.report(7, 0.25, data=1.5) is True
    _until(lambda: agent.server.attached[pid].step == 7, "the step report")
    assert agent.server.attached[pid].loss == 0.25
    # the agent's heartbeats carry it (for operators; the driver never acts on it)
    (st,) = [w for w in agent.server.statuses(time.monotonic()) if w.pid == pid]
    assert (st.step, st.loss, st.has_loss, st.state) == (7, 0.25, True, 2)  # RUNNING

    assert hooks.should_stop() is False and hooks.should_save() is False
    assert agent.send(hpb.WorkerCommand(command_id="p", pause="drill")) == 1
    _until(hooks.should_stop, "the pause")
    agent.send(hpb.WorkerCommand(command_id="r", resume=8))
    _until(lambda: not hooks.should_stop(), "the resume")
    agent.send(hpb.WorkerCommand(command_id="f", flash_save=8))
    _until(hooks.should_save, "the flash-save request")
    agent.send(hpb.WorkerCommand(command_id="e", stop="evict"))
    _until(hooks.should_stop, "the stop")
    agent.send(hpb.WorkerCommand(command_id="r2", resume=9))
    # a later request proves the resume was read (the socket keeps the agent's order)
    agent.send(hpb.WorkerCommand(command_id="f2", flash_save=1))
    _until(lambda: hooks.should_save() and session.save_at == 1, "the later request")
    assert hooks.should_stop() is True  # an eviction is final: no resume undoes it


def _train(steps: int, seed: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model, "opt": opt, "extra": {"epoch": 2, "pos": torch.tensor([steps])}}


@pytest.fixture
def one_rank() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_save_then_restore_into_a_fresh_model_and_unstepped_optimizer(
    agent: Agent, one_rank: None
) -> None:
    import torch

    saved = _train(3, seed=0)
    assert hooks.init() is True
    agent.send(hpb.WorkerCommand(command_id="c", flash_save=3))  # RequestCheckpoint's
    _until(hooks.should_save, "the flash-save request")
    assert hooks.save(3, saved) is True
    assert hooks.should_save() is False  # served
    hooks.reset()  # a new process: finish the save, attach again

    fresh = _train(0, seed=1)  # other weights, an optimizer with no state yet
    assert not fresh["opt"].state
    assert hooks.restore(fresh) == 3
    for a, b in zip(saved["model"].parameters(), fresh["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = saved["opt"].state_dict(), fresh["opt"].state_dict()
    assert sa["param_groups"] == sb["param_groups"]  # lr restored after priming
    for k, st in sa["state"].items():
        for name, t in st.items():
            assert torch.equal(t, sb["state"][k][name]), (k, name)
    assert fresh["extra"]["epoch"] == 2 and int(fresh["extra"]["pos"]) == 3
    # the first "train" with the step restored says where it came from (the driver counts
    # the ranks that read storage: the persistence interval's failures); another phase not
    session = hooks._session
    assert session is not None
    sent: list[tuple[str, int | None, str]] = []
    session.hooks.phase = lambda *a: sent.append(a) or True  # type: ignore[method-assign]
    assert hooks.phase("train", step=3) and hooks.phase("eval") and hooks.phase("train", step=2)
    assert sent == [("train", 3, "memory"), ("eval", None, ""), ("train", 2, "")]


def test_restore_with_nothing_saved_is_a_fresh_start(agent: Agent, one_rank: None) -> None:
    assert hooks.restore(_train(0, seed=0)) is None


def test_agent_claims_the_default_socket_only_when_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = str(tmp_path / "default.sock")
    monkeypatch.setattr(hookserver, "DEFAULT_SOCKET", default)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(default)
    stale.close()  # a dead agent's file: taken over
    first = Agent(tmp_path / "a", default)
    try:
        assert first.server.path == default
        second = Agent(tmp_path / "b", default)  # a live agent holds it: keep a private path
        try:
            assert second.server.path != default
            assert second.server.supervisor.socket_path == second.server.path
            assert hookserver.socket_in_use(default) and hookserver.socket_in_use(
                second.server.path
            )
        finally:
            second.close()
        assert hookserver.socket_in_use(default)  # the second agent left the first's alone
    finally:
        first.close()
    assert not os.path.exists(default)


def _code_lines(path: Path) -> list[str]:
    """The module's lines after its docstring (the two examples describe themselves)."""
    text = path.read_text()
    doc = parse(text).body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    assert doc.end_lineno is not None
    return text.splitlines()[doc.end_lineno :]


def test_the_fault_tolerant_example_adds_fewer_than_10_lines() -> None:
    here = Path(examples.__file__).parent
    plain, ft = _code_lines(here / "ddp_plain.py"), _code_lines(here / "ddp_unbroken.py")
    diff = list(difflib.unified_diff(plain, ft, lineterm="", n=0))
    added = [d for d in diff if d.startswith("+") and not d.startswith("+++")]
    removed = [d for d in diff if d.startswith("-") and not d.startswith("---")]
    assert len(added) < 10, "\n".join(diff)
    assert removed == ["-    start = 0"], removed  # the only line changed, not rewritten
    assert any("hooks.save" in a for a in added) and any("hooks.restore" in a for a in added)


def test_save_interval_keeps_saves_within_the_budget() -> None:
    assert pacing.save_interval(0.0005, 0.1, 0.02) == 1  # cheap against the step: every step
    assert pacing.save_interval(0.01, 0.01, 0.02) == 50  # 10 ms per save, 10 ms steps: 1 in 50
    assert pacing.save_interval(10.0, 0.001, 0.02) == pacing.MAX_EVERY
    assert pacing.save_interval(0.01, 0.0, 0.02) == pacing.MAX_EVERY
    assert pacing.save_interval(0.0, 0.0, 0.02) == 1
    with pytest.raises(ValueError, match="save_budget"):
        pacing.Pacer(1.5, "x")


def test_pacer_saves_every_step_while_calibrating_then_the_agreed_steps() -> None:
    pacer = pacing.Pacer(0.02, "no-such-thread")
    due = [pacer.due(step) for step in range(1, pacing.CALIBRATE_CALLS + 1)]
    assert all(due)
    assert pacer.measure() == 1  # nothing saved, no cost measured
    pacer.every = 5
    assert [s for s in range(9, 30) if pacer.due(s)] == [10, 15, 20, 25]
    assert pacer.measure() is None  # the next window ends RETUNE_CALLS calls later


class _Clock:
    """A fake `time` for the pacer: steps advance wall and CPU time by what we say."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def perf_counter(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.cpu


class _Handle:
    blocked_s = 0.0005


def test_pacer_measures_a_saves_whole_cost_in_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that blocks little but costs its next step 4 ms of CPU (the copy, the caches)
    against 2 ms CPU steps is paced at 4 / (2 % of 2) = 1 in 100 steps, whatever the wall
    time of the steps (here inflated 3x by other load)."""
    clock = _Clock()
    monkeypatch.setattr(pacing, "time", clock)
    pacer = pacing.Pacer(0.02, "no-such-thread")
    after_save = False
    wanted: list[int] = []
    for step in range(1, 2000):
        clock.cpu += 0.002 + (0.004 if after_save else 0.0)
        clock.wall += 3 * (0.002 + (0.004 if after_save else 0.0))
        after_save = pacer.due(step)
        if after_save:
            pacer.saved(_Handle())
        if (w := pacer.measure()) is not None:
            wanted.append(w)
            pacer.every = w
    # calibration sees only the blocking against the (inflated) wall step: 0.5 ms over 2 %
    # of 17.5 ms asks for 1 in 2; steps that follow no save then show the whole cost
    assert wanted[0] == 2
    assert wanted[1:] == [100] * (len(wanted) - 1), wanted
    assert pacer.cost_s == pytest.approx(0.004)
    assert pacer.step_cpu_s == pytest.approx(0.002)


def test_short_steps_ride_along_in_the_next_report_with_their_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most one datagram per coalesce_s: the newest step, the steps' mean time and their
    highest loss; a non-finite loss goes out at once; close() sends what is held."""
    path = str(tmp_path / "agent.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    rx.settimeout(1.0)
    now = [100.0]
    monkeypatch.setattr(hookchannel.time, "monotonic", lambda: now[0])
    h = hookchannel.Hooks(socket_path=path, local_rank=0, coalesce_s=0.05)

    def received() -> list[hpb.StepReport]:
        out = []
        rx.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                out.append(hpb.WorkerReport.FromString(rx.recv(65536)).step)
        return out

    try:
        sent = []
        for step, loss in ((1, 2.0), (2, 2.1), (3, 7.0), (4, 2.2), (5, 2.0)):
            sent.append(h.step(step, loss, step_time_ms=10.0))
            now[0] += 0.0125  # steps 2-4 fall within 50 ms of step 1's report
        assert sent == [True, False, False, False, True]
        first, second = received()
        assert (first.step, first.steps, first.peak_step, first.peak_loss) == (1, 1, 1, 2.0)
        assert (second.step, second.loss, second.steps) == (5, 2.0, 4)
        assert (second.has_peak, second.peak_step, second.peak_loss) == (True, 3, 7.0)
        assert second.step_time_ms == pytest.approx(10.0)
        assert h.step(6, 2.0) is False
        assert h.step(7, float("nan")) is True  # at once, whatever the time
        (nan,) = received()
        assert nan.steps == 2 and nan.peak_step == 7 and math.isnan(nan.peak_loss)
        assert h.step(8, 1.0) is False
        h.close()
        (last,) = received()
        assert last.step == 8 and last.steps == 1
    finally:
        rx.close()


def test_held_timings_are_averaged_and_a_long_collective_is_marked_a_short_one_not(
    tmp_path: Path,
) -> None:
    """The embedded engine's reports (coalesced, `collective_entered`): a coalesced report
    carries the mean compute and wait of its steps (the straggler detector's input); a
    collective left within `LAZY_COLLECTIVE_S` sends nothing, one that lasts is reported
    as the "collective" phase once, by the marker thread, while the rank still waits, and
    never after a phase the rank said since (a rank that left a failed collective and said
    "held")."""
    path = str(tmp_path / "agent.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    h = hookchannel.Hooks(socket_path=path, local_rank=0, coalesce_s=60.0)

    def received(wait_s: float = 0.0) -> list[hpb.WorkerReport]:
        """What arrived; the first datagram is waited for up to `wait_s`."""
        out = []
        rx.settimeout(wait_s)  # 0: non-blocking
        with contextlib.suppress(BlockingIOError, TimeoutError):
            while True:
                out.append(hpb.WorkerReport.FromString(rx.recv(65536)))
                rx.setblocking(False)
        return out

    try:
        assert h.step(1, 2.0, 10.0, compute=8.0, collective_wait=2.0)  # the first: at once
        received()
        for step, (c, w) in enumerate(((6.0, 4.0), (10.0, 0.0), (8.0, 2.0)), start=2):
            h.collective_entered()  # peers on time: no datagram
            assert not h.step(step, 2.0, 10.0, compute=c, collective_wait=w)
        time.sleep(3 * hookchannel.LAZY_COLLECTIVE_S)
        assert received() == []
        h.flush_steps()
        (rep,) = received(1.0)
        assert rep.step.steps == 3 and rep.step.step == 4
        assert dict(rep.step.timings_ms) == {"compute": 8.0, "collective_wait": 2.0}

        h.collective_entered()  # a peer stopped: the rank waits on
        (marked,) = received(2.0)
        assert marked.WhichOneof("kind") == "phase" and marked.phase.name == "collective"
        time.sleep(3 * hookchannel.LAZY_COLLECTIVE_S)
        assert received() == []  # once per collective

        # a peer died in the collective: the rank leaves it and says "held" before the
        # marker's time; the marker says nothing after it (the agent's view stays "held")
        h.collective_entered()
        assert h.phase("held")
        time.sleep(3 * hookchannel.LAZY_COLLECTIVE_S)
        assert [r.phase.name for r in received(1.0)] == ["held"]

        # a signal handler of the script's may say a phase while its main thread is inside
        # a send (the sends' lock held by this thread): it is said, not deadlocked
        with h._say:
            assert h.phase("checkpoint")
        assert [r.phase.name for r in received(1.0)] == ["checkpoint"]
    finally:
        h.close()
        rx.close()


def test_persisted_saves_are_agreed_and_fall_on_saved_steps() -> None:
    pacer = pacing.Pacer(0.02, "no-such-thread", persist_every_s=30.0)
    assert not pacer.persist(1000)  # nothing agreed yet: memory only
    pacer._wish_persist(0.012)  # 12 ms steps: 30 s is 2500 steps
    assert pacer.persist_wanted == 2500
    # another rank wanted it; down to 4 values an octave (2048), up to a multiple of 7
    pacer.agreed(every=7, persist_every=2500)
    assert pacer.persist_every == 2051
    assert [s for s in range(1, 4500) if pacer.persist(s)] == [2051, 4102]
    pacer.agreed(every=7, persist_every=2300)  # a re-measured step time: the interval stays
    assert pacer.persist_every == 2051
    with pytest.raises(ValueError, match="persist_every_s"):
        hooks.init(persist_every_s=0)
