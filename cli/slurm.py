"""`unbroken slurm`: run a job under Slurm, list its nodes, clear a node unbroken drained.

- `unbroken slurm submit --nodes N --spares S -- <agent flags>` writes the batch script the
  recipe in shared/slurm/README.md says works and submits it with `sbatch` (`--print` shows
  it instead): an `sbatch --no-kill` job of N+S nodes; the driver runs in the batch step on
  the first node with `--scheduler slurm` and is told the job id (SLURM_JOB_ID); one
  `srun -N1 -n1 -w <node>` step per training node starts its agent with the Slurm node name
  as node id (a multi-node step would be killed whole when one node fails). The S spare
  nodes run no agent until the driver needs one: it starts it as a job step then. The driver
  runs with `--exit-when-finished`: once every worker exited 0 the job is FINISHED, the driver
  exits and the batch job ends, giving its nodes back.
- `unbroken slurm nodes` prints Slurm's view (state, reason) of every node.
- `unbroken slurm resume NODE` clears a node unbroken drained: an operator's call to the
  driver (the ClearNode RPC, role "operator"), which resumes it in Slurm (`scontrol update
  State=RESUME`) and records OperatorAction "clear" and Slurm's answer (SchedulerCall
  "resume"); a node drained by someone else needs `--force`. `--direct` runs scontrol here
  without a driver (no driver running; the next driver's watch records it as "resumed").
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys

from unbroken.cli.client import ClientConfig, add_client_flags, print_json, run_command, to_dict
from unbroken.common.channel import endpoint_is_loopback
from unbroken.driver.scheduler import SchedulerError
from unbroken.driver.slurm import SlurmConfig, SlurmScheduler
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

SCRIPT = """\
#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={total}
#SBATCH --ntasks-per-node=1
#SBATCH --no-kill
#SBATCH --output={output}
# Written by `unbroken slurm submit`. --no-kill: a failed node leaves the job, the job goes on.
set -eu
NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
TRAIN=("${{NODES[@]:0:{nodes}}}")
PORT=$({python} -c 'from unbroken.diagnostics.check import free_port; print(free_port())')
DRIVER_ADDR="{advertise}:$PORT"
# the job's folder, on the file system the nodes share: event log, archive, checkpoints, pki
JOB_DIR="{job_dir}"
mkdir -p -m 0700 "$JOB_DIR"
{pki}echo "unbroken: driver $DRIVER_ADDR, job folder $JOB_DIR"
{operator}SPARE_AGENT="{python} -m unbroken.cli agent --node-id {{node}} --driver $DRIVER_ADDR"
{python} -m unbroken.cli driver --scheduler slurm --slurm-job-id "$SLURM_JOB_ID" \\
  --listen "{listen_host}:$PORT" --advertise "$DRIVER_ADDR" --nodes {nodes} --exit-when-finished \\
  --slurm-agent-cmd "$SPARE_AGENT --no-start --spare {agent_args}" \\
  {driver_args} &
DRIVER_PID=$!
set +e
for node in "${{TRAIN[@]}}"; do
  srun --overlap -N1 -n1 -w "$node" --job-name="unbroken-agent-$node" \\
    {python} -m unbroken.cli agent --node-id "$node" --driver "$DRIVER_ADDR" --no-start \\
    {train_agent_args} &
done
wait "$DRIVER_PID"
"""

# mTLS for the job when --driver-args bring no credentials of their own: a CA of the job's own
# in its folder (0700), a certificate for the driver's advertised host, one per node of the
# allocation (spares included) and one for the user who submitted it (an operator)
PKI = """\
PKI="$JOB_DIR/pki"
ME="${{USER:-$(id -un)}}"
if [ ! -f "$PKI/ca.pem" ]; then
  {python} -m unbroken.cli certs ca --dir "$PKI" >/dev/null
  {python} -m unbroken.cli certs issue driver:main --dir "$PKI" --host "{advertise}" >/dev/null
  for node in "${{NODES[@]}}"; do
    {python} -m unbroken.cli certs issue "node:$node" --dir "$PKI" >/dev/null
  done
  {python} -m unbroken.cli certs issue "operator:$ME" --dir "$PKI" >/dev/null
