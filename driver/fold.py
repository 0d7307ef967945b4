"""Folding events into a live `JobState` in place, with an undo, in O(event) time.

`state.apply` is the pure contract: it copies the state, so it costs O(state) per event
(a registration into a 10,400-node state measured 3.2-3.6 ms; joining 10,400 nodes, 33-37 s
of driver CPU). The journal owns one live state and folds into it in place; when what it
folded must be taken back (a batch's draft decisions, an append that failed, a fold that
raised) it undoes through a `Savepoint`, which holds only what the events touched:

- the state's small fields (phase, counters, the goodput ledger, suspects...), copied once
  per savepoint;
- every node record an event touched, copied on its first touch (`None`: it did not exist),
  through the fold's node accessor and its pruning;
- a copy of the whole state, taken before an event of a kind that rewrites the large fields
  (the world layouts, the checkpoint list): a job start, a resize, a resume, a transition...
  These are once per incident, not once per node.

`fold_in_place(...) == state.fold(...)` and "fold in place, then undo" leaves the state as
it was, for any events (tests/unit/test_fold_undo.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from unbroken.driver import state as statelib
from unbroken.proto import events_pb2 as ev

#: Fields that may be large (proportional to the nodes): never copied per event.
_LARGE = frozenset({"nodes", "world", "configured_world", "incident_world", "checkpoints"})
# (name, how to copy it): "repeated" (and maps), "message", "optional" (presence), "scalar"
_SMALL = tuple(
    (
        f.name,
        "repeated"
        if f.is_repeated
        else "message"
        if f.message_type is not None
        else "optional"
        if f.has_presence
        else "scalar",
    )
    for f in ev.JobState.DESCRIPTOR.fields
    if f.name not in _LARGE
)
#: Event kinds whose fold touches only the small fields and node records reached through
#: the fold's node accessor (or its pruning): the kinds with no handler, and these. Every
#: other kind (a handler added later included) takes a whole copy first.
_NARROW_HANDLED = frozenset(
    {
        "node_registered",
        "node_lost",
        "node_evicted",
        "worker_failed",
        "hang_suspected",
        "straggler_suspected",
        "log_alert",
        "diagnosis_verdict",
        "leader_elected",
        "restore_started",
        "restore_finished",
        "rollback",
        "training_paused",
        "job_finished",
    }
)
NARROW_KINDS = frozenset(
    {f.name for f in ev.Event.DESCRIPTOR.oneofs_by_name["payload"].fields} - set(statelib._HANDLERS)
) | (_NARROW_HANDLED & set(statelib._HANDLERS))


def narrow(state: ev.JobState, event: ev.Event) -> bool:
    """Whether folding `event` into `state` touches only its small fields and the node
    records reached through the fold's node accessor. A transition is, unless it opens
    an incident (the incident's world is copied), closes one (it is cleared) or rearms:
    each decision of a storm of losses is one, and a whole copy each was 2-3 MB at 10,240
    nodes."""
    kind = event.WhichOneof("payload")
    if kind in NARROW_KINDS:
        return True
    if kind != "recovery_transition":
        return False
    p = event.recovery_transition
    opens = bool(p.incident_id) and not state.incident_id
    return not (p.rearm or opens or p.to_phase == ev.PHASE_RUNNING)


def _copy_small(src: ev.JobState, dst: ev.JobState) -> None:
    for name, how in _SMALL:
        if how == "scalar":
            setattr(dst, name, getattr(src, name))
        elif how == "repeated":
            dst.ClearField(name)
            getattr(dst, name).MergeFrom(getattr(src, name))
        elif src.HasField(name):
            if how == "message":
                getattr(dst, name).CopyFrom(getattr(src, name))
            else:
                setattr(dst, name, getattr(src, name))
        else:
            dst.ClearField(name)


class Savepoint:
    """What it takes to put a live state back as it was when the savepoint began."""

    __slots__ = ("_full", "_nodes", "_small", "state")

    def __init__(self, state: ev.JobState) -> None:
        self.state = state
        self._small = ev.JobState()
        _copy_small(state, self._small)
        self._nodes: dict[str, ev.NodeRecord | None] = {}
        self._full: ev.JobState | None = None

    def touch(self, node_id: str) -> None:
        """Keep node `node_id`'s record as it is now, unless an earlier touch kept it."""
        if self._full is not None or node_id in self._nodes:
            return
        rec = self.state.nodes.get(node_id)
        if rec is None:
            self._nodes[node_id] = None
        else:
            kept = ev.NodeRecord()
            kept.CopyFrom(rec)
            self._nodes[node_id] = kept

    def apply(self, event: ev.Event) -> None:
        """Fold `event` into the live state, keeping what undoes it."""
        if self._full is None and not narrow(self.state, event):
            self._full = ev.JobState()
            self._full.CopyFrom(self.state)
            self._restore_narrow(self._full)  # the copy as it was when the savepoint began
        prev = statelib.set_touch_hook(None if self._full is not None else self.touch)
        try:
            statelib.apply_in_place(self.state, event)
        finally:
            statelib.set_touch_hook(prev)

    def undo(self) -> None:
        """Put the live state back as it was when the savepoint began."""
        if self._full is not None:
            self.state.CopyFrom(self._full)
        else:
            self._restore_narrow(self.state)
        self._nodes.clear()
        self._full = None

    def _restore_narrow(self, s: ev.JobState) -> None:
        _copy_small(self._small, s)
        for node_id, rec in self._nodes.items():
            if rec is None:
                if node_id in s.nodes:
                    del s.nodes[node_id]
            else:
                s.nodes[node_id].CopyFrom(rec)


def fold_in_place(state: ev.JobState, events: Iterable[ev.Event]) -> None:
    """Fold `events` into `state` itself: all of them, or (when one raises) none."""
    sp = Savepoint(state)
    try:
        for e in events:
            sp.apply(e)
    except BaseException:
        sp.undo()
        raise
