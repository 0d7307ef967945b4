"""The pass criteria of a chaos run, as pure functions returning the problems they found.

1. `check_log`: the log is dense (seq 1..N), every event id is unique, and every append a
   driver acknowledged is in it exactly once, at the seq it was acknowledged with.
2. `check_loop_states`: every state the leaders' recovery loops decided on (folded
   incrementally from their replay at election) equals the fold of the log from seq 1 up
   to that state's last seq: the very same `JobState` message.
3. `check_status`: what the leader reports (GetStatus, ListNodes) matches the fold from
   seq 1 at the seq the report was built from.
4. `check_losses`: every step the chaos run trained (each time it trained it) has exactly
   the loss of the uninterrupted reference run, with no step missing. Two logged events
   document a difference: a Rollback (steps after its target are not compared), and a
   world that shrank dp (no spare left; WorldResized): the same samples are then reduced
   in another order, so losses agree to `RESHARD_RTOL` rather than bit for bit.
"""

from __future__ import annotations

from unbroken.driver import state as statelib
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

RESHARD_RTOL = 1e-5  # fp32 loss of the same batch under another dp (measured: ~1e-7)


def check_log(events: list[ev.Event], acks: list[tuple[int, str, str]]) -> list[str]:
    """Problems with density, uniqueness and acknowledged appends (empty: all good)."""
    problems = []
    seqs = [e.seq for e in events]
    if seqs != list(range(1, len(events) + 1)):
        holes = sorted(set(range(1, (max(seqs) if seqs else 0) + 1)) - set(seqs))
        problems.append(f"the log is not dense: {len(events)} events, missing seqs {holes[:20]}")
    ids: dict[str, int] = {}
    for e in events:
        if e.event_id in ids:
            problems.append(f"event id {e.event_id} at seq {ids[e.event_id]} and {e.seq}")
        ids[e.event_id] = e.seq
    by_seq = {e.seq: e for e in events}
    acked: dict[str, int] = {}
    for seq, event_id, writer in acks:
        if acked.setdefault(event_id, seq) != seq:
            problems.append(f"{event_id} acknowledged at seq {acked[event_id]} and {seq}")
        stored = by_seq.get(seq)
        if stored is None:
            problems.append(f"acknowledged seq {seq} ({event_id} by {writer}) is not in the log")
        elif stored.event_id != event_id:
            problems.append(
                f"seq {seq} was acknowledged to {writer} as {event_id} but holds "
                f"{stored.event_id} ({stored.WhichOneof('payload')} by {stored.writer})"
            )
    return problems


def check_loop_states(job: str, events: list[ev.Event], states: list[bytes]) -> list[str]:
    """Problems where a recorded loop state differs from the fold from seq 1."""
    problems = []
    for raw in states:
        live = ev.JobState.FromString(raw)
        if live.last_seq > len(events):
            problems.append(f"a loop state at seq {live.last_seq} is past the log's end")
            continue
        folded = statelib.fold(events[: live.last_seq], statelib.initial(job))
        if folded != live:
            problems.append(
                f"the loop's state at seq {live.last_seq} differs from the fold from seq 1: "
                f"{_diff(folded, live)}"
            )
    return problems


def check_status(
    job: str,
    events: list[ev.Event],
    status: dpb.GetStatusResponse,
    nodes: dpb.ListNodesResponse,
) -> list[str]:
    """Problems where the leader's reported state differs from the fold at its seq."""
    if status.last_seq > len(events):
        return [f"GetStatus reports seq {status.last_seq}, past the log's end {len(events)}"]
    s = statelib.fold(events[: status.last_seq], statelib.initial(job))
    problems = []
    for name, want in (
        ("phase", s.phase),
        ("step", s.step),
        ("last_seq", s.last_seq),
        ("leader_term", s.leader_term),
        ("incident_id", s.incident_id),
        ("last_diagnosis_id", s.last_diagnosis_id),
    ):
        got = getattr(status, name)
        if got != want:
            problems.append(f"GetStatus {name} = {got!r}, the fold from seq 1 has {want!r}")
    reported = {n.node_id: n for n in nodes.nodes}
    for node_id, rec in s.nodes.items():
        n = reported.get(node_id)
        if n is None:
            problems.append(f"ListNodes lacks {node_id}, which the log knows")
        elif (n.state, n.spare, n.failures) != (rec.state, rec.spare, rec.failures):
            problems.append(
                f"ListNodes {node_id}: state {n.state} spare {n.spare} failures {n.failures}; "
                f"the fold: state {rec.state} spare {rec.spare} failures {rec.failures}"
            )
    return problems


def check_losses(
    got: dict[int, list[float]], ref: dict[int, list[float]], events: list[ev.Event]
) -> tuple[list[str], int]:
    """Problems comparing the chaos run's losses with the reference's; and steps compared."""
    if not got:
        return ["the chaos run logged no step"], 0
    rollbacks = [e.rollback.to_step for e in events if e.HasField("rollback")]
    upto = min([max(got), *rollbacks])
    rtol = RESHARD_RTOL if resharded(events) else 0.0
    problems = []
    missing = sorted(set(range(1, upto + 1)) - set(got))
    if missing:
        problems.append(f"steps never trained: {missing[:20]}")
    compared = 0
    for step in range(1, upto + 1):
        if step not in ref:
            problems.append(f"the reference run did not reach step {step}")
            break
        for v in got.get(step, []):
            compared += 1
            want = ref[step][0]
            if v != want and abs(v - want) > rtol * abs(want):
                problems.append(f"step {step}: loss {v!r}, uninterrupted run {want!r}")
    return problems, compared


def resharded(events: list[ev.Event]) -> bool:
    """Whether the job ever trained with another dp than it started with (a shrink)."""
    start = next((e.job_started.world.dp for e in events if e.HasField("job_started")), 0)
    for e in events:
        if e.HasField("world_resized") and e.world_resized.new_world.dp != start:
            return True
        if e.HasField("training_resumed") and e.training_resumed.world.dp not in (0, start):
            return True
    return False


def _diff(a: ev.JobState, b: ev.JobState) -> str:
    out = []
    for fd in ev.JobState.DESCRIPTOR.fields:
        va, vb = getattr(a, fd.name), getattr(b, fd.name)
        if va != vb:
            out.append(f"{fd.name}: fold={_short(va)} live={_short(vb)}")
    return "; ".join(out) or "(only in unknown fields)"


def _short(v: object) -> str:
    return " ".join(str(v).split())[:200]
