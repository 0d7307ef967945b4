"""`unbroken.common.aio.wait_for`: a cancel that lands as the awaited thing completes is
not lost (Python 3.11's `asyncio.wait_for` returns the result instead; a standby driver's
campaign hung for good on it), and a campaign's leader watch is bounded even when one of
its tasks ignores its cancel."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from unbroken.common import aio
from unbroken.driver.election import Election

pytestmark = pytest.mark.unit


async def _cancelled_as_it_completes(wait_for: object) -> str:
    """Run `await wait_for(f, 10)` in a task; in one loop callback complete `f` and cancel
    the task. 'cancelled' when the cancel reached the task, else what it returned."""
    loop = asyncio.get_running_loop()
    f: asyncio.Future[int] = loop.create_future()

    async def waiter() -> str:
        r = await wait_for(f, 10)  # type: ignore[operator]
        return f"returned {r}"

    t = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # the task now waits on f

    def both() -> None:
        f.set_result(1)
        t.cancel()

    loop.call_soon(both)
    try:
        return await t
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancel_landing_as_the_awaited_future_completes_reaches_the_task() -> None:
    assert asyncio.run(_cancelled_as_it_completes(aio.wait_for)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's asyncio.wait_for is fixed")
def test_the_standard_library_on_3_11_loses_that_cancel() -> None:
    """Why the helper exists: this is the behaviour it replaces (gh-86296)."""
    std = getattr(asyncio, "wait_for")  # noqa: B009 - banned in the package, shown here
    assert asyncio.run(_cancelled_as_it_completes(std)) == "returned 1"


def test_a_timeout_raises_and_cancels_the_awaited_future() -> None:
    async def go() -> asyncio.Future[None]:
        f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await aio.wait_for(f, 0.01)
        return f

    assert asyncio.run(go()).cancelled()


def test_a_coroutine_runs_in_the_callers_task_and_no_timeout_waits() -> None:
    async def go() -> tuple[bool, int]:
        me = asyncio.current_task()

        async def inner() -> asyncio.Task[object] | None:
            return asyncio.current_task()

        same = await aio.wait_for(inner(), 1.0) is me
        return same, await aio.wait_for(asyncio.sleep(0, 7), None)

    assert asyncio.run(go()) == (True, 7)


class _StubbornProbe(Election):
    """An election whose watch round ends at once and whose leader prober ignores every
    cancel (what 3.11's `wait_for` made of the real prober now and then)."""

    async def _wait_deleted(self, start_revision: int, timeout_s: float) -> None:
        await asyncio.sleep(0.01)

    released = False  # then it takes the next cancel (so the test's loop can close)

    async def _revoke_if_dead(self) -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if self.released:
                    raise


def test_a_watch_task_that_ignores_its_cancel_does_not_hold_the_campaign() -> None:
    async def go() -> float:
        e = _StubbornProbe(
            None,  # type: ignore[arg-type]  # no etcd call is made: both tasks are replaced
            "job",
            "d",
            probe_leader=True,
            op_timeout_s=0.2,
        )
        t0 = time.monotonic()
        await aio.wait_for(e._wait_leader_gone(1, 1.0), 5.0)
        took = time.monotonic() - t0
        left = asyncio.all_tasks() - {asyncio.current_task()}
        assert len(left) == 1, left  # the stubborn prober, left behind
        e.released = True
        for t in left:
            t.cancel()
        await asyncio.wait(left, timeout=1.0)
        return took

    assert asyncio.run(go()) < 2.0
