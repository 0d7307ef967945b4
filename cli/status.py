"""`unbroken status`: the job at a glance (phase, step, nodes, newest event) from the driver."""

from __future__ import annotations

import argparse

from unbroken.cli.client import (
    ClientConfig,
    add_client_flags,
    console,
    print_json,
    run_command,
    to_dict,
)
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken status`."""
    add_client_flags(parser)


def phase_name(phase: int) -> str:
    """`PHASE_RUNNING` -> `running`."""
    return ev.Phase.Name(phase).removeprefix("PHASE_").lower()


def goodput_line(st: dpb.GetStatusResponse) -> str:
    """`0.962 of 1 h 02 min trained; lost: node_lost 41 s, steps_redone 12 s`."""
    if st.goodput < 0:
        return "training has not started"
    wall = st.training_wall_s
    span = f"{wall / 3600:.1f} h" if wall >= 3600 else f"{wall / 60:.1f} min"
    lost = ", ".join(
        f"{cause} {secs:.0f} s"
        for cause, secs in sorted(st.lost_s_by_cause.items(), key=lambda kv: -kv[1])
        if secs >= 0.5
    )
    return f"{st.goodput:.3f} of {span} trained" + (f"; lost: {lost}" if lost else "")


#: driver/goodput.py CATEGORIES (the CLI does not import the driver)
BADPUT_ORDER = (
    "startup", "detection", "pause", "diagnosis", "restart", "restore", "steps_redone",
    "checkpoint_save", "data_loading",
)  # fmt: skip


def badput_line(st: dpb.GetStatusResponse) -> str:
    """`detection 2 s, pause 1 s, restore 3 s, steps_redone 2 s` (the lost time by what it
    was spent on, in recovery order; the same sum as the causes)."""
    order = {c: i for i, c in enumerate(BADPUT_ORDER)}
    cats = sorted(st.lost_s_by_category.items(), key=lambda kv: (order.get(kv[0], 99), kv[0]))
    return ", ".join(f"{cat} {secs:.1f} s" for cat, secs in cats if secs >= 0.05) or "none"


def persistence_line(st: dpb.GetStatusResponse) -> str:
    """`every 93 s (Young/Daly: 0.050 s per checkpoint, storage-served MTBF 24.0 h)`."""
    mtbf = f"{st.storage_mtbf_s / 3600:.1f} h" if st.storage_mtbf_s else "?"
    if st.persist_every_s <= 0:
        return "the agents' --persist-every-s (no persist cost measured yet)"
    return (
        f"every {st.persist_every_s:.0f} s (Young/Daly: {st.persist_cost_s:.3f} s per checkpoint, "
        f"storage-served MTBF {mtbf})"
    )


def commit_line(st: dpb.GetStatusResponse) -> str:
    """`step 1200, 41 s ago`, or that none was committed yet."""
    if st.newest_commit_age_s < 0:
        return "none yet"
    return f"step {st.newest_commit_step}, {st.newest_commit_age_s:.0f} s ago"


def persist_failing_lines(st: dpb.GetStatusResponse) -> list[str]:
    """One line per node whose persistence fails: `node-1: 7 writes failed in a row for
    42 s: OSError: [Errno 28] No space left on device`."""
    return [
        f"{f.node_id}: {f.failures} writes failed in a row for {f.failing_s:.0f} s: {f.error}"
        for f in st.persist_failing
    ]


def log_failing_line(st: dpb.GetStatusResponse) -> str:
    """`etcd is FULL: writes refused for 42 s (...); 1 fault waits to be recorded, so the
    node counts above miss it`."""
    what = "etcd is FULL" if st.log_full else "the event log is unavailable"
    waits = st.faults_unrecorded
    line = f"{what}: writes refused for {st.log_failing_s:.0f} s ({st.log_error})"
    if waits:
        line += (
            f"; {waits} fault{'s' if waits > 1 else ''} wait{'' if waits > 1 else 's'} to be "
            "recorded, so the node counts above miss them"
        )
    return line


def mass_silence_line(st: dpb.GetStatusResponse) -> str:
    """`10240 nodes silent at once, NodeLost held back for 4 s; no node heard for 4 s (this
    driver overloaded or cut off?)`."""
    line = (
        f"{st.mass_silence_nodes} nodes silent at once, NodeLost held back for "
        f"{st.mass_silence_held_s:.0f} s"
    )
    if st.mass_silence_unheard_s >= 1:
        line += (
            f"; no node heard for {st.mass_silence_unheard_s:.0f} s (this driver overloaded "
            "or cut off from the nodes?)"
        )
    return line


def run(ns: argparse.Namespace) -> int:
    """`unbroken status`; exit 0, or 3 when the driver is unreachable."""

    async def body(
        cfg: ClientConfig, stub: dgrpc.DriverStub, md: tuple[tuple[str, str], ...]
    ) -> int:
        st = await stub.GetStatus(dpb.GetStatusRequest(), timeout=cfg.timeout_s, metadata=md)
        if ns.json:
            data = to_dict(st)
            data["phase"] = phase_name(st.phase)
            print_json(data)
            return 0
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=f"job {st.job_id}", show_header=False, title_justify="left")
        t.add_column("field", style="bold")
        t.add_column("value")
        phase = phase_name(st.phase)
        if phase == "failed":
            phase = f"[bold white on red] FAILED [/]: {escape(st.finished_reason)}; fix it, then "
            phase += "`unbroken resume`"
        elif st.finished_reason:
            phase += f": {escape(st.finished_reason)}"
        if st.awaiting_nodes:
            phase += f" [bold yellow]WAITING FOR NODES[/]: {escape(st.awaiting_nodes)}"
        t.add_row("phase", phase)
        t.add_row("step", f"{st.step} (live {st.live_step})")
        t.add_row(
            "nodes",
            f"{st.nodes_total} total: {st.nodes_active} active, {st.nodes_spare} spare, "
            f"{st.nodes_lost} lost, {st.nodes_evicted} evicted; {st.nodes_alive} alive now",
        )
        t.add_row(
            "leader",
            escape(f"{st.driver_id} at {st.leader_address or '?'} (term {st.leader_term})"),
        )
        t.add_row("goodput", goodput_line(st))
        if st.goodput >= 0:
            t.add_row("badput", badput_line(st))
        t.add_row("persistence", persistence_line(st))
        t.add_row("newest commit", commit_line(st))
        for line in persist_failing_lines(st):
            t.add_row("[bold red]PERSIST FAILING[/]", escape(line))
        if st.log_failing_s > 0:
            t.add_row("[bold red]EVENT LOG FAILING[/]", escape(log_failing_line(st)))
        if st.mass_silence_nodes:
            t.add_row("[bold red]MASS SILENCE[/]", escape(mass_silence_line(st)))
        t.add_row("last event", f"seq {st.last_seq}")
        incident = st.incident_id or "none"
        if st.incident_id:
            incident += f": {st.incident_cause}"
            if st.failed_restores:
                incident += f" ({st.failed_restores} failed restores)"
        t.add_row("incident", escape(incident))
        t.add_row(
            "diagnosis",
            escape(st.diagnosis_running or f"last: {st.last_diagnosis_id or 'none'}"),
        )
        console().print(t)
        return 0

    return run_command("status", ns, body)
