"""What a relay forwards per interval (agent/relay.py `Relay.batch`): news in full, the rest
as ids, silence at the timeout, everything in full every `full_every` batches."""

from __future__ import annotations

import pytest

from unbroken.agent.relay import Member, Relay, RelayConfig, parse_relay, signature
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit


def beat(step: int, flags: int = 0) -> dpb.Heartbeat:
    hb = dpb.Heartbeat(flags=flags)
    hb.workers.add(local_rank=0, state=dpb.WORKER_STATE_RUNNING, step=step)
    return hb


def member(relay: Relay, node: str, hb: dpb.Heartbeat, seen: float) -> Member:
    m = relay.members[node] = Member(node, 7)
    m.hb, m.sig, m.last_seen = hb, signature(hb), seen
    return m


def test_news_in_full_the_rest_as_ids_silence_at_the_timeout() -> None:
    r = Relay(RelayConfig(listen="127.0.0.1:0", full_every=3), "r0", 0.1)
    a = member(r, "a", beat(1), 10.0)
    member(r, "b", beat(1, flags=dpb.HEARTBEAT_FLAG_WORKER_EXITED), 10.0)
    member(r, "gone", beat(1), 9.0)  # silent 1 s > 3 x 100 ms
    own = dpb.Heartbeat(seq=5)
    b = r.batch(10.05, own=own)
    assert b.own.seq == 5
    assert sorted(x.node_id for x in b.beats) == ["a", "b"]  # first sight, and a flag
    assert [(s.node_id, s.epoch) for s in b.silent] == [("gone", 7)]
    assert b.silent[0].silent_ms == pytest.approx(1050.0)
    assert "gone" not in r.members

    assert b.group_alive and not b.late

    # same step again: named nowhere, the group's vouch covers it (b sent nothing: late)
    a.hb, a.last_seen, a.fresh = beat(1), 10.1, True
    b2 = r.batch(10.15, own=own)
    assert b2.group_alive and not b2.alive and not b2.beats
    assert [x.node_id for x in b2.late] == ["b"]
    # a new step is news
    a.hb, a.sig = beat(2), signature(beat(2))
    b3 = r.batch(10.2, own=own)  # (the 3rd periodic batch: full anyway)
    assert [x.node_id for x in b3.beats] == ["a"]
    a.hb = beat(2)
    assert not r.batch(10.25, own=own).alive


def test_a_member_whose_stream_closed_is_silent_after_the_closed_timeout() -> None:
    """A killed member's stream closes at once: the relay reports it after the driver's
    closed timeout (RegisterResponse.closed_timeout_ms), not the whole timeout; one whose
    stream is still open (a hung host) keeps the timeout; 0 or more than the timeout: the
    timeout for both."""
    r = Relay(RelayConfig(listen="127.0.0.1:0"), "r0", 0.1)
    r.closed_timeout_s = 0.2
    assert r.timeouts() == pytest.approx((0.3, 0.2))
    member(r, "open", beat(1), 10.0)
    member(r, "closed", beat(1), 10.0).closed = True
    assert [s.node_id for s in r.batch(10.15).silent] == []
    assert [s.node_id for s in r.batch(10.21).silent] == ["closed"]
    assert "closed" not in r.members and "open" in r.members
    assert [s.node_id for s in r.batch(10.31).silent] == ["open"]
    for setting in (0.0, 0.5):
        r.closed_timeout_s = setting
        assert r.timeouts() == pytest.approx((0.3, 0.3))


