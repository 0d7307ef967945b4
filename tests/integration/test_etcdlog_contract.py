"""The shared EventLog contract suite, run against `EtcdEventLog` on a real embedded etcd.

Each test gets its own job (key prefix) on the session's etcd, a real election for its
leader, and its own archive directory, so archival and trimming run for real.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.unit.test_eventlog_contract import SNAPSHOT_EVERY, Env, EventLogContract
from unbroken.driver.election import Election
from unbroken.driver.etcd import EmbeddedEtcd
from unbroken.driver.etcdlog import EtcdEventLog, connect
from unbroken.driver.eventlog import EventLog

pytestmark = pytest.mark.integration


class _EtcdEnv(Env):
    def __init__(self, client: object, job: str, archive: str) -> None:
        self.client = client
        self.job = job
        self.archive = archive
        self.elections: list[Election] = []
        self.logs: list[EtcdEventLog] = []

    def _open(self, leadership: object) -> EtcdEventLog:
        log = EtcdEventLog(
            self.client,
            self.job,
            leadership,  # type: ignore[arg-type]
            snapshot_every=SNAPSHOT_EVERY,
            archive_url=self.archive,
        )
        self.logs.append(log)
        return log

    async def lead(self, driver_id: str) -> EtcdEventLog:
        e = Election(self.client, self.job, driver_id)  # type: ignore[arg-type]
        self.elections.append(e)
        return self._open(await e.campaign(timeout_s=10))

    async def new_leader(self) -> EventLog:
        await self.elections[-1].resign()
        return await self.lead(f"d{len(self.elections) + 1}")

    def reader(self) -> EventLog:
        return self._open(None)

    async def close(self) -> None:
        for log in self.logs:
            await log.close()
        for e in self.elections:
            await e.resign()


class TestEtcdEventLog(EventLogContract):
    @pytest.fixture(autouse=True)
    def _etcd(self, etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
        self.etcd = etcd_server
        self.tmp = tmp_path

    @contextlib.asynccontextmanager
    async def env(self) -> AsyncIterator[Env]:
        client = await connect(self.etcd.config)
        env = _EtcdEnv(client, "job-" + uuid.uuid4().hex[:8], str(self.tmp / "archive"))
        try:
            env.log = await env.lead("d1")
            yield env
        finally:
            await env.close()
            await client.close()
