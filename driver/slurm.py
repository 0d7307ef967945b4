"""The Slurm scheduler: drains, resumes, spares and agent steps through Slurm's own commands.

`SlurmScheduler` implements `unbroken.driver.scheduler.Scheduler` by running `scontrol`,
`srun` and `salloc` as subprocesses, each with a deadline (`SlurmConfig.timeout_s`) and a
`SchedulerError` that quotes what Slurm said when it refuses.

Why subprocesses and not pyslurm: pyslurm is a Cython binding that must be built against
the exact libslurm of the cluster (its version tracks Slurm's: 22.05 needs pyslurm 22.5.x,
23.02 needs 23.2.x) and is not packaged for Debian; every Slurm site already has the client
commands, whose text interface is stable across versions, and what the driver does is a
handful of calls per incident (a drain is ~10 ms of scontrol), far from any rate where a
library would matter. The subprocess also keeps a wedged slurmctld from blocking the
driver's event loop: the call is awaited with a deadline and the child is killed.

Measured on one host with one slurmd per node (shared/slurm/README.md): `scontrol update
State=DRAIN` takes effect at once and new allocations avoid the node; a spare's agent
started with `srun --jobid=J -N1 -n1 -w <node>` runs ~1.8 s later.

Replacements, in the order tried (`request_replacement`):
1. a node of the job's own allocation (`SlurmConfig.job_id`) that is not excluded (not in
   the world, not a spare already used) and healthy: its agent starts as a job step;
2. with `SlurmConfig.allow_new_allocation`, a new one-node allocation
   (`salloc --no-shell -N1 --exclude=...`; drained and down nodes are never chosen), and
   the agent as a step of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from unbroken.driver.scheduler import REASON_PREFIX, NodeHealth, NodeInfo, SchedulerError

log = structlog.get_logger(__name__)


@dataclass(kw_only=True, slots=True)
class SlurmConfig:
    """How the driver reaches Slurm and what it may ask of it."""

    job_id: str = ""  # the job's allocation (SLURM_JOB_ID of the sbatch job); "" = none
    slurm_conf: str = ""  # SLURM_CONF for every command ("" = Slurm's default)
    bin_dir: str = ""  # where scontrol/srun/salloc live ("" = PATH)
    timeout_s: float = 20.0  # every command's deadline
    # The agent of a replacement node, started as a job step; {node} is the Slurm node name.
    agent_cmd: str = ""
    allow_new_allocation: bool = False  # else only spares inside the job's allocation
    partition: str = ""
    step_log_dir: str = ""  # where a step's output goes ("" = /dev/null)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"SlurmConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.agent_cmd and "{node}" not in self.agent_cmd:
            raise ValueError(
                "SlurmConfig.agent_cmd must contain {node} (the Slurm node name becomes "
                f"the agent's --node-id), got {self.agent_cmd!r}"
            )


# Slurm's base states and flags (scontrol's State=IDLE+DRAIN, sinfo's idle*, ...)
def health_of(state: str) -> NodeHealth:
    """Our coarse health of a Slurm node state string such as `IDLE+DRAIN` or `DOWN*`."""
    parts = set(state.upper().rstrip("*~#!%$@^-").replace("*", "").split("+"))
    base = state.upper().split("+")[0].rstrip("*~#!%$@^-")
    if "FUTURE" in parts or base == "FUTURE":
        return NodeHealth.FUTURE
    if base == "DOWN":  # NOT_RESPONDING alone is not down: a resumed node is idle* for ~1 s
        return NodeHealth.DOWN
    if "DRAIN" in parts or base in ("DRAINED", "DRAINING"):
        busy = base in ("ALLOCATED", "MIXED", "COMPLETING", "DRAINING")
        return NodeHealth.DRAINING if busy else NodeHealth.DRAINED
    if base in ("ALLOCATED", "MIXED", "COMPLETING"):
        return NodeHealth.ALLOCATED
    if base == "IDLE":
        return NodeHealth.IDLE
    return NodeHealth.UNKNOWN


_FIELD = re.compile(r"(\w+)=")


def parse_show_node(text: str) -> list[NodeInfo]:
    """`scontrol show node -o` (one node per line) -> NodeInfo, by field name."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("NodeName="):
            continue
        fields = _fields(line)
        state = fields.get("State", "")
        reason = re.sub(r"\s*\[[^\]]*\]$", "", fields.get("Reason", "")).strip()
        out.append(NodeInfo(fields["NodeName"], health_of(state), reason, state))
    return out


