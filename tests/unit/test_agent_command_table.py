"""The agent's command table (agent/commands.py): every command has one handler, and each is
answered as its handler declares."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from unbroken.agent.commands import COMMANDS, Reply
from unbroken.agent.config import AgentConfig
from unbroken.agent.daemon import Agent
from unbroken.agent.launch import WorkerSpec
from unbroken.common.workerenv import RESTORE_STEP
from unbroken.driver.etcd import free_port
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit

# Handled by the session itself: a relay's members' messages, not a command to this node.
NOT_COMMANDS = {"relayed", "relayed_batch"}


class _Stream:
    """The agent side of a session stream: what the agent writes back."""

    def __init__(self) -> None:
        self.sent: list[dpb.AgentMessage] = []

    async def write(self, msg: dpb.AgentMessage) -> None:
        self.sent.append(msg)


def test_every_driver_command_has_exactly_one_handler() -> None:
    kinds = {f.name for f in dpb.DriverMessage.DESCRIPTOR.oneofs_by_name["kind"].fields}
    assert set(COMMANDS) == kinds - NOT_COMMANDS
    # the replies a handler can declare are the AgentMessage fields that answer a command
    answers = {f.name for f in dpb.AgentMessage.DESCRIPTOR.fields}
    assert {r.value for r in Reply} <= answers


def _answers(*msgs: dpb.DriverMessage) -> list[dpb.AgentMessage]:
    async def go() -> list[dpb.AgentMessage]:
        agent = Agent(AgentConfig(drivers=["127.0.0.1:1"], node_id="node-a"))
        stream = _Stream()
        for m in msgs:
            await agent._command(stream, m)
        return stream.sent

    return asyncio.run(go())


def test_an_agent_without_workers_refuses_worker_commands_and_says_why() -> None:
    sent = _answers(
        dpb.DriverMessage(command_id="c1", restore_point=dpb.RestorePoint(step=3)),
        dpb.DriverMessage(command_id="c2", resume=dpb.Resume(at_step=4)),
        dpb.DriverMessage(command_id="c3", retention=dpb.Retention(keep_steps=[1])),
        dpb.DriverMessage(command_id="c4", ring_keep=dpb.RingKeep(steps=[5])),
    )
    assert [m.WhichOneof("kind") for m in sent] == ["ack", "ack", "ack", "ack"]
    refused = sent[0].ack
    assert refused.command_id == "c1" and not refused.ok
    assert "restore_point: this agent runs no workers (no --worker-cmd)" in refused.detail
    assert not sent[1].ack.ok and "resume: this agent runs no workers" in sent[1].ack.detail
    # retention needs no workers: a node without a flash store says so and succeeds
    assert sent[2].ack.ok and sent[2].ack.detail == "retention: no flash store"
    assert sent[3].ack.ok and sent[3].ack.detail == "ring keep: no flash store"


def test_a_message_without_a_command_is_refused_as_unknown() -> None:
    (sent,) = _answers(dpb.DriverMessage(command_id="c1"))
    assert not sent.ack.ok and "unknown command None" in sent.ack.detail


def test_a_restore_point_right_before_a_start_is_the_start_s(tmp_path: Path) -> None:
    # the driver sends a node its RestorePoint and its StartWorkers back to back, without
    # waiting for the first reply (driver/fanout.py `Fanout.start`): the agent runs each
    # command in a task of its own, in the order they came, and the worker it starts
    # must see the point
    seen = tmp_path / "restore_step"
    cmd = [
        sys.executable,
        "-c",
        f"import os; open({str(seen)!r}, 'w').write(os.environ[{RESTORE_STEP!r}])",
    ]

    async def go() -> list[dpb.AgentMessage]:
        spec = WorkerSpec(cmd=cmd, log_dir=str(tmp_path))
        agent = Agent(
            AgentConfig(
                drivers=["127.0.0.1:1"],
                node_id="node-a",
                workers=spec,
                socket_path=str(tmp_path / "agent.sock"),
            )
        )
        assert agent.supervisor is not None
        stream = _Stream()
        point = dpb.RestorePoint(step=7)
        agent._spawn(
            agent._command(stream, dpb.DriverMessage(command_id="c1", restore_point=point))
        )
        start = dpb.StartWorkers(world_size=1, master_port=free_port())
        agent._spawn(
            agent._command(stream, dpb.DriverMessage(command_id="c2", start_workers=start))
        )
        while len(stream.sent) < 2:
            await asyncio.sleep(0.01)
        for _ in range(500):
            if seen.exists() and seen.read_text():
                break
            await asyncio.sleep(0.01)
        await agent.supervisor.stop_all(grace_s=1.0)
        return stream.sent

    sent = asyncio.run(go())
    assert [m.ack.ok for m in sent] == [True, True], sent
    assert seen.read_text() == "7"
