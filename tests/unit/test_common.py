"""The common part: the worker environment contract, token and TLS loading, fault files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken.common import workerenv
from unbroken.common.channel import endpoint_is_loopback, is_loopback
from unbroken.common.faults import WorkerFault, parse_slow_factor, write_slow_factor
from unbroken.common.tls import MIN_TOKEN, TlsConfig, read_token, token_metadata
from unbroken.common.workerenv import WorkerEnv

pytestmark = pytest.mark.unit

counts = st.none() | st.integers(min_value=1, max_value=10_000)
texts = st.text(st.characters(codec="ascii", exclude_characters="\x00"), max_size=20).map(str.strip)


@given(
    agent_socket=texts,
    agent_pid=counts,
    restore_step=st.none() | st.integers(min_value=0, max_value=10**9),
    skip=st.none() | st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)),
    timeline=st.none() | st.integers(min_value=0, max_value=100),
    persist=st.none() | st.floats(min_value=0.001, max_value=1e6),
    copies=st.none() | st.integers(min_value=0, max_value=8),
    dp=counts,
    tp=counts,
)
def test_worker_env_round_trips(
    agent_socket: str,
    agent_pid: int | None,
    restore_step: int | None,
    skip: tuple[int, int] | None,
    timeline: int | None,
    persist: float | None,
    copies: int | None,
    dp: int | None,
    tp: int | None,
) -> None:
    env = WorkerEnv(
        agent_socket=agent_socket,
        agent_pid=agent_pid,
        restore_step=restore_step,
        skip_batches=skip,
        timeline=timeline,
        persist_every_s=persist,
        flash_copies=copies,
        dp=dp,
        tp=tp,
    )
    written = env.to_env()
    assert all(k.startswith("UNBROKEN_") for k in written)
    assert WorkerEnv.from_env({**written, "PATH": "/bin"}) == env


def test_worker_env_names_a_malformed_variable() -> None:
    assert WorkerEnv.from_env({}) == WorkerEnv()
    for var, raw in (
        (workerenv.RESTORE_STEP, "-1"),
        (workerenv.SKIP_BATCHES, "200"),
        (workerenv.DP, "0"),
        (workerenv.DP, "two"),
        (workerenv.PERSIST_EVERY_S, "inf"),
        (workerenv.AGENT_PID, "x"),
    ):
        with pytest.raises(ValueError, match=var):
            WorkerEnv.from_env({var: raw})


def test_worker_env_variables_cover_every_field() -> None:
    import dataclasses

    assert [f.name for f in dataclasses.fields(WorkerEnv)] == list(workerenv.VARIABLES)
    assert len(set(workerenv.VARIABLES.values())) == len(workerenv.VARIABLES)


def test_read_token_enforces_the_minimum_everywhere(tmp_path: Path) -> None:
    short = "x" * (MIN_TOKEN - 1)
    with pytest.raises(ValueError, match=f"{MIN_TOKEN} characters"):
        read_token(short, None)
    f = tmp_path / "t"
    f.write_text(f"# a comment\n\n{short} node-a\n")
    f.chmod(0o600)  # token files must be private
    with pytest.raises(ValueError, match=f"{MIN_TOKEN} characters"):
        read_token(None, str(f))
    good = "y" * MIN_TOKEN
    f.write_text(f"# a comment\n{good} node-a\n")
    f.chmod(0o600)  # token files must be private
    assert read_token("ignored-because-the-file-wins", str(f)) == good
    assert read_token(None, None) is None
    with pytest.raises(ValueError, match="does not exist"):
        read_token(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--token is gone"):
        read_token(None, None, argv_token=good)
    assert token_metadata(good) == (("authorization", f"Bearer {good}"),)
    assert token_metadata(None) == ()


def test_tls_config_is_all_three_files_or_none(tmp_path: Path) -> None:
    assert not TlsConfig().enabled
    with pytest.raises(ValueError, match="given together"):
        TlsConfig(cert="/x")
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig(cert="/nx", key="/nx", ca="/nx")
    for name in ("c", "k", "a"):
        (tmp_path / name).write_text("pem")
    tls = TlsConfig(cert=str(tmp_path / "c"), key=str(tmp_path / "k"), ca=str(tmp_path / "a"))
    assert tls.enabled


def test_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.org")
    assert endpoint_is_loopback("127.0.0.2:50051") and not endpoint_is_loopback("h:1")


def test_worker_fault_file_round_trips(tmp_path: Path) -> None:
    f = WorkerFault("loss-spike", 7, "abc")
    f.write(tmp_path / "fault.json")
    assert WorkerFault.parse((tmp_path / "fault.json").read_text()) == f
    write_slow_factor(tmp_path / "slow.json", 2.5)
    assert parse_slow_factor((tmp_path / "slow.json").read_text()) == 2.5
    with pytest.raises(ValueError, match="finite"):
        write_slow_factor(tmp_path / "slow.json", 0.5)
