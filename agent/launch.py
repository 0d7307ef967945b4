"""What the node's workers run and how each start of them is launched.

`WorkerSpec` is the agent's configuration of its workers (the `--worker-cmd` flags) and never
changes; `WorkerLaunch` is one start of them, built per StartWorkers from the previous one,
and the only place the torchrun-like environment of a rank (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, ..., the agent's part of common/workerenv.py `WorkerEnv`) is decided. A worker
inherits the agent's environment without the node's secrets (`NODE_SECRETS`), and runs
behind `exec_wrapper`: `setpriv --pdeathsig KILL` and `nice`, which exec, so the worker keeps
the pid the agent spawned (agent/workers.py says why).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from unbroken.agent import hang as hanglib
from unbroken.agent import warm as warmlib
from unbroken.common.workerenv import WorkerEnv
from unbroken.proto import driver_pb2 as dpb

log = structlog.get_logger(__name__)

DEFAULT_KEYWORDS = (
    "NCCL WARN",
    "CUDA error",
    "Xid",
    "ECC",
    "Traceback",
    "RuntimeError",
    "out of memory",
)


#: Cores per local worker from which warm standbys are on by default (`--warm-workers`).
WARM_CORES_PER_WORKER = 4


def warm_default(nproc: int, cpus: int | None = None) -> bool:
    """Warm standbys by default when the node has spare cores for their imports: at least
    `WARM_CORES_PER_WORKER` per local worker (a GPU node: 8 workers, 64+ cores)."""
    n = (os.cpu_count() or 0) if cpus is None else cpus
    return n >= WARM_CORES_PER_WORKER * max(1, nproc)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec:
    """What to run and the torchrun-like world it runs in."""

    cmd: list[str] = field(
        metadata={
            "flag": "--worker-cmd",
            "parse": shlex.split,
            "help": "command run once per local rank",
        }
    )
    nproc: int = field(default=1, metadata={"flag": "--nproc-per-node", "help": "local workers"})
    node_rank: int = field(default=0, metadata={"help": "this node's place in the world"})
    nnodes: int = field(default=1, metadata={"help": "nodes in the world"})
    master_addr: str = field(
        default="127.0.0.1",
        metadata={
            "unset": True,
            "help": "rendezvous host of the workers; given, it wins over the driver's "
            "(unset: the driver's choice, else loopback)",
        },
    )
    master_port: int = field(default=29500, metadata={"help": "rendezvous port of the workers"})
    log_dir: str = field(
        default=".", metadata={"unset": True, "help": "worker logs (unset: a temp dir)"}
    )
    keywords: tuple[str, ...] = field(
        default=DEFAULT_KEYWORDS,
        metadata={"help": "comma-separated log keywords that raise an alert"},
    )
    max_line_chars: int = field(
        default=2048, metadata={"help": "a worker log line is cut after this many characters"}
    )
    fault: str = field(default="", metadata={"flag": None, "why": "--inject-fault"})
    extra_env: dict[str, str] = field(
        default_factory=dict,
        metadata={"flag": None, "why": "the embedder's; the agent adds its own per launch"},
    )
    nice: int = field(
        default=5,
        metadata={
            "flag": "--worker-nice",
            "help": "niceness added for workers and checks, so heartbeats keep the CPU "
            "(0: same priority)",
        },
    )
    die_with_agent: bool = field(
        default=True, metadata={"flag": None, "why": "always on outside tests (pdeathsig)"}
    )
    warm: bool = field(
        default=False,
        metadata={
            "flag": "--warm-workers",
            "unset": True,
            "group": "warm standby workers (agent/warm.py)",
            "help": "hand worker starts to warm standbys that already imported torch (a "
            "Python worker command only). Unset: on when the node has spare cores (at least "
            f"{WARM_CORES_PER_WORKER} per local worker), as GPU nodes do; off on smaller "
            "hosts, where the standbys' imports compete with training "
            "(bench/results/recovery.json)",
        },
    )
    warm_preload: tuple[str, ...] = field(
        default=warmlib.DEFAULT_PRELOAD,
        metadata={
            "group": "warm standby workers (agent/warm.py)",
            "help": "comma-separated modules a standby imports while it waits",
        },
    )
    warm_nice: int = field(
        default=5,
        metadata={
            "group": "warm standby workers (agent/warm.py)",
            "help": "niceness added while a standby waits; it takes the workers' at hand-off "
            "(the workers' by default; 19 leaves the imports only idle CPU, which on a "
            "saturated host kept standbys from getting ready in time)",
        },
    )
    warm_refill_after_s: float = field(
        default=30.0,
        metadata={
            "group": "warm standby workers (agent/warm.py)",
            "help": "new standbys start once restarted workers step, or after this long",
        },
    )
    warm_after_s: float = field(
        default=0.0,
        metadata={
            "group": "warm standby workers (agent/warm.py)",
            "help": "an agent still waiting for its workers (a spare, or before StartWorkers) "
            "starts its standbys after this long (0: at once). On a host where their imports "
            "compete with the job's first step (several nodes on a few cores), e.g. 30",
        },
    )
    hang: hanglib.HangConfig = field(
        default_factory=hanglib.HangConfig,
        metadata={"prefix": "hang-", "group": "hang detection (agent/hang.py)"},
    )

    def __post_init__(self) -> None:
        if not self.cmd:
            raise ValueError("worker cmd is empty; pass --worker-cmd 'python train.py ...'")
        if not 1 <= self.nproc <= 1024:
            raise ValueError(f"nproc must be in [1, 1024], got {self.nproc}")
        if self.nnodes < 1 or not 0 <= self.node_rank < max(self.nnodes, 1):
            raise ValueError(f"node_rank {self.node_rank} must be in [0, nnodes={self.nnodes})")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.max_line_chars < 80:
            raise ValueError(f"max_line_chars must be >= 80, got {self.max_line_chars}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be in [0, 19] (--worker-nice), got {self.nice}")
        if not 0 <= self.warm_nice <= 19:
            raise ValueError(f"warm_nice must be in [0, 19] (--warm-nice), got {self.warm_nice}")
        if not 0 <= self.warm_after_s <= 3600:
            raise ValueError(
                f"warm_after_s must be in [0, 3600] (--warm-after-s), got {self.warm_after_s}"
            )
        if not 0 <= self.warm_refill_after_s <= 3600:
            raise ValueError(
                f"warm_refill_after_s must be in [0, 3600] (--warm-refill-after-s), "
                f"got {self.warm_refill_after_s}"
            )

    @staticmethod
    def split(cmd: str) -> list[str]:
        return shlex.split(cmd)


# The agent's own credentials: its driver token, the job's replica and rendezvous keys
# (and the files that hold them). Workers run the user's code and never need them; a
# worker (or anything it runs) that read them could act as this node.
NODE_SECRETS = frozenset(
    {
        "UNBROKEN_TOKEN",
        "UNBROKEN_TOKEN_FILE",
        "UNBROKEN_REPLICA_KEY",
        "UNBROKEN_REPLICA_KEY_FILE",
        "UNBROKEN_RDZV_KEY",
        "UNBROKEN_RDZV_KEY_FILE",
    }
)


def worker_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment as a worker inherits it: everything but `NODE_SECRETS`."""
    return {k: v for k, v in environ.items() if k not in NODE_SECRETS}


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerLaunch:
    """One start of the node's workers: what runs, in which world, with which environment.

    The agent's `WorkerSpec` is its config and never changes. The first launch comes from it;
    each StartWorkers (and each fault or restore point the driver sends for the next start)
    builds the next launch from the current one (`started`, `replace`, `with_env`). The RANK
    of local rank 0 is decided here and nowhere else.
    """

    cmd: tuple[str, ...]
    world_size: int
    rank_base: int  # RANK of local rank 0
    master_addr: str
    master_port: int
    fault: str = ""  # UNBROKEN_FAULT of the workers (and the agent's checks)
    env: dict[str, str] = field(default_factory=dict)  # beyond the agent's own environment

    @classmethod
    def of(cls, spec: WorkerSpec) -> WorkerLaunch:
        """The first launch: the spec's command, torchrun's world (nnodes x nproc)."""
        return cls(
            cmd=tuple(spec.cmd),
            world_size=spec.nnodes * spec.nproc,
            rank_base=spec.node_rank * spec.nproc,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            fault=spec.fault,
            env=dict(spec.extra_env),
        )

    def started(
        self, p: dpb.StartWorkers, *, cmd: Sequence[str] | None, pin_master: bool
    ) -> WorkerLaunch:
        """The launch a StartWorkers asks for: its world (when it names one), its rendezvous
        (unless the agent's --master-addr is pinned), its layout and timeline; `cmd` replaces
        the command when the caller accepted the driver's."""
        given = WorkerEnv(
            timeline=p.timeline,  # stamped on every copy
            persist_every_s=(
                p.persist_every_s
                if p.persist_every_s > 0 and math.isfinite(p.persist_every_s)
                else None
            ),
            # the driver's layout (elastic shrink/grow) wins over --dp/--pp/--tp
            dp=p.dp or None,
            pp=p.pp or None,
            tp=p.tp or None,
        )
        env = {**self.env, **given.to_env()}
        world = (p.world_size, p.global_rank_base) if p.world_size else None
        master = (p.master_addr, p.master_port) if p.master_addr and not pin_master else None
        return dataclasses.replace(
            self,
            cmd=tuple(cmd) if cmd is not None else self.cmd,
            world_size=world[0] if world else self.world_size,
            rank_base=world[1] if world else self.rank_base,
            master_addr=master[0] if master else self.master_addr,
            master_port=master[1] if master else self.master_port,
            env=env,
        )

    def with_env(self, **changes: str | None) -> WorkerLaunch:
        """This launch with variables set (a None value removes the variable)."""
        env = dict(self.env)
        for k, v in changes.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return dataclasses.replace(self, env=env)

    def node_rank(self, nproc: int) -> int:
        """This node's place in the launch's world (torchrun's GROUP_RANK): the driver's
        rank base over the ranks per node, not the agent's configured --node-rank, which
        agents started by the driver leave at 0. Lightning takes a worker's global rank
        from it (GROUP_RANK x ranks per node + LOCAL_RANK), not from RANK: with the
        configured value every node's first worker took rank 0 and bound MASTER_PORT."""
        return self.rank_base // max(nproc, 1)

    def ranks(self, nproc: int) -> range:
        """The global ranks of this node's `nproc` workers."""
        return range(self.rank_base, self.rank_base + nproc)

    def environ(self, spec: WorkerSpec, local_rank: int, socket_path: str) -> dict[str, str]:
        """The full environment of one local rank (torchrun's variables and ours), without
        the agent's own credentials (`NODE_SECRETS`)."""
        env = worker_base_env(os.environ)
        env.update(self.env)
        env.update(
            {
                "RANK": str(self.rank_base + local_rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(spec.nproc),
                "GROUP_RANK": str(self.node_rank(spec.nproc)),
                "ROLE_RANK": str(self.rank_base + local_rank),
                "ROLE_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "PYTHONUNBUFFERED": "1",
            }
        )
        ours = WorkerEnv(agent_socket=socket_path, agent_pid=os.getpid(), fault=self.fault)
        env.update(ours.to_env())
        return env


def exec_wrapper(*, nice: int, die_with_agent: bool) -> list[str]:
    """The command prefix that lowers a child's priority and ties it to the agent's life.

    `setpriv` and `nice` each exec the next program, so the child keeps its pid and its
    parent. A missing tool is skipped with a warning (the worker's own prctl in
    trainer/hooks.py still applies).
    """
    out: list[str] = []
    if die_with_agent:
        setpriv = shutil.which("setpriv")
        if setpriv:
            out += [setpriv, "--pdeathsig", "KILL", "--"]
        else:
            log.warning("setpriv not found (util-linux): workers may outlive a killed agent")
    if nice:
        nice_bin = shutil.which("nice")
        if nice_bin:
            out += [nice_bin, "-n", str(nice)]
        else:
            log.warning("nice not found (coreutils): workers run at the agent's priority")
    return out
