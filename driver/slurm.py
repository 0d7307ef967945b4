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

Replacements (`request_replacement`) come from the sources of `SlurmConfig.spares`, in the
order given (`--slurm-spares job,held,expand,new`; default `job`):
- `job`: a node of the job's own allocation (`SlurmConfig.job_id`) that is not excluded
  (not in the world, not a spare already used) and healthy: its agent starts as a step;
- `held`: a node an administrator holds back as `State=DRAIN Reason="spare ..."` is
  resumed, added to the job's allocation (as `expand`; without a job, a new allocation on
  it), and its agent started there;
- `expand`: the job's allocation grows by one free node (`salloc --no-shell -N1
  --dependency=expand:J`, then `NumNodes=0` on the new allocation hands its node to J;
  Slurm needs `SchedulerParameters=permit_job_expansion`), the agent a step of J;
- `new`: a new one-node allocation (`salloc --no-shell -N1 --exclude=...`), the agent a
  step of it.
Drained and down nodes are never chosen. A FUTURE node (configured, not booted) or a
powered-down one (Slurm's power saving) is not started by the driver: once its slurmd
registers (or Slurm's ResumeProgram boots it), it is a free node for `expand` and `new`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from unbroken.common import aio
from unbroken.driver.scheduler import REASON_PREFIX, NodeHealth, NodeInfo, SchedulerError

log = structlog.get_logger(__name__)


SPARE_SOURCES = ("job", "held", "expand", "new")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmConfig:
    """How the driver reaches Slurm and what it may ask of it."""

    job_id: str = field(
        default="",
        metadata={
            "env": "SLURM_JOB_ID",
            "help": "the job's allocation (the sbatch job's SLURM_JOB_ID): spares are taken "
            "from it",
        },
    )
    slurm_conf: str = field(
        default="", metadata={"flag": "--slurm-conf", "help": "SLURM_CONF for Slurm's commands"}
    )
    bin_dir: str = field(
        default="", metadata={"help": "where scontrol/srun/salloc live (empty: PATH)"}
    )
    timeout_s: float = field(default=20.0, metadata={"help": "deadline of every Slurm command"})
    # The agent of a replacement node, started as a job step; {node} is the Slurm node name.
    agent_cmd: str = field(
        default="",
        metadata={
            "help": "a replacement's agent command, run with srun on the node; {node} is its name"
        },
    )
    allow_new_allocation: bool = field(
        default=False,
        metadata={
            "flag": "--slurm-new-allocations",
            "help": "same as adding 'new' to --slurm-spares",
        },
    )
    # Where a replacement comes from, tried in this order (module docstring): "job" (a
    # spare inside the job's allocation), "held" (a node drained with `held_reason`),
    # "expand" (the job's allocation grows by a free node), "new" (a new allocation).
    spares: tuple[str, ...] = field(
        default=("job",),
        metadata={
            "help": "where replacements come from, tried in order, comma-separated: job (a "
            "spare node of the job's allocation), held (a node drained with reason "
            "--slurm-held-reason), expand (grow the job's allocation), new (a new allocation)"
        },
    )
    held_reason: str = field(
        default="spare", metadata={"help": "a node drained with this first word is a held spare"}
    )
    partition: str = field(default="", metadata={"help": "partition of new allocations"})
    step_log_dir: str = field(
        default="", metadata={"help": "where a step's output goes (empty: /dev/null)"}
    )

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"SlurmConfig.timeout_s must be > 0, got {self.timeout_s}")
        bad = [x for x in self.spares if x not in SPARE_SOURCES]
        if bad or not self.spares:
            raise ValueError(
                f"spare sources must be some of {', '.join(SPARE_SOURCES)}, got "
                f"{','.join(self.spares)!r}"
            )
        if self.agent_cmd and "{node}" not in self.agent_cmd:
            raise ValueError(
                "SlurmConfig.agent_cmd must contain {node} (the Slurm node name becomes "
                f"the agent's --node-id), got {self.agent_cmd!r}"
            )

    def sources(self) -> tuple[str, ...]:
        """The spare sources in order (`allow_new_allocation` adds "new" last)."""
        if self.allow_new_allocation and "new" not in self.spares:
            return (*self.spares, "new")
        return self.spares


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


SLURM_NODE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def one_node(name: str) -> str:
    """`name`, when it names one Slurm node; else a SchedulerError.

    scontrol reads `NodeName=` as a hostlist: `n[1-64]` or `a,b` would drain nodes outside
    the job, and `n[1-99999999]` would have slurmctld expand a huge list. Node ids are
    checked where they enter the driver; this is the last check before Slurm sees one.
    """
    if not SLURM_NODE_NAME.fullmatch(name):
        raise SchedulerError(
            f"{name[:60]!r} is not one Slurm node name (letters, digits, . _ - only; "
            "a hostlist such as n[1-4] or a,b is refused)"
        )
    return name


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
        return (await self.run2(*argv))[0]

    async def run2(self, *argv: str) -> tuple[str, str]:
        """Run a Slurm command with the deadline; (stdout, stderr), or SchedulerError."""
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
            out, err = await aio.communicate(proc, None, self.config.timeout_s)
        except TimeoutError as e:  # (killed and reaped)
            raise SchedulerError(
                f"{shlex.join(argv)}: no answer from Slurm within {self.config.timeout_s} s "
                "(is slurmctld up? `scontrol ping`)"
            ) from e
        if proc.returncode != 0:
            said = (err or out).decode(errors="replace").strip().replace("\n", "; ")
            raise SchedulerError(f"{shlex.join(argv)} failed ({proc.returncode}): {said}")
        return out.decode(errors="replace"), err.decode(errors="replace")

    # ------------------------------------------------------------ the interface
    async def drain(self, node_id: str, reason: str) -> str:
        one_node(node_id)
        await self.run(
            "scontrol", "update", f"NodeName={node_id}", "State=DRAIN", f"Reason={reason}"
        )
        info = await self.node(node_id)
        return f"{node_id} {info.raw_state}: {info.reason}"

    async def resume(self, node_id: str, *, force: bool = False) -> str:
        """Return a drained or down node to service; refuse a drain unbroken did not make
        unless `force` (someone else drained it for their own reason)."""
        one_node(node_id)
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
        """Up to `n` nodes, from the sources of `SlurmConfig.spares` in order (see the
        module docstring), each with its agent started as a one-node job step."""
        skip = set(exclude) | set(self.steps)
        out: list[str] = []
        for source in self.config.sources():
            while len(out) < n:
                node = await self._take(source, skip | set(out))
                if node is None:
                    break
                out.append(node)
        return out

    async def _take(self, source: str, skip: set[str]) -> str | None:
        """One node from `source` with its agent started, or None when it has none."""
        job = self.config.job_id
        if source == "job":
            if not job:
                return None
            health = {i.node_id: i.health for i in await self.nodes()}
            for node in await self.job_nodes(job):
                if node not in skip and not health.get(node, NodeHealth.UNKNOWN).faulty:
                    self.start_step(job, node)
                    return node
            return None
        if source == "held":
            held = [
                i.node_id
                for i in await self.nodes()
                if i.health is NodeHealth.DRAINED
                and i.node_id not in skip
                and i.reason.split(" ", 1)[0] == self.config.held_reason
            ]
            if not held:
                return None
            node = held[0]
            await self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
            log.info("held spare resumed", node=node)
            await self._until_responding(node)
            if job:
                return await self._expand(job, skip, node)
            new = await self.allocate(1, nodelist=node)
            if new is None:
                raise SchedulerError(f"held spare {node} was resumed but not allocatable")
            self.start_step(new, node)
            return node
        if source == "expand":
            return await self._expand(job, skip) if job else None
        if source == "new":
            new = await self.allocate(1, exclude=skip)
            if new is None:
                return None
            node = (await self.job_nodes(new))[0]
            self.start_step(new, node)
            return node
        raise SchedulerError(f"unknown spare source {source!r}; use job, held, expand or new")

    async def _until_responding(self, node: str) -> None:
        """Wait (up to the command deadline) until a just resumed node answers Slurm's ping:
        it is `IDLE+NOT_RESPONDING` for 1-2 s and no allocation takes it until then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_s
        while True:
            info = await self.node(node)
            if info.health is NodeHealth.IDLE and "NOT_RESPONDING" not in info.raw_state:
                return
            if loop.time() > deadline:
                raise SchedulerError(
                    f"{node} was resumed but is {info.raw_state} after {self.config.timeout_s} s"
                    " (is its slurmd up?)"
                )
            await asyncio.sleep(0.1)

    async def _expand(self, job: str, skip: set[str], node: str = "") -> str | None:
        """Grow `job` by one node (`node`, or any free one outside `skip`) and start the
        agent on it: `salloc --dependency=expand:JOB`, the new allocation's node handed to
        the job (`NumNodes=0` on it), the empty allocation cancelled.
        Needs `SchedulerParameters=permit_job_expansion`."""
        new = await self.allocate(
            1,
            exclude=() if node else skip,
            nodelist=node,
            extra=(f"--dependency=expand:{job}",),
        )
        if new is None:
            return None
        got = (await self.job_nodes(new))[0]
        try:  # the node moves to `job` (Slurm 22.05 needs no `NumNodes=ALL` on it)
            await self.run("scontrol", "update", f"JobId={new}", "NumNodes=0")
        finally:
            with contextlib.suppress(SchedulerError):
                await self.run("scancel", new)
        if got not in await self.job_nodes(job):
            raise SchedulerError(
                f"expanding job {job} with {got} failed (is permit_job_expansion in Slurm's "
                "SchedulerParameters?)"
            )
        self.start_step(job, got)
        return got

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
        found = parse_show_node(await self.run("scontrol", "show", "node", "-o", one_node(node_id)))
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

    async def allocate(
        self,
        n: int,
        *,
        exclude: Iterable[str] = (),
        nodelist: str = "",
        extra: Sequence[str] = (),
    ) -> str | None:
        """A new n-node allocation outside `exclude` (or on `nodelist`); its job id, or
        None when no node is free now."""
        argv = ["salloc", "--no-shell", f"-N{n}", "--immediate=5", "-J", "unbroken-spare"]
        if self.config.partition:
            argv.append(f"--partition={self.config.partition}")
        ex = sorted(exclude)
        if ex:
            argv.append(f"--exclude={','.join(ex)}")
        if nodelist:
            argv.append(f"--nodelist={nodelist}")
        argv.extend(extra)
        try:
            out, err = await self.run2(*argv)
        except SchedulerError as e:
            said = str(e)
            if any(
                w in said
                for w in ("Unable to allocate", "Requested node configuration", "not available")
            ):
                return None
            raise
        # salloc prints "salloc: Granted job allocation 12" on stderr
        m = re.search(r"allocation (\d+)", out + err)
        if m is None:
            raise SchedulerError(f"salloc gave no job id: {(out + err).strip()[:300]}")
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
