"""The driver's commands to an agent: one table of handlers, each declaring its reply.

A command comes down the session as a `DriverMessage`; `handle` checks its leader term, finds
the handler of its kind in `COMMANDS` and answers as the handler declares: a `CommandAck`
carrying the handler's text (most commands), a `SelfCheckReport`, or a `CheckResult`. A
handler that raises `ValueError` is refused with its message (no traceback); any other
exception is a failed command. Adding a command is one handler and one row.

Term checks: a command of another term scope (another etcd cluster or incarnation of the
job), one more than `TERM_SLACK` above the term this session registered under (forged), or
one older than the newest term seen (a deposed leader's) is refused and never obeyed.

Faults can be injected at runtime (InjectFault; common/faults.py RUNTIME_FAULTS):
check-level ones (wrong-matmul, slow) change the fault spec the checks and self-checks
run with; crash / hang signal a worker; node-loss kills the workers and the agent without
a goodbye; nan / loss-spike are written atomically as JSON to `<log dir>/fault.json`,
the file the workers find in UNBROKEN_FAULT_FILE (the trainer reads it each step).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from unbroken.agent import checks, injob
from unbroken.agent.link import AgentExit
from unbroken.common import workerenv
from unbroken.common.faults import (
    SDC_FAULTS,
    SLOW_FILE,
    WORKER_FILE_FAULTS,
    FaultSpec,
    RuntimeFault,
    SdcDetail,
    WorkerFault,
    write_slow_factor,
)
from unbroken.common.workerenv import WorkerEnv
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import hooks_pb2 as hpb

if TYPE_CHECKING:
    from unbroken.agent.daemon import Agent
    from unbroken.agent.workers import Supervisor

log = structlog.get_logger(__name__)

# How far above its registration's leader term a command's term may be: elections that
# can complete while one session lasts (a registration answered just before the new
# leader's LeaderElected is folded sees the previous term). Beyond it: forged.
TERM_SLACK = 16


class Reply(enum.Enum):
    """What a command is answered with."""

    ACK = "ack"  # a CommandAck with the handler's text
    SELF_CHECK = "self_check_report"  # the handler's SelfCheckReport
    CHECK = "check_result"  # the handler's CheckResult


@dataclass(frozen=True, slots=True)
class Handler:
    """One command kind's handler and how it is answered.

    Attributes:
        run: does the command; returns the ack's text, or the report for the other replies.
        reply: what the command is answered with.
        workers: refused on an agent that runs no workers (no --worker-cmd).
        ring_heartbeat: before the ack, send a heartbeat with freshly scanned flash rings.
        then: after a successful reply (node-loss dies there).
        ends_session: after the reply, successful or not, the agent stops.
    """

    run: Callable[[Agent, dpb.DriverMessage], Awaitable[Any]]
    reply: Reply = Reply.ACK
    workers: bool = False
    ring_heartbeat: bool = False
    then: Callable[[Agent, dpb.DriverMessage], Awaitable[None]] | None = None
    ends_session: bool = False


async def handle(agent: Agent, call: Any, msg: dpb.DriverMessage) -> None:
    """Check the command's term, run its handler and reply as it declares."""
    kind = msg.WhichOneof("kind")
    cid = msg.command_id
    log.info("command", kind=kind, command_id=cid, term=msg.term)
    refusal = _term_refusal(agent, msg)
    if refusal is not None:
        await _refuse(agent, call, cid, refusal)
        return
    agent.term_seen = msg.term
    handler = COMMANDS.get(kind or "")
    try:
        if handler is None:
            raise ValueError(f"unknown command {kind!r}")
        if handler.workers and agent.supervisor is None:
            raise ValueError(f"{kind}: this agent runs no workers (no --worker-cmd)")
        out = await handler.run(agent, msg)
        await _reply(agent, call, handler, cid, out)
        if handler.then is not None:
            await handler.then(agent, msg)
    except AgentExit:
        raise
    except Exception as e:
        if isinstance(e, ValueError):  # refused as asked: say why, no traceback
            log.warning("command refused", kind=kind, error=str(e))
        else:
            log.exception("command failed", kind=kind)
        await _refuse(agent, call, cid, f"{type(e).__name__}: {e}"[:4000])
    if handler is not None and handler.ends_session:
        agent.ending_session = True
        agent.stop.set()
        with contextlib.suppress(Exception):
            await call.done_writing()


