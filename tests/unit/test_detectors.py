"""The detectors' rules, on a live view built by hand (pure: no sockets, no clocks)."""

from __future__ import annotations

import math

import pytest

from unbroken.driver import detectors
from unbroken.driver.liveview import LiveView, LiveViewConfig
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit

RUNNING, EXITED = dpb.WORKER_STATE_RUNNING, dpb.WORKER_STATE_EXITED


def view(**kw: int) -> LiveView:
    return LiveView(LiveViewConfig(**kw))


def req(node: str = "n0", epoch: int = 5, **kw: object) -> dpb.RegisterRequest:
    return dpb.RegisterRequest(node_id=node, epoch=epoch, **kw)  # type: ignore[arg-type]


def admitted(v: LiveView, r: dpb.RegisterRequest, now: float) -> None:
    reason, event = detectors.admit(v, r, now)
    assert reason == "" and event is not None and event.HasField("node_registered")
    s = v.slot(r.node_id)
    s.epoch = r.epoch
    v.mark_alive(s, now)


def test_node_lost_after_miss_limit_intervals_by_monotonic_time() -> None:
    v = view()
    for i, n in enumerate(("a", "b", "c")):
        admitted(v, req(n), now=10.0 + i * 0.01)
    assert detectors.expired(v, 10.299) == []  # a: 299 ms silent -> not yet
    lost = detectors.expired(v, 10.305)
    assert [e.node_lost.node_id for e in lost] == ["a"]
    assert lost[0].node_lost.reason == "heartbeat timeout"
    assert lost[0].node_lost.silent_ms == pytest.approx(305.0)
    assert detectors.expired(v, 10.305) == []  # reported once
    assert not v.nodes["a"].alive and v.nodes["b"].alive


def test_a_heartbeat_moves_the_node_to_the_back_of_the_deadline_order() -> None:
    v = view(heartbeat_interval_ms=100, miss_limit=3)
    for n in ("a", "b"):
        admitted(v, req(n), now=0.0)
    v.beat(v.nodes["a"], dpb.Heartbeat(seq=1), 0.25)
    assert list(v.order) == ["b", "a"]
    assert [e.node_lost.node_id for e in detectors.expired(v, 0.31)] == ["b"]
    assert [e.node_lost.node_id for e in detectors.expired(v, 0.56)] == ["a"]


def test_driver_stall_is_slack_not_node_silence() -> None:
    v = view()
    admitted(v, req(), now=0.0)
    assert detectors.expired(v, 0.5, slack_s=0.4) == []
    assert len(detectors.expired(v, 0.71, slack_s=0.4)) == 1


def test_registered_node_without_session_expires_after_grace() -> None:
    v = view(session_grace_ms=1000)
    s = v.slot("n0")
    s.epoch = 1
    v.mark_registered(s, 0.0)
    assert detectors.expired(v, 0.9) == []
    lost = detectors.expired(v, 1.01)
    assert lost[0].node_lost.reason == "no session after registration"


def test_worker_failure_reported_once_per_exit_and_again_after_a_restart() -> None:
    v = view()
    s = v.slot("n0")
    hb = dpb.Heartbeat(
        flags=dpb.HEARTBEAT_FLAG_WORKER_EXITED,
        workers=[
            dpb.WorkerStatus(local_rank=0, global_rank=4, state=RUNNING, step=7),
            dpb.WorkerStatus(
                local_rank=1, global_rank=5, state=EXITED, exit_code=1, step=7,
                since_progress_ms=640.0,
            ),
            dpb.WorkerStatus(local_rank=2, global_rank=6, state=EXITED, exit_code=0, step=7),
        ],
    )  # fmt: skip
    out = detectors.flagged(s, hb)
    assert [
        (
            e.worker_failed.local_rank,
            e.worker_failed.global_rank,
            e.worker_failed.exit_code,
            e.worker_failed.last_step,
            e.worker_failed.silent_ms,  # the goodput ledger's detection time
        )
        for e in out
    ] == [(1, 5, 1, 7, 640.0)]
    assert detectors.flagged(s, hb) == []
    hb.workers[1].restarts = 1
    hb.workers[1].exit_code = -9
    assert [e.worker_failed.exit_code for e in detectors.flagged(s, hb)] == [-9]


