"""The plain gRPC health check finds the leader: two real `unbroken driver` processes.

A load balancer's (or Kubernetes') gRPC probe asks the health service with the empty
service name. Only the leader answers SERVING to it (and to the leader-only name); a
standby answers NOT_SERVING there and SERVING to the driver service's own name (every
driver serves agents). When the leader dies, the standby that takes over turns SERVING.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from unbroken.cli.cluster import LocalCluster, until
from unbroken.driver.service import LEADER_HEALTH, SERVICE_NAME

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _status(address: str, name: str) -> int:
    with grpc.insecure_channel(address) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=name), timeout=10
        )
    return int(r.status)


def test_a_standby_is_not_serving_on_the_plain_health_check(
    tmp_path: Path, etcd_server: object
) -> None:
    c = LocalCluster(
        tmp_path,
        etcd=etcd_server.endpoint,  # type: ignore[attr-defined]
        driver_args=["--etcd-lease-ttl-s", "2"],
    )
    try:
        leader = c.start_driver("d1")
        until(lambda: _status(leader, "") == SERVING, 60, "d1 to lead", c)
        standby = c.start_driver("d2")
        time.sleep(1.0)  # past the standby's first health update (0.2 s)
        assert _status(standby, "") == NOT_SERVING
        assert _status(standby, LEADER_HEALTH) == NOT_SERVING
        assert _status(standby, SERVICE_NAME) == SERVING  # agents may stream to it
        assert _status(leader, "") == SERVING and _status(leader, LEADER_HEALTH) == SERVING

        c.kill("d1")  # SIGKILL: the standby leads once the lease expires
        until(lambda: _status(standby, "") == SERVING, 60, "d2 to take over", c)
        assert _status(standby, LEADER_HEALTH) == SERVING
    finally:
        c.stop()