def _term_refusal(agent: Agent, msg: dpb.DriverMessage) -> str | None:
    """Why a command's leader term is refused, or None to obey it."""
    if msg.term_scope != agent.term_scope:
        # a term of another etcd cluster or an earlier incarnation of the job: its
        # number means nothing here, whether above or below ours
        log.error(
            "command of another term scope refused",
            scope=msg.term_scope,
            ours=agent.term_scope,
            term=msg.term,
        )
        return (
            f"leader term {msg.term} of scope {msg.term_scope!r} (etcd cluster and job "
            f"incarnation) is not of this session's scope {agent.term_scope!r}: refused"
        )
    if msg.term > agent.session_term + TERM_SLACK:
        # a term no election of this session can have made: never adopted, so it
        # cannot make every later command of the real leader look stale
        log.error(
            "command with an implausible leader term refused",
            term=msg.term,
            session_term=agent.session_term,
        )
        return (
            f"leader term {msg.term} is more than {TERM_SLACK} above the term "
            f"{agent.session_term} this session registered under: refused"
        )
    if msg.term < agent.term_seen:
        log.warning(
            "command of an older leader term dropped", term=msg.term, newest=agent.term_seen
        )
        return f"stale leader term {msg.term} < {agent.term_seen}: dropped"
    return None


async def _reply(agent: Agent, call: Any, handler: Handler, cid: str, out: Any) -> None:
    if handler.reply is Reply.SELF_CHECK:
        await agent.write(call, dpb.AgentMessage(self_check_report=out))
        return
    if handler.reply is Reply.CHECK:
        await agent.write(call, dpb.AgentMessage(check_result=out))
        return
    fresh = False
    if handler.ring_heartbeat:
        try:
            fresh = await agent.ring_heartbeat(call)
        except Exception as e:  # the driver then waits for the next heartbeats
            log.warning("ring heartbeat not sent", error=str(e))
    ack = dpb.CommandAck(command_id=cid, ok=True, detail=out[:16000], ring_fresh=fresh)
    await agent.write(call, dpb.AgentMessage(ack=ack))


async def _refuse(agent: Agent, call: Any, cid: str, detail: str) -> None:
    """Answer command `cid` with a refusal saying why (best effort: the stream may be gone)."""
    with contextlib.suppress(Exception):
        await agent.write(
            call, dpb.AgentMessage(ack=dpb.CommandAck(command_id=cid, ok=False, detail=detail))
        )


# ------------------------------------------------------------ checks
async def _run_self_check(agent: Agent, msg: dpb.DriverMessage) -> dpb.SelfCheckReport:
    return await agent.selfcheck(msg.command_id, msg.run_self_check.timeout_s)


async def _run_check(agent: Agent, msg: dpb.DriverMessage) -> dpb.CheckResult:
    t0 = time.monotonic()
    warm = agent.warm_check
    warm_before = warm.taken if warm is not None else 0
    res = await checks.run_check(
        msg.command_id,
        msg.run_check.spec_json,
        agent.fault,
        msg.run_check.timeout_s or agent.config.check_timeout_s,
        warm=warm,
    )
    log.info(
        "check ran",
        command_id=msg.command_id,
        exit_code=res.exit_code,
        warm=bool(warm and warm.taken > warm_before),
        seconds=round(time.monotonic() - t0, 2),
    )
    return res


# ------------------------------------------------------------ injected faults
def _is_node_loss(kind: str) -> bool:
    return kind.strip().lower().replace("_", "-") == "node-loss"


async def _inject_fault(agent: Agent, msg: dpb.DriverMessage) -> str:
    """Apply an injected fault; node-loss only acks here and dies after (`_die_if_node_loss`)."""
    p = msg.inject_fault
    if _is_node_loss(p.kind):
        return "node-loss: exiting"
    f = RuntimeFault.of(p.kind, p.local_rank, p.factor, p.step)
    log.warning("fault injected", kind=f.kind, local_rank=f.local_rank, step=f.step)
    if f.kind in ("wrong-matmul", "slow"):
        spec = f.apply_to(FaultSpec.parse(agent.fault))
        agent.fault = str(spec) if spec.any else ""
        if agent.supervisor is not None:  # workers started from now on see it too
            agent.supervisor.launch = replace(agent.supervisor.launch, fault=agent.fault)
        return f"{f.kind}: checks now run with fault {spec}"
    sup = agent.supervisor
    if sup is None or agent.fault_file is None:
        raise ValueError(f"{f.kind}: this agent runs no workers (no --worker-cmd)")
    if f.kind == "slow-train":
        # the trainer reads it each step (trainer/faultfile.py SlowFile)
        write_slow_factor(agent.fault_file.with_name(SLOW_FILE), f.factor or 2.0)
        return f"slow-train: the workers compute {f.factor or 2.0:g}x slower"
    if f.kind in WORKER_FILE_FAULTS:
        step = f.step or max((w.step for w in sup.workers.values()), default=0) + 1
        detail = None
        if f.kind in SDC_FAULTS:
            detail = SdcDetail.of_message(p.sdc, f.local_rank, sorted(sup.workers))
        WorkerFault(f.kind, step, uuid.uuid4().hex, detail).write(agent.fault_file)
        on = f" on local rank {detail.local_rank}" if detail is not None else ""
        return f"{f.kind}: written to {agent.fault_file} for step {step}{on}"
    w = sup.workers.get(f.local_rank)
    if w is None or w.proc is None or w.proc.returncode is not None:
        running = sorted(r for r, x in sup.workers.items() if x.pid and x.exit_code == 0)
        raise ValueError(
            f"{f.kind}: no running worker of local rank {f.local_rank} (running: {running})"
        )
    sig = {"crash": signal.SIGKILL, "crash-suspect": signal.SIGSEGV}.get(f.kind, signal.SIGSTOP)
    os.kill(w.pid, sig)
    return f"{f.kind}: sent {sig.name} to local rank {f.local_rank} (pid {w.pid})"