def test_log_alerts_carry_the_line_truncated() -> None:
    s = LiveView(LiveViewConfig()).slot("n0")
    long = "NCCL WARN " + "x" * 10_000
    hb = dpb.Heartbeat(alerts=[dpb.LogAlertLine(local_rank=1, keyword="NCCL WARN", line=long)])
    (e,) = detectors.flagged(s, hb)
    assert e.log_alert.keyword == "NCCL WARN" and e.log_alert.local_rank == 1
    assert len(e.log_alert.line) <= detectors.MAX_LINE_CHARS
    assert e.log_alert.line.startswith("NCCL WARN xxx")


def test_bad_telemetry_becomes_alerts() -> None:
    s = LiveView(LiveViewConfig()).slot("n0")
    ok = dpb.Heartbeat(workers=[dpb.WorkerStatus(local_rank=0, step=10, loss=1.0, has_loss=True)])
    assert detectors.flagged(s, ok) == []
    back = dpb.Heartbeat(
        workers=[dpb.WorkerStatus(local_rank=0, step=3, loss=math.nan, has_loss=True)]
    )
    kinds = sorted(e.log_alert.keyword for e in detectors.flagged(s, back))
    assert kinds == ["non-finite loss", "step went backwards"]
    # a restarted worker may start lower; no loss reported is not a NaN loss
    restarted = dpb.Heartbeat(workers=[dpb.WorkerStatus(local_rank=0, step=1, restarts=1)])
    assert detectors.flagged(s, restarted) == []


def _hb(since_ms: float, step: int = 5, *, hung: bool = True, stacks: str = "") -> dpb.Heartbeat:
    """A heartbeat of one node whose rank 1 the agent judged (un)hung; rank 0 is fine."""
    return dpb.Heartbeat(
        flags=dpb.HEARTBEAT_FLAG_STALLED if hung else 0,
        hang_stacks=stacks,
        workers=[
            dpb.WorkerStatus(local_rank=0, global_rank=2, state=RUNNING, step=step + 1),
            dpb.WorkerStatus(
                local_rank=1,
                global_rank=3,
                state=RUNNING,
                step=step,
                since_progress_ms=since_ms,
                hung=hung,
                hang_threshold_ms=1000.0,
                phase="train",
            ),
        ],
    )


def test_a_stalled_flag_becomes_one_hang_event_with_the_stacks() -> None:
    v = view()
    admitted(v, req(), 0.0)
    slot = v.nodes["n0"]
    out = detectors.flagged(slot, _hb(1500, stacks="--- local rank 1 ---\nFile x.py"))
    (h,) = [e.hang_suspected for e in out]
    assert (h.node_id, h.local_rank, h.global_rank, h.stuck_at_step) == ("n0", 1, 3, 5)
    assert h.silent_ms == 1500 and h.threshold_ms == 1000 and h.phase == "train"
    assert list(h.hung_ranks) == [1] and "File x.py" in h.stack_dump


def test_the_hang_names_the_rank_that_stopped_not_one_waiting_for_it() -> None:
    v = view()
    admitted(v, req(), 0.0)
    hb = _hb(1500)
    hb.workers[0].CopyFrom(
        dpb.WorkerStatus(
            local_rank=0, state=RUNNING, step=5, since_progress_ms=4000, hung=True,
            phase="collective",
        )
    )  # fmt: skip
    (e,) = detectors.flagged(v.nodes["n0"], hb)
    assert e.hang_suspected.local_rank == 1 and e.hang_suspected.phase == "train"
    assert list(e.hang_suspected.hung_ranks) == [0, 1]


def test_an_unflagged_heartbeat_is_not_read_for_hangs() -> None:
    v = view()
    admitted(v, req(), 0.0)
    hb = _hb(1500)
    hb.flags = 0  # `hung` set but no flag: the driver does not look (the flag is the contract)
    assert detectors.flagged(v.nodes["n0"], hb) == []


def test_hang_reported_once_per_stuck_step_and_rearmed_by_progress() -> None:
    v = view()
    admitted(v, req(), 0.0)
    slot = v.nodes["n0"]
    assert len(detectors.flagged(slot, _hb(1500, step=5))) == 1
    assert detectors.flagged(slot, _hb(1600, step=5)) == []  # the same episode
    assert detectors.flagged(slot, _hb(10, step=6, hung=False)) == []
    again = detectors.flagged(slot, _hb(1500, step=6))
    assert [e.hang_suspected.stuck_at_step for e in again] == [6]


def test_hang_stacks_are_capped() -> None:
    v = view()
    admitted(v, req(), 0.0)
    out = detectors.flagged(v.nodes["n0"], _hb(1500, stacks="x" * 200_000))
    assert len(out[0].hang_suspected.stack_dump) <= detectors.MAX_STACK_CHARS


