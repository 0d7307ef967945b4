"""A `DriverService` leading on a real etcd, as `unbroken driver` builds it, for tests.

An `Election` and an `EtcdEventLog` on the session's etcd, the service's gRPC server on a
free port.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from unbroken.driver.election import Election
from unbroken.driver.etcdlog import EtcdEventLog, connect
from unbroken.driver.journal import Journal
from unbroken.driver.service import DriverService, ServiceConfig, build_server


@contextlib.asynccontextmanager
async def leading(
    etcd: Any, archive: Path, config: ServiceConfig | None = None
) -> AsyncIterator[tuple[DriverService, Journal, str, EtcdEventLog]]:
    job = f"journal-{uuid.uuid4().hex[:8]}"
    client = await connect(etcd.config)
    election = Election(client, job, "d1", ttl_s=10)
    elog = EtcdEventLog(
        client, job, await election.campaign(timeout_s=10), archive_url=str(archive)
    )
    svc = DriverService(config or ServiceConfig(), driver_id="d1", job_id=job)
    journal = svc.lead(elog, "127.0.0.1:0", await elog.replay())
    svc.start()
    server, port, _ = await build_server(svc, "127.0.0.1:0")
    try:
        yield svc, journal, f"127.0.0.1:{port}", elog
    finally:
        await server.stop(0)
        await svc.close()
        await elog.close()
        await election.resign()
        await client.close()