fi
"""
OPERATOR = (
    'echo "unbroken: as an operator: unbroken status --driver $DRIVER_ADDR '
    '--tls-cert $PKI/operator-$ME.crt --tls-key $PKI/operator-$ME.key --tls-ca $PKI/ca.pem"\n'
)
DRIVER_TLS = (
    '--tls-cert "$PKI/driver-main.crt" --tls-key "$PKI/driver-main.key" --tls-ca "$PKI/ca.pem"'
)
AGENT_TLS = "--tls-cert $PKI/node-{node}.crt --tls-key $PKI/node-{node}.key --tls-ca $PKI/ca.pem"


def _has(args: str, *flags: str) -> bool:
    """Whether the flag string `args` names any of `flags` (as `--flag` or `--flag=`)."""
    words = shlex.split(args)
    return any(w == f or w.startswith(f + "=") for w in words for f in flags)


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken slurm`."""
    sub = parser.add_subparsers(dest="slurm_cmd", required=True, metavar="COMMAND")
    p = sub.add_parser("submit", help="submit the job with sbatch (--print: show the script)")
    p.add_argument("--nodes", type=int, required=True, help="training nodes")
    p.add_argument("--spares", type=int, default=1, help="spare nodes in the allocation")
    p.add_argument("--name", default="unbroken", help="Slurm job name")
    p.add_argument(
        "--listen-host",
        default="0.0.0.0",
        help="the driver's listen host (beyond loopback it needs --tls-*/--token-file in "
        "--driver-args, or --insecure)",
    )
    p.add_argument(
        "--advertise-host", default="$(hostname)", help="host agents use to reach the driver"
    )
    p.add_argument("--output", default="unbroken-%j.out", help="sbatch --output")
    p.add_argument(
        "--job-dir",
        default="${SLURM_SUBMIT_DIR:-$PWD}/unbroken-$SLURM_JOB_ID",
        help="the job's folder on a file system every node shares: the embedded etcd's data, "
        "the archive and the checkpoints go there unless --driver-args/--agent-args name "
        "their own (--etcd, --archive-url, --persist-url), and the job's own CA and "
        "certificates unless --driver-args bring credentials (--tls-*, --token-file, "
        "--insecure)",
    )
    p.add_argument(
        "--driver-args",
        default="",
        help='more `unbroken driver` flags, one string; write --driver-args="--flag ..." '
        "(with '='): a value that starts with -- is otherwise taken for a flag",
    )
    p.add_argument(
        "--agent-args",
        default="",
        help="more `unbroken agent` flags, one string ({node} is the node's name); write "
        "--agent-args=\"--flag ...\" (with '=')",
    )
    p.add_argument("--print", action="store_true", help="print the script, do not submit")
    p.add_argument("--slurm-conf", default="", help="SLURM_CONF for sbatch")
    n = sub.add_parser("nodes", help="Slurm's state and reason of every node")
    n.add_argument("--slurm-conf", default="", help="SLURM_CONF for scontrol")
    r = sub.add_parser(
        "resume", help="clear a node unbroken drained (through the driver; Slurm State=RESUME)"
    )
    r.add_argument("node", metavar="NODE")
    r.add_argument("--force", action="store_true", help="also a node someone else drained")
    r.add_argument(
        "--direct",
        action="store_true",
        help="no driver: run scontrol here (not role-checked, recorded by the next driver)",
    )
    r.add_argument("--slurm-conf", default="", help="SLURM_CONF for scontrol (--direct)")
    add_client_flags(r)