def test_stale_epoch_and_duplicate_node_are_refused() -> None:
    v = view()
    admitted(v, req(epoch=5), 0.0)
    reason, e = detectors.admit(v, req(epoch=4), 0.1)
    assert "stale epoch" in reason and e is not None
    assert e.node_refused.reason == "stale epoch" and e.node_refused.epoch == 4
    v.nodes["n0"].connected = True
    reason, e = detectors.admit(v, req(epoch=6), 0.1)
    assert "duplicate node id" in reason and e is not None
    assert e.node_refused.reason == "duplicate node id"
    # the old agent's session is gone: a restarted agent (newer epoch) is welcome
    v.nodes["n0"].connected = False
    reason, e = detectors.admit(v, req(epoch=6), 0.1)
    assert reason == "" and e is not None and e.node_registered.epoch == 6
    # the same live epoch reconnecting needs no new event
    assert detectors.admit(v, req(epoch=5), 0.1) == ("", None)


def test_node_limit_refuses_a_registration_flood() -> None:
    v = view(max_nodes=2)
    admitted(v, req("a"), 0.0)
    admitted(v, req("b"), 0.0)
    reason, e = detectors.admit(v, req("c"), 0.0)
    assert "node limit 2" in reason and e is None


@pytest.mark.parametrize(
    ("r", "msg"),
    [
        (req(node=""), "node_id is empty"),
        (req(node="x" * 129), "at most 128"),
        (req(node="a/b"), "may contain only"),
        (req(epoch=0), "epoch must be > 0"),
        (req(hostname="h" * 300), "hostname is longer"),
        (req(num_workers=5000), "num_workers"),
        (dpb.RegisterRequest(node_id="n", epoch=1, replica_buddy="nowhere"), "host:port"),
        (dpb.RegisterRequest(node_id="n", epoch=1, replica_buddy="h:99999"), "host:port"),
        (dpb.RegisterRequest(node_id="n", epoch=1, replica_pubkey=b"k" * 31), "Ed25519"),
        (dpb.RegisterRequest(node_id="n", epoch=1, replica_pubkey=b"k" * 33), "Ed25519"),
    ],
)
def test_registration_validation(r: dpb.RegisterRequest, msg: str) -> None:
    assert msg in detectors.validate_register(r)