async def _die_if_node_loss(agent: Agent, msg: dpb.DriverMessage) -> None:
    if _is_node_loss(msg.inject_fault.kind):
        await asyncio.sleep(0.2)  # let the ack leave; then die like a machine would
        _die(agent)


def _die(agent: Agent) -> NoReturn:
    """node-loss: SIGKILL the workers and exit at once (no goodbye, no cleanup)."""
    log.warning("fault injected: node-loss; exiting without a goodbye")
    if agent.supervisor is not None:
        for w in agent.supervisor.workers.values():
            if w.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
    os._exit(137)


# ------------------------------------------------------------ the node's life
async def _stop_node(agent: Agent, msg: dpb.DriverMessage) -> str:
    """shutdown / evict: the workers stop and the agent ends (`ends_session`)."""
    kind = msg.WhichOneof("kind")
    if agent.hooks is not None:  # scripts this agent did not start: save and exit
        agent.hooks.send(hpb.WorkerCommand(command_id=msg.command_id, stop=kind))
    if agent.supervisor is not None:
        await agent.supervisor.stop_all(grace_s=2.0)
    return f"{kind}: workers stopped"


async def _retention(agent: Agent, msg: dpb.DriverMessage) -> str:
    if agent.flash is None:
        return "retention: no flash store"
    gone = await asyncio.to_thread(
        agent.flash.retain, list(msg.retention.keep_steps), msg.retention.below
    )
    return f"retention: deleted steps {gone}"


async def _ring_keep(agent: Agent, msg: dpb.DriverMessage) -> str:
    """The newest verified steps: their copies stay in the ranks' rings (docs/sdc.md)."""
    if agent.flash is None:
        return "ring keep: no flash store"
    kept = await asyncio.to_thread(agent.flash.keep, list(msg.ring_keep.steps))
    return f"ring keep: {kept}"


def _sup(agent: Agent) -> Supervisor:
    assert agent.supervisor is not None  # (`Handler.workers`)
    return agent.supervisor


async def _restore_point(agent: Agent, msg: dpb.DriverMessage) -> str:
    """For the next start (engineer "drill"; trainer/run.py). Set before any await: the
    driver sends the StartWorkers right behind it without waiting for this reply, and the
    start's task reads the launch as soon as it runs."""
    sup, rp = _sup(agent), msg.restore_point
    point = WorkerEnv(
        restore_step=rp.step or None,
        skip_batches=(rp.skip_from_step, rp.skip_batches) if rp.skip_batches else None,
    )
    cleared: dict[str, str | None] = dict.fromkeys(workerenv.RESTORE_VARIABLES)
    sup.launch = sup.launch.with_env(**{**cleared, **point.to_env()})
    return f"restore point: step {rp.step or 'newest'}, skip {rp.skip_batches}"


