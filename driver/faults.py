"""What a fault observation means to the recovery machine (driver/machine.py): its kind
(clear: restart the ranks; unclear: diagnose first; lost; evict), the nodes it names, why,
and whether the process it came from is suspect (then every process restarts).

Pure functions of the event, the folded state and the policy, like the machine itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from unbroken.diagnostics import selfcheck as selfchecklib
from unbroken.driver.policy import Policy
from unbroken.driver.worldplan import _pool, _reachable
from unbroken.proto import events_pb2 as ev

#: Log keywords that are symptoms, not faults: every rank prints a Traceback/RuntimeError
#: when a peer dies (gloo "Connection reset by peer"), and a worker that raises exits, which
#: the agent reports as WorkerFailed. Recorded only; hardware keywords (NCCL WARN, Xid, ECC,
#: CUDA error, out of memory) and a non-finite loss open an incident.
SYMPTOM_KEYWORDS = frozenset({"Traceback", "RuntimeError"})

#: Exits that say the process itself was killed from outside (the OOM killer, a drill's
#: SIGKILL, an orderly SIGTERM/SIGINT), as opposed to a crash inside it: its peers are sound.
#: Every other exit (a segfault or abort in an extension, a Python error, an unknown code)
#: makes the incident suspect: the machine restarts every process.
CLEAN_KILLS = frozenset({-9, -15, -2, 128 + 9, 128 + 15, 128 + 2})
#: Log keywords that make the open incident suspect (a device or communicator may be
#: poisoned in every process of the node): always the full restart.
SUSPECT_KEYWORDS = frozenset({"CUDA error", "NCCL WARN", "Xid", "ECC", "out of memory"})


def suspect_exit(code: int) -> bool:
    """Whether a worker's exit code says it crashed inside (see `CLEAN_KILLS`)."""
    return code not in CLEAN_KILLS


def fault_ranks(e: ev.Event, s: ev.JobState) -> tuple[bool, list[int]]:
    """(suspect, the global ranks to replace) of a fault event, for the recovery mode."""
    kind = e.WhichOneof("payload")
    wpn = max(1, s.world.workers_per_node)

    def rank_of(node_id: str, local_rank: int, given: int) -> list[int]:
        # from the world (node order is rank order), not `given`: 0 is also "unset"
        ids = s.world.node_ids
        return [list(ids).index(node_id) * wpn + local_rank] if node_id in ids else []

    if kind == "worker_failed":
        wf = e.worker_failed
        return suspect_exit(wf.exit_code), rank_of(wf.node_id, wf.local_rank, wf.global_rank)
    if kind == "hang_suspected":
        h = e.hang_suspected
        out = rank_of(h.node_id, h.local_rank, h.global_rank)
        for lr in h.hung_ranks:
            out += rank_of(h.node_id, lr, -1)
        return False, out
    if kind == "log_alert":
        return e.log_alert.keyword in SUSPECT_KEYWORDS, []
    return False, []  # a self-check, an operator's action, a straggler


CLEAR, UNCLEAR, LOST, EVICT = "clear", "unclear", "lost", "evict"


def classify(e: ev.Event, policy: Policy, s: ev.JobState) -> tuple[str, list[str], str] | None:
    """(kind, nodes, reason) of a node fault event, or None when it is not one."""
    kind = e.WhichOneof("payload")
    unclear = UNCLEAR if kind in policy.diagnose_kinds else CLEAR
    if kind == "node_lost":
        lost = e.node_lost
        rec = s.nodes.get(lost.node_id)
        if rec is not None and lost.epoch and lost.epoch < rec.epoch:
            return None  # an older agent of a node that has since re-registered
        why = lost.reason or "no heartbeat"
        return LOST, [lost.node_id], f"node {lost.node_id} lost ({why})"
    if kind == "worker_failed":
        wf = e.worker_failed
        what = f"exited with {wf.exit_code} at step {wf.last_step}"
        return unclear, [wf.node_id], f"worker {wf.node_id}/{wf.local_rank} {what}"
    if kind == "hang_suspected":
        h = e.hang_suspected
        why = f"hang on {h.node_id}/{h.local_rank} at {h.stuck_at_step}"
        earlier = recent_failures(s, h.node_id, max(s.step, h.stuck_at_step), policy)
        if unclear == UNCLEAR and h.phase == "stopped" and earlier < policy.hang_diagnose_after:
            return CLEAR, [h.node_id], f"{why} (its process is stopped: restart)"
        return unclear, [h.node_id], why
    if kind == "straggler_suspected":
        st = e.straggler_suspected
        if st.policy != "evict" or st.node_id not in s.world.node_ids:
            return None  # alert only; or not (any longer) in the world
        if not _pool(s, list(s.world.node_ids), with_spares=True):
            return None  # no spare to take its ranks: a slow node beats a smaller world
        why = f"straggler: {st.slowdown:.2f}x slower than the other nodes"
        return EVICT, [st.node_id], why
    if kind == "log_alert":
        a = e.log_alert
        if a.keyword in SYMPTOM_KEYWORDS:
            return None  # a consequence (a peer died, the worker is exiting): WorkerFailed follows
        return unclear, [a.node_id], f"log alert {a.keyword!r} on {a.node_id}/{a.local_rank}"
    if kind == "self_check_reported" and not e.self_check_reported.ok:
        c = e.self_check_reported
        failed = list(c.failures)
        if self_check_proves(failed, policy.self_check_evicts):
            why = "its own result: evicted without a diagnosis"
            return EVICT, [c.node_id], f"self-check failed on {c.node_id} ({why}): {failed}"
        return unclear, [c.node_id], f"self-check failed on {c.node_id}: {failed}"
    if kind == "operator_action":
        op = e.operator_action
        who = op.who or "operator"
        if op.action == "evict" and op.target:
            return EVICT, [op.target], f"evicted by {who}"
        if op.action == "diagnose":
            nodes = [op.target] if op.target else list(_reachable(s))
            return UNCLEAR, nodes, f"diagnosis requested by {who}"
    return None


def recent_failures(s: ev.JobState, node: str, step: int, policy: Policy) -> int:
    """`node`'s failures on record within `policy.fault_window_steps` of `step` (all of them
    with no window). A log written before the steps were recorded counts none."""
    rec = s.nodes.get(node)
    if rec is None:
        return 0
    if not policy.fault_window_steps:
        return rec.failures
    return sum(1 for at in rec.fault_steps if at + policy.fault_window_steps >= step)


def self_check_proves(failures: Sequence[str], evicts: frozenset[str]) -> bool:
    """Whether a failure of an item in `evicts` is its check's own result (not a crash)."""
    for f in failures:
        name, detail = selfchecklib.failure_item(f)
        if name in evicts and not detail.startswith(selfchecklib.CRASHED):
            return True
    return False