def test_valid_registration_passes() -> None:
    assert detectors.validate_register(req(node="node-1.rack:2", hostname="h")) == ""
    ok = dpb.RegisterRequest(node_id="n", epoch=1, replica_buddy="10.0.0.2:29600")
    assert detectors.validate_register(ok) == ""
    keyed = dpb.RegisterRequest(node_id="n", epoch=1, replica_pubkey=b"k" * 32)
    assert detectors.validate_register(keyed) == ""


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"heartbeat_interval_ms": 5}, "heartbeat_interval_ms"),
        ({"miss_limit": 0}, "miss_limit"),
        ({"max_nodes": 0}, "max_nodes"),
        ({"session_grace_ms": 50}, "session_grace_ms"),
    ],
)
def test_live_config_validation_names_the_field(kw: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LiveViewConfig(**kw)


def test_mass_silence_limit() -> None:
    v = view(mass_loss_fraction=0.25, mass_loss_min=2)
    for i in range(20):
        admitted(v, req(f"n{i}"), 0.0)
    assert detectors.mass_limit(v) == 5
    for i in range(14):  # 6 nodes stay silent
        v.beat(v.nodes[f"n{i}"], dpb.Heartbeat(), 0.25)
    silent = detectors.silent(v, 0.31)
    assert len(silent) == 6 > detectors.mass_limit(v)
    assert all(s.alive for s, _ in silent)  # nothing marked until declared
    assert len(detectors.declare(v, silent, 0.31)) == 6
    assert v.alive_count() == 14


def test_miss_limit_adapts_to_each_nodes_own_jitter() -> None:
    """A node whose heartbeats came with 400 ms gaps gets 2 x 400 ms (capped at 4 x the
    300 ms timeout); a steady node keeps the 300 ms limit. A node whose stream closed (a
    killed agent) gets no slack."""
    v = view(starved_hold_ms=0)
    admitted(v, req("steady"), 0.0)
    admitted(v, req("jittery"), 0.0)
    v.nodes["steady"].connected = v.nodes["jittery"].connected = True
    t = 0.0
    for _ in range(5):
        t += 0.1
        v.beat(v.nodes["steady"], dpb.Heartbeat(seq=1), t)
    v.beat(v.nodes["jittery"], dpb.Heartbeat(seq=1), 0.1)
    v.beat(v.nodes["jittery"], dpb.Heartbeat(seq=2), 0.5)  # a 400 ms gap (a loaded host)
    assert [e.node_lost.node_id for e in detectors.expired(v, 0.85)] == ["steady"]
    assert detectors.expired(v, 1.25) == []  # 750 ms silent: within 2 x 400 ms
    v.nodes["jittery"].connected = False
    assert [e.node_lost.node_id for e in detectors.expired(v, 1.25)] == ["jittery"]


def test_adaptive_miss_limit_is_capped_and_can_be_turned_off() -> None:
    v = view(jitter_k=0)
    admitted(v, req(), 0.0)
    v.beat(v.nodes["n0"], dpb.Heartbeat(seq=1), 0.1)
    v.beat(v.nodes["n0"], dpb.Heartbeat(seq=2), 5.0)  # a 4.9 s gap
    assert len(detectors.expired(v, 5.31)) == 1  # off: the fixed 300 ms
    w = view(starved_hold_ms=0)
    admitted(w, req(), 0.0)
    w.nodes["n0"].connected = True
    w.beat(w.nodes["n0"], dpb.Heartbeat(seq=1), 0.1)
    w.beat(w.nodes["n0"], dpb.Heartbeat(seq=2), 5.0)
    assert detectors.expired(w, 6.1) == []  # 1.1 s: within the cap (4 x 300 ms)
    assert len(detectors.expired(w, 6.25)) == 1  # past the cap, whatever the jitter


def test_the_live_view_pages_in_node_id_order() -> None:
    v = view()
    for n in ("n3", "n1", "n2", "n0", "n4"):
        v.mark_registered(v.slot(n), 0.0)
    assert [n.node_id for n in v.snapshot(1.0)] == ["n3", "n1", "n2", "n0", "n4"]
    pages, after = [], ""
    while True:
        page = [n.node_id for n in v.snapshot(1.0, after=after, limit=2)]
        pages.append(page)
        if len(page) < 2:
            break
        after = page[-1]
    assert pages == [["n0", "n1"], ["n2", "n3"], ["n4"]]


def _beating(v: LiveView, node: str, at: float, **starved: float) -> None:
    """A connected node whose heartbeat at `at` says how starved its agent was."""
    s = v.nodes[node]
    s.connected = True
    v.beat(s, dpb.Heartbeat(seq=s.heartbeats + 1, **starved), at)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "said",
    [
        {"loop_lag_ms": 120.0},  # its own loop woke late
        {"late_ms": 80.0},  # its heartbeat left late
        {"cpu_pressure_pct": 45.0},  # the host's PSI
        {"runnable_per_cpu": 3.0},  # a restart storm's run queue
    ],
)
def test_a_connected_node_that_said_it_was_starved_gets_the_grace(said: dict[str, float]) -> None:
    v = view(heartbeat_interval_ms=100, miss_limit=5, starved_hold_ms=2000, jitter_k=0)
    for n in ("a", "b", "c"):
        admitted(v, req(n), now=0.0)
        _beating(v, n, 0.0, **({} if n != "a" else said))
    for n in ("b", "c"):  # the others keep beating: no crowd
        _beating(v, n, 2.0)
    held: list = []
    assert detectors.silent(v, 2.0, held=held) == [] and [s.node_id for s in held] == ["a"]
    # a heartbeat within the grace keeps its place; silent past it, it is lost
    assert [s.node_id for s, _ in detectors.silent(v, 2.51)] == ["a"]


def test_an_unstarved_or_disconnected_node_is_lost_at_the_timeout() -> None:
    v = view(heartbeat_interval_ms=100, miss_limit=5, starved_hold_ms=2000, jitter_k=0)
    for n in ("a", "b", "c", "d", "e"):
        admitted(v, req(n), now=0.0)
    _beating(v, "a", 0.0, loop_lag_ms=3.0, cpu_pressure_pct=1.0, runnable_per_cpu=0.5)
    _beating(v, "b", 0.0, cpu_pressure_pct=60.0)
    v.nodes["b"].connected = False  # a killed agent: its stream closed
    for n in ("c", "d", "e"):  # the rest beat: two late of five is no crowd
        _beating(v, n, 0.55)
    assert sorted(s.node_id for s, _ in detectors.silent(v, 0.55)) == ["a", "b"]


