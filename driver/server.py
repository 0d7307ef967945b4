"""The driver's gRPC server: the service, health, reflection, credentials and interceptors.

`build_server` starts a grpc.aio server carrying a `DriverService`. Health says SERVING for
the agents' service on every driver (an agent may stream to a standby and be sent to the
leader), and SERVING for the plain check and `LEADER_HEALTH` on the leader only, so a load
balancer's or Kubernetes' probe finds the driver that answers operators and launchers.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from unbroken.common import channel
from unbroken.common.serving import MalformedRequests
from unbroken.common.tls import server_credentials
from unbroken.driver.security import AuthInterceptor
from unbroken.proto import driver_pb2_grpc as dgrpc

if TYPE_CHECKING:  # the service module re-exports build_server: only the type is needed
    from unbroken.driver.service import DriverService

SERVICE_NAME = "unbroken.driver.v1.Driver"
LEADER_HEALTH = "unbroken.driver.v1.Driver.leader"  # health: SERVING on the leader only
LEADER_HEALTH_NAMES = ("", LEADER_HEALTH)  # the plain check too: load balancers ask it


async def build_server(
    service: DriverService, listen: str
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A started grpc.aio server carrying `service`, health and (optionally) reflection.

    Returns:
        The server, the bound port (listen on port 0 to pick a free one) and the health
        servicer (set NOT_SERVING when stepping down).
    """
    cfg = service.config
    # without any credential every caller is `*:anonymous` (the CALLER default): no
    # authentication; main.py refuses that beyond loopback unless --insecure. Malformed
    # request bytes get INVALID_ARGUMENT, checked after authentication (innermost).
    interceptors: list[grpc.aio.ServerInterceptor] = (
        [AuthInterceptor(cfg.tokens, tls=cfg.tls.enabled)] if cfg.tokens or cfg.tls.enabled else []
    )
    interceptors.append(MalformedRequests())
    options = [
        *channel.SERVER_OPTIONS,
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    dgrpc.add_DriverServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if cfg.reflection:
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    if cfg.tls.enabled:
        port = server.add_secure_port(listen, server_credentials(cfg.tls))
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise ValueError(f"could not bind the driver's gRPC port {listen!r}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await _set_leader_health(health_servicer, service.leader)
    service._tasks.append(asyncio.create_task(_leader_health(service, health_servicer)))
    return server, port, health_servicer


async def _set_leader_health(servicer: health.aio.HealthServicer, leading: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if leading
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in LEADER_HEALTH_NAMES:
        await servicer.set(name, status)


async def _leader_health(service: DriverService, servicer: health.aio.HealthServicer) -> None:
    """The plain health check ("", what a load balancer's or Kubernetes' gRPC probe asks by
    default) and `LEADER_HEALTH` are SERVING on the leader only: the check finds the driver
    that answers operator and launcher calls. Every driver serves agents: SERVICE_NAME is
    SERVING on standbys too (an agent may stream to any driver)."""
    leading = service.leader
    while True:
        if service.leader != leading:
            leading = service.leader
            await _set_leader_health(servicer, leading)
        await asyncio.sleep(0.2)