async def _start_workers(agent: Agent, msg: dpb.DriverMessage) -> str:
    sup, p, flash = _sup(agent), msg.start_workers, agent.flash
    cmd = sup.spec.split(p.worker_cmd) if p.worker_cmd else None
    if cmd is not None and cmd != sup.spec.cmd and not agent.config.allow_remote_cmd:
        raise ValueError(
            "start_workers: the driver sent a worker command other than this "
            "agent's --worker-cmd; refused (start the agent with "
            "--allow-remote-cmd to run the driver's)"
        )
    launch = sup.launch.started(p, cmd=cmd, pin_master=agent.config.pin_master_addr)
    if flash is not None and p.buddy:
        # the world's ring, as the driver paired it: who this node sends to, and
        # whose copies its replica server takes
        keys = {p.buddy_node: p.buddy_pubkey, p.replicas_from: p.replicas_from_pubkey}
        flash.set_buddy(p.buddy, p.buddy_node, p.replicas_from, keys)
    fetch = None
    if flash is not None and p.replaces:
        # the replaced node's newest copies, from the replica server that holds them
        # (the driver knows it from the node's registration; else this node's buddy);
        # the workers start meanwhile and look for them there once they are in
        fetch = flash.begin_take_over(
            p.replaces, agent.config.node_id, p.replaces_from, p.replaces_pubkey
        )
        if fetch is not None:
            launch = launch.with_env(**WorkerEnv(flash_node=p.replaces).to_env())
    if flash is not None:
        flash.world_size = launch.world_size
        flash.set_ranks(launch.ranks(sup.spec.nproc))
        if p.flash_bytes_per_rank:
            mine = launch.ranks(sup.spec.nproc)
            await asyncio.to_thread(flash.prepare, mine, p.flash_bytes_per_rank)
    sup.launch = launch
    sup.start_id = ""
    if p.in_job:  # held workers rejoin in their processes; only the rest start
        done = await injob.rejoin(sup, agent.hooks)
    else:
        await sup.stop_all(grace_s=2.0)
        await sup.start_all()
        done = f"started {len(sup.workers)} workers"
    sup.start_id = p.start_id  # heartbeats say which start runs (a new leader adopts it)
    if fetch is not None:
        took = await fetch
        done += f"; {p.replaces}'s copies {'fetched' if took else 'not fetched'}"
    return done


async def _stop_workers(agent: Agent, msg: dpb.DriverMessage) -> str:
    sup, p = _sup(agent), msg.stop_workers
    sup.start_id = ""
    if p.in_job:
        return await injob.hold(sup, agent.hooks, p.replace_local_ranks)
    return _dumps_text(await sup.stop_all(grace_s=p.grace_s or 5.0, dump=p.dump_stacks))


async def _restart_workers(agent: Agent, msg: dpb.DriverMessage) -> str:
    sup = _sup(agent)
    ranks = list(msg.restart_workers.local_ranks) or list(sup.workers)
    sup.start_id = ""  # restarted ranks are no longer the start's
    dumps = {}
    for r in ranks:
        if r not in sup.workers:
            raise ValueError(f"no local rank {r} on this node")
        dumps[r] = await sup.stop(sup.workers[r], 2.0, dump=msg.restart_workers.dump_stacks)
        await sup.start(r)
    return _dumps_text(dumps)


def _dumps_text(dumps: dict[int, str]) -> str:
    return "\n".join(f"--- local rank {r} ---\n{d}" for r, d in dumps.items() if d)


# ------------------------------------------------------------ forwarded to the workers
def _forward(
    order: Callable[[dpb.DriverMessage], hpb.WorkerCommand],
) -> Callable[[Agent, dpb.DriverMessage], Awaitable[str]]:
    """A handler that sends the workers a command over the hooks channel."""

    async def run(agent: Agent, msg: dpb.DriverMessage) -> str:
        assert agent.hooks is not None  # (an agent with workers has the hooks channel)
        n = agent.hooks.send(order(msg))
        return f"{msg.WhichOneof('kind')} forwarded to {n} workers"

    return run


COMMANDS: dict[str, Handler] = {
    "run_self_check": Handler(_run_self_check, Reply.SELF_CHECK),
    "run_check": Handler(_run_check, Reply.CHECK),
    "inject_fault": Handler(_inject_fault, then=_die_if_node_loss),
    "shutdown": Handler(_stop_node, ends_session=True),
    "evict": Handler(_stop_node, ends_session=True),
    "retention": Handler(_retention),
    "ring_keep": Handler(_ring_keep),
    "restore_point": Handler(_restore_point, workers=True),
    "start_workers": Handler(_start_workers, workers=True),
    "stop_workers": Handler(_stop_workers, workers=True, ring_heartbeat=True),
    "restart_workers": Handler(_restart_workers, workers=True),
    "pause": Handler(
        _forward(
            lambda m: hpb.WorkerCommand(command_id=m.command_id, pause=m.pause.reason or "paused")
        ),
        workers=True,
    ),
    "resume": Handler(
        _forward(lambda m: hpb.WorkerCommand(command_id=m.command_id, resume=m.resume.at_step)),
        workers=True,
    ),
    "flash_save": Handler(
        _forward(
            lambda m: hpb.WorkerCommand(command_id=m.command_id, flash_save=m.flash_save.step)
        ),
        workers=True,
    ),
}
