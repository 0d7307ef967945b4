"""Every RPC of the Driver service is answered by one handler object (driver/service.py)."""

from __future__ import annotations

import inspect

import pytest

from unbroken.driver.config import ServiceConfig
from unbroken.driver.service import DriverService
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit


def test_each_rpc_reaches_a_handler_that_answers_it() -> None:
    service = DriverService(ServiceConfig(), driver_id="d", job_id="j")
    rpcs = [m.name for m in dpb.DESCRIPTOR.services_by_name["Driver"].methods]
    assert len(rpcs) >= 16, rpcs
    handlers = {"agents": service.agents, "operators": service.operators}
    handlers["launchers"] = service.launchers
    answered = {}
    for name in rpcs:
        rpc = getattr(type(service), name)
        assert inspect.iscoroutinefunction(rpc), name
        owners = [
            h
            for h, obj in handlers.items()
            if inspect.iscoroutinefunction(getattr(obj, name, None))
        ]
        assert len(owners) == 1, (name, owners)
        cells = dict(zip(rpc.__code__.co_freevars, rpc.__closure__ or (), strict=True))
        assert cells["handler"].cell_contents == owners[0], name  # delegated to its owner
        assert cells["name"].cell_contents == name
        answered[name] = owners[0]
    assert {answered[n] for n in ("Register", "Session", "LiveView")} == {"agents"}
    assert answered["Evict"] == "operators" and answered["RegisterJob"] == "launchers"
