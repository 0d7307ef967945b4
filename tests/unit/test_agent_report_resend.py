"""Shard reports survive a change of leader (SECURITY.md, reports): the newest reports an
agent already sent go again, signed with the new session's key, after it registers anew.
A report in flight when the leader changed was lost with the old leader or refused by the
new one (signed with a key only the old leader knew)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from unbroken.agent.config import AgentConfig
from unbroken.agent.daemon import Agent
from unbroken.agent.flash import NodeFlash, NodeFlashConfig
from unbroken.common import reportmac
from unbroken.proto import driver_pb2 as dpb
from unbroken.recovery.persist import Persisted

pytestmark = pytest.mark.unit


class _Stream:
    def __init__(self) -> None:
        self.sent: list[dpb.AgentMessage] = []

    async def write(self, msg: dpb.AgentMessage) -> None:
        self.sent.append(msg)


def _shards(agent: Agent, msg: dpb.AgentMessage) -> list[tuple[int, int]]:
    got = reportmac.verify(agent.report_key, agent.epoch, msg.signed_report)
    assert got is not None, "the report does not verify under the session's key"
    return [(s.step, s.rank) for s in got.shards]


def test_reports_sent_before_a_new_registration_go_again_under_the_new_key(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "flash")
    agent = Agent(AgentConfig(drivers=["127.0.0.1:1"], node_id="n0"))
    flash = NodeFlash(NodeFlashConfig(root=root, job="resend", node="n0"), 2)
    agent.flash = flash
    old_key = secrets.token_bytes(reportmac.KEY_BYTES)
    agent._registered(dpb.RegisterResponse(report_key=old_key), "leader-a", "")
    for step in (10, 11):
        for rank in (0, 1):
            flash.reports.append(Persisted(rank, step, f"file:///c/{step}/{rank}", 8, step))

    async def report(stream: _Stream) -> None:
        await agent._report_shards(stream, flash)

    first = _Stream()
    asyncio.run(report(first))
    assert [_shards(agent, m) for m in first.sent] == [[(10, 0), (10, 1), (11, 0), (11, 1)]]
    assert not flash.reports
    # the leader fails over; the new one hands out another key
    new_key = secrets.token_bytes(reportmac.KEY_BYTES)
    agent._registered(dpb.RegisterResponse(report_key=new_key), "leader-b", "")
    flash.reports.append(Persisted(0, 12, "file:///c/12/0", 8, 12))  # not sent yet
    second = _Stream()
    asyncio.run(report(second))
    (msg,) = second.sent
    assert reportmac.verify(old_key, agent.epoch, msg.signed_report) is None
    # the sent ones first, then the new one, each once
    assert _shards(agent, msg) == [(10, 0), (10, 1), (11, 0), (11, 1), (12, 0)]
    # a session that ends before anything new is sent: the same reports go again, not twice
    agent._registered(dpb.RegisterResponse(report_key=new_key), "leader-b", "")
    agent._registered(dpb.RegisterResponse(report_key=new_key), "leader-b", "")
    third = _Stream()
    asyncio.run(report(third))
    assert [len(_shards(agent, m)) for m in third.sent] == [5]