def test_most_nodes_late_together_are_held_like_starved_ones() -> None:
    """The observer's trouble (or the network's): two of three nodes late at once."""
    v = view(heartbeat_interval_ms=100, miss_limit=5, starved_hold_ms=2000, jitter_k=0)
    for n in ("a", "b", "c"):
        admitted(v, req(n), now=0.0)
        _beating(v, n, 0.0)
    _beating(v, "c", 0.5)
    held: list = []
    assert detectors.silent(v, 0.6, held=held) == [] and len(held) == 2
    assert not detectors.late_together(view(), 0.0)
    # one late node of three is not a crowd
    _beating(v, "b", 0.6)
    assert [s.node_id for s, _ in detectors.silent(v, 0.61)] == ["a"]


def test_the_same_epoch_registering_again_is_a_reconnect_never_a_duplicate() -> None:
    """An agent whose stream broke registers again while the driver still holds the old
    stream open: it keeps its place (no event, no refusal)."""
    v = view()
    admitted(v, req(epoch=5), 0.0)
    v.nodes["n0"].connected = True
    assert detectors.admit(v, req(epoch=5), 0.05) == ("", None)


def test_starved_hold_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="late_share"):
        LiveViewConfig(late_share=0.0)
    with pytest.raises(ValueError, match="starved_hold_ms"):
        LiveViewConfig(starved_hold_ms=-1)


def test_a_connected_node_before_its_first_heartbeat_gets_the_grace() -> None:
    """Registered and connected, its first heartbeat late under load: held, not lost; the
    same node disconnected (killed before its first beat) is lost at the timeout."""
    v = view(heartbeat_interval_ms=100, miss_limit=5, starved_hold_ms=2000, jitter_k=0)
    for n in ("a", "b", "c", "d"):
        admitted(v, req(n), now=0.0)
    v.nodes["a"].connected = True  # its session is open; no heartbeat on it yet
    v.nodes["b"].connected = False
    for n in ("c", "d"):
        _beating(v, n, 0.6)
    held: list = []
    assert [s.node_id for s, _ in detectors.silent(v, 0.6, held=held)] == ["b"]
    assert [s.node_id for s in held] == ["a"]
    assert [s.node_id for s, _ in detectors.silent(v, 2.51)] == ["a", "b"]


def test_a_node_whose_stream_its_agent_closed_is_lost_at_the_closed_timeout() -> None:
    """A killed agent's stream closes at once: lost 200 ms after its last heartbeat, not
    the 500 ms timeout; one that registers again first (a reconnect) is heard then, and a
    node only disconnected (a relayed member, the driver's own ending) keeps the timeout."""
    v = view(heartbeat_interval_ms=100, miss_limit=5, starved_hold_ms=2000)
    for n in ("a", "b", "c"):
        admitted(v, req(n), now=0.0)
        _beating(v, n, 0.0)
    for n in ("a", "b"):
        v.nodes[n].connected = False
        v.mark_closed(v.nodes[n])
    v.nodes["c"].connected = False  # not closed by its side
    assert detectors.silent(v, 0.19) == []
    v.reopened(v.nodes["b"], 0.15)  # b registered again: a reconnect
    lost = detectors.expired(v, 0.21)
    assert [(e.node_lost.node_id, e.node_lost.reason) for e in lost] == [("a", "stream closed")]
    assert lost[0].node_lost.silent_ms == pytest.approx(210.0)
    assert "a" not in v.closed and detectors.expired(v, 0.3) == []  # reported once
    assert [e.node_lost.node_id for e in detectors.expired(v, 0.51)] == ["c"]
    assert [e.node_lost.node_id for e in detectors.expired(v, 0.66)] == ["b"]
    # a session or registration takes a node out of the closed set; 0 turns the rule off
    d = view(heartbeat_interval_ms=100, miss_limit=5, closed_timeout_ms=0)
    admitted(d, req("a"), now=0.0)
    d.mark_closed(d.nodes["a"])
    assert detectors.silent(d, 0.45) == [] and len(detectors.silent(d, 0.51)) == 1
    d.mark_alive(d.nodes["a"], 0.6)
    assert not d.closed
    with pytest.raises(ValueError, match="closed_timeout_ms"):
        LiveViewConfig(heartbeat_interval_ms=100, closed_timeout_ms=50)