def _fields(line: str) -> dict[str, str]:
    """Key=value pairs of a one-line scontrol record; a value may hold spaces (Reason=)."""
    keys = [(m.start(), m.group(1)) for m in _FIELD.finditer(line)]
    # a key starts a field only at the line start or after a space
    keys = [(i, k) for i, k in keys if i == 0 or line[i - 1] == " "]
    out: dict[str, str] = {}
    for j, (i, k) in enumerate(keys):
        end = keys[j + 1][0] if j + 1 < len(keys) else len(line)
        out[k] = line[i + len(k) + 1 : end].strip()
    return out


@dataclass(slots=True)
class SlurmScheduler:
    """`Scheduler` on Slurm (see the module docstring)."""

    config: SlurmConfig
    name: str = "slurm"
    steps: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # node -> srun

    # ------------------------------------------------------------ commands
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.slurm_conf:
            env["SLURM_CONF"] = self.config.slurm_conf
        return env

    def _bin(self, name: str) -> str:
        return os.path.join(self.config.bin_dir, name) if self.config.bin_dir else name

    async def run(self, *argv: str) -> str:
        """Run a Slurm command with the deadline; its stdout, or SchedulerError."""
        cmd = [self._bin(argv[0]), *argv[1:]]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env(),
            )
        except FileNotFoundError as e:
            raise SchedulerError(
                f"{argv[0]} not found ({e}); install the Slurm client (slurm-client) or set "
                "the Slurm bin dir"
            ) from e
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.config.timeout_s)
        except TimeoutError as e:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise SchedulerError(
                f"{shlex.join(argv)}: no answer from Slurm within {self.config.timeout_s} s "
                "(is slurmctld up? `scontrol ping`)"
            ) from e
        if proc.returncode != 0:
            said = (err or out).decode(errors="replace").strip().replace("\n", "; ")
            raise SchedulerError(f"{shlex.join(argv)} failed ({proc.returncode}): {said}")
        return out.decode(errors="replace")

    # ------------------------------------------------------------ the interface
    async def drain(self, node_id: str, reason: str) -> str:
        await self.run(
            "scontrol", "update", f"NodeName={node_id}", "State=DRAIN", f"Reason={reason}"
        )
        info = await self.node(node_id)
        return f"{node_id} {info.raw_state}: {info.reason}"

    async def resume(self, node_id: str, *, force: bool = False) -> str:
        """Return a drained or down node to service; refuse a drain unbroken did not make
        unless `force` (someone else drained it for their own reason)."""
        info = await self.node(node_id)
        if not info.health.faulty:
            raise SchedulerError(f"{node_id} is {info.raw_state}, not drained or down")
        if not force and info.reason and not info.reason.startswith(REASON_PREFIX):
            raise SchedulerError(
                f"{node_id} was drained by someone else ({info.reason!r}); resume it with "
                "--force if it is fixed"
            )
        await self.run("scontrol", "update", f"NodeName={node_id}", "State=RESUME")
        info = await self.node(node_id)
        return f"{node_id} {info.raw_state}"

    async def request_replacement(self, n: int, exclude: Iterable[str]) -> list[str]:
        skip = set(exclude) | set(self.steps)
        out: list[str] = []
        if self.config.job_id:
            alloc = await self.job_nodes(self.config.job_id)
            health = {i.node_id: i.health for i in await self.nodes()}
            for node in alloc:
                if len(out) >= n:
                    break
                if node not in skip and not health.get(node, NodeHealth.UNKNOWN).faulty:
                    self.start_step(self.config.job_id, node)
                    out.append(node)
        while len(out) < n and self.config.allow_new_allocation:
            job = await self.allocate(1, exclude=skip | set(out))
            if job is None:
                break
            node = (await self.job_nodes(job))[0]
            self.start_step(job, node)
            out.append(node)
        return out

    async def release(self, node_id: str) -> str:
        """Take `node_id` out of the job's allocation (the job shrinks and goes on)."""
        step = self.steps.pop(node_id, None)
        if step is not None and step.poll() is None:
            step.terminate()
        if not self.config.job_id:
            return f"{node_id}: no job allocation to leave"
        alloc = await self.job_nodes(self.config.job_id)
        if node_id not in alloc:
            return f"{node_id} is not in job {self.config.job_id}"
        rest = [x for x in alloc if x != node_id]
        await self.run(
            "scontrol", "update", f"JobId={self.config.job_id}", f"NodeList={','.join(rest)}"
        )
        return f"job {self.config.job_id} now on {','.join(rest)}"

    async def nodes(self) -> list[NodeInfo]:
        return parse_show_node(await self.run("scontrol", "show", "node", "-o", "--future"))

    # ------------------------------------------------------------ helpers
    async def node(self, node_id: str) -> NodeInfo:
        """One node's info (SchedulerError when Slurm does not know it)."""
        found = parse_show_node(await self.run("scontrol", "show", "node", "-o", node_id))
        if not found:
            raise SchedulerError(f"Slurm does not know node {node_id!r}")
        return found[0]

    async def job_nodes(self, job_id: str) -> list[str]:
        """The nodes of a job's allocation, expanded (`n[1-3]` -> n1 n2 n3)."""
        text = await self.run("squeue", "-h", "-j", job_id, "-o", "%N")
        hostlist = text.strip()
        if not hostlist:
            return []
        return (await self.run("scontrol", "show", "hostnames", hostlist)).split()

    async def allocate(self, n: int, *, exclude: Iterable[str] = ()) -> str | None:
        """A new n-node allocation outside `exclude` (None when none is free now)."""
        argv = ["salloc", "--no-shell", f"-N{n}", "--immediate=5", "-J", "unbroken-spare"]
        if self.config.partition:
            argv.append(f"--partition={self.config.partition}")
        ex = sorted(exclude)
        if ex:
            argv.append(f"--exclude={','.join(ex)}")
        try:
            out = await self.run(*argv)
        except SchedulerError as e:
            if "Unable to allocate" in str(e) or "Requested node configuration" in str(e):
                return None
            raise
        # salloc prints "salloc: Granted job allocation 12" on stderr; stdout may be empty
        m = re.search(r"allocation (\d+)", out)
        if m is None:
            jobs = await self.run("squeue", "-h", "-n", "unbroken-spare", "-o", "%i", "-S", "-V")
            return jobs.split()[0] if jobs.split() else None
        return m.group(1)

    def start_step(self, job_id: str, node: str, argv: Sequence[str] | None = None) -> None:
        """Start the node's agent (or `argv`) as a one-node step of `job_id`; not awaited.

        One step per node: a multi-node step is killed whole when one of its nodes fails.
        """
        cmd = (
            list(argv) if argv is not None else shlex.split(self.config.agent_cmd.format(node=node))
        )
        if not cmd:
            raise SchedulerError("no agent command to start on a replacement (--slurm-agent-cmd)")
        srun = [self._bin("srun"), f"--jobid={job_id}", "-N1", "-n1", f"-w{node}",
                "--overlap", f"--job-name=unbroken-agent-{node}", *cmd]  # fmt: skip
        out = (
            open(os.path.join(self.config.step_log_dir, f"step-{node}.log"), "ab")
            if self.config.step_log_dir
            else subprocess.DEVNULL
        )
        try:
            self.steps[node] = subprocess.Popen(
                srun,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except FileNotFoundError as e:
            raise SchedulerError(f"srun not found ({e})") from e
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        log.info("agent step started", job=job_id, node=node, cmd=shlex.join(cmd))

    def stop_steps(self) -> None:
        """Stop the steps this scheduler started (srun forwards the signal to the task)."""
        for p in self.steps.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        for p in self.steps.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        self.steps.clear()


def add_slurm_flags(parser: argparse.ArgumentParser) -> None:
    """`unbroken driver`'s scheduler flags."""
    g = parser.add_argument_group("the cluster scheduler (README: Running under Slurm)")
    g.add_argument(
        "--scheduler",
        choices=("none", "slurm"),
        default="none",
        help="slurm: drain evicted nodes, start replacements' agents as job steps, treat "
        "DOWN/DRAIN as faults (default none)",
    )
    g.add_argument(
        "--slurm-job-id",
        default=os.environ.get("SLURM_JOB_ID", ""),
        help="the job's allocation (default $SLURM_JOB_ID): spares are taken from it",
    )
    g.add_argument("--slurm-conf", default="", help="SLURM_CONF for Slurm's commands")
    g.add_argument(
        "--slurm-agent-cmd",
        default="",
        help="a replacement's agent command, run with srun on the node; {node} is its name",
    )
    g.add_argument(
        "--slurm-new-allocations",
        action="store_true",
        help="when the job's allocation has no spare, take a node in a new allocation",
    )
    g.add_argument(
        "--slurm-timeout-s", type=float, default=20.0, help="deadline of every Slurm command"
    )
    g.add_argument(
        "--scheduler-spares",
        type=int,
        default=0,
        help="spares to keep registered: the driver starts their agents through the "
        "scheduler (--slurm-agent-cmd) and refills the pool after each replacement",
    )
    g.add_argument(
        "--scheduler-poll-s",
        type=float,
        default=2.0,
        help="how often the scheduler's node states are read (0: never)",
    )


def slurm_config(ns: argparse.Namespace) -> SlurmConfig:
    """A `SlurmConfig` from parsed flags."""
    return SlurmConfig(
        job_id=ns.slurm_job_id,
        slurm_conf=ns.slurm_conf,
        agent_cmd=ns.slurm_agent_cmd,
        allow_new_allocation=ns.slurm_new_allocations,
        timeout_s=ns.slurm_timeout_s,
    )