def test_a_vouched_member_without_a_beat_is_named_late_then_once_alive_again() -> None:
    """The periodic batch vouches for the members it named before; one that sent nothing
    this interval is named late (the driver tracks it alone) and, when it beats again,
    named once in `alive`; a beat a between-batches flush forwarded still counts."""
    r = Relay(RelayConfig(listen="127.0.0.1:0", full_every=100), "r0", 0.1)
    own = dpb.Heartbeat(seq=1)
    a = member(r, "a", beat(1), 10.0)
    r.batch(10.0, own=own)
    assert a.vouched
    b = r.batch(10.1, own=own)  # no heartbeat since the last periodic batch
    assert [(x.node_id, x.epoch) for x in b.late] == [("a", 7)]
    assert b.late[0].silent_ms == pytest.approx(100.0)
    assert not a.vouched
    assert not r.batch(10.2, own=own).late  # named late once
    a.hb, a.last_seen, a.fresh = beat(1), 10.21, True
    b = r.batch(10.3, own=own)
    assert list(b.alive) == ["a"] and a.vouched
    # a beat the flush took (flags elsewhere in the group) is a beat this interval
    a.hb, a.last_seen, a.fresh = beat(1), 10.35, True
    flush = r.batch(10.36)
    assert not flush.group_alive and not flush.alive and not flush.late
    b = r.batch(10.4, own=own)
    assert not b.late and not b.alive and b.group_alive
    assert r.forwarded == 3  # each of a's three heartbeats went up: named or vouched for


def test_every_full_every_th_batch_carries_everyone_in_full() -> None:
    r = Relay(RelayConfig(listen="127.0.0.1:0", full_every=2), "r0", 0.1)
    m = member(r, "a", beat(1), 1.0)
    r.batch(1.0, own=dpb.Heartbeat())
    m.hb = beat(1)
    assert [x.node_id for x in r.batch(1.05, own=dpb.Heartbeat()).beats] == ["a"]


def test_relay_flags_are_checked() -> None:
    assert parse_relay("r0@10.0.0.5:7000") == ("r0", "10.0.0.5:7000")
    for bad in ("10.0.0.5:7000", "r0@", "@h:1", "r0@host"):
        with pytest.raises(ValueError, match="ID@HOST:PORT"):
            parse_relay(bad)
    with pytest.raises(ValueError, match="host:port"):
        RelayConfig(listen="7000")


def test_agent_relay_flags() -> None:
    from unbroken.agent.config import AgentConfig

    with pytest.raises(ValueError, match="names this node itself"):
        AgentConfig(drivers=["127.0.0.1:1"], node_id="n0", relay="n0@127.0.0.1:7000")
    with pytest.raises(ValueError, match="exclude each other"):
        AgentConfig(
            drivers=["127.0.0.1:1"], node_id="n0", relay="r0@127.0.0.1:7000", relay_listen=":1"
        )
    with pytest.raises(ValueError, match="cleartext to the relay"):
        AgentConfig(drivers=["127.0.0.1:1"], node_id="n0", relay="r0@10.0.0.5:7000", token="x" * 32)


@pytest.mark.parametrize("batch_up", [True, False])
def test_members_replies_go_up_together_to_a_driver_that_takes_batches(batch_up: bool) -> None:
    """Replies that arrive together go up as one RelayedUpBatch, in order, when the driver
    said it takes them (`RegisterResponse.relay_batches`); one by one to one that did not.
    A lone reply goes as itself."""
    import asyncio

    sent: list[dpb.AgentMessage] = []

    async def send(msg: dpb.AgentMessage) -> None:
        sent.append(msg)

    async def go() -> None:
        r = Relay(RelayConfig(listen="127.0.0.1:0"), "r0", 0.1)
        r.batch_up = batch_up
        task = asyncio.create_task(r._send_ups(send))
        for i in range(10):
            ack = dpb.AgentMessage(ack=dpb.CommandAck(command_id=f"c{i}", ok=True))
            await r.ups.put(dpb.RelayedUp(node_id=f"m{i}", epoch=7, message=ack))
        await asyncio.sleep(0.05)
        await r.ups.put(dpb.RelayedUp(node_id="m0", epoch=7))
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(go())
    ups = [
        list(m.relayed_batch.up) if m.WhichOneof("kind") == "relayed_batch" else [m.relayed]
        for m in sent
    ]
    assert [u.node_id for group in ups for u in group] == [f"m{i}" for i in range(10)] + ["m0"]
    if batch_up:
        assert [len(g) for g in ups] == [10, 1] and sent[1].WhichOneof("kind") == "relayed"
    else:
        assert len(sent) == 11 and all(m.WhichOneof("kind") == "relayed" for m in sent)