def script(ns: argparse.Namespace) -> str:
    """The batch script of `unbroken slurm submit`: what --driver-args and --agent-args leave
    out that a job needs, it gets in the job's folder (an embedded etcd, the archive,
    checkpoints, and mTLS with a CA of its own)."""
    if ns.nodes < 1 or ns.spares < 0:
        raise ValueError(f"--nodes must be >= 1 and --spares >= 0, got {ns.nodes}, {ns.spares}")
    python = shlex.quote(sys.executable)
    driver, agent = [ns.driver_args], [ns.agent_args]
    if not _has(ns.driver_args, "--etcd", "--etcd-data-dir", "--event-log"):
        driver.append('--etcd-data-dir "$JOB_DIR/etcd"')
    if not _has(ns.driver_args, "--archive-url"):
        driver.append('--archive-url "$JOB_DIR/archive"')
    if not _has(ns.agent_args, "--persist-url", "--no-flash"):
        agent.append("--persist-url $JOB_DIR/checkpoints")
    tls = not endpoint_is_loopback(f"{ns.listen_host}:1") and not _has(
        ns.driver_args, "--tls-cert", "--token-file", "--insecure"
    )
    if tls:
        driver.append(DRIVER_TLS)
        agent.append(AGENT_TLS)
    agent_args = " ".join(a for a in agent if a)
    return SCRIPT.format(
        name=ns.name,
        total=ns.nodes + ns.spares,
        nodes=ns.nodes,
        output=ns.output,
        listen_host=ns.listen_host,
        advertise=ns.advertise_host,
        python=python,
        job_dir=ns.job_dir,
        pki=PKI.format(python=python, advertise=ns.advertise_host) if tls else "",
        operator=OPERATOR if tls else "",
        driver_args=" ".join(d for d in driver if d),
        agent_args=agent_args,
        train_agent_args=agent_args.replace("{node}", "$node"),
    )


def run(ns: argparse.Namespace) -> int:
    """`unbroken slurm`; exit 0, 1 when Slurm refused, 2 on bad input."""
    sched = SlurmScheduler(SlurmConfig(slurm_conf=ns.slurm_conf))
    try:
        if ns.slurm_cmd == "submit":
            return _submit(ns, sched)
        if ns.slurm_cmd == "nodes":
            for i in asyncio.run(sched.nodes()):
                print(f"{i.node_id:<16} {i.health.value:<10} {i.raw_state:<24} {i.reason}")
            return 0
        if not ns.direct:
            return _clear(ns)
        print(asyncio.run(sched.resume(ns.node, force=ns.force)))
        return 0
    except ValueError as e:
        print(f"unbroken slurm: {e}", file=sys.stderr)
        return 2
    except SchedulerError as e:
        print(f"unbroken slurm: {e}", file=sys.stderr)
        return 1


def _clear(ns: argparse.Namespace) -> int:
    """`unbroken slurm resume NODE` through the driver (exit 0 resumed, 1 refused, 2 bad
    input or not allowed, 3 driver unreachable)."""

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        resp = await stub.ClearNode(
            dpb.ClearNodeRequest(node_id=ns.node, force=ns.force),
            timeout=cfg.timeout_s,
            metadata=md,
        )
        if ns.json:
            print_json({"node_id": ns.node, **to_dict(resp)})
        else:
            print(f"cleared {ns.node}: {resp.scheduler} says {resp.answer} (event seq {resp.seq})")
        return 0

    return run_command("slurm resume", ns, body)


def _submit(ns: argparse.Namespace, sched: SlurmScheduler) -> int:
    text = script(ns)
    if ns.print:
        print(text, end="")
        return 0
    r = subprocess.run(
        [sched._bin("sbatch"), "--parsable"],
        input=text,
        text=True,
        capture_output=True,
        env=sched._env(),
        timeout=sched.config.timeout_s,
    )
    if r.returncode:
        raise SchedulerError(f"sbatch refused the job: {r.stderr.strip()}")
    print(f"submitted job {r.stdout.strip()}")
    return 0
