"""Which step errors a worker reads as a peer's failure (it leaves the world and is kept) and
which are its own (it exits): the texts are the ones torch really raises on CPU with gloo."""

from __future__ import annotations

import pytest

from unbroken.trainer.rejoin import peer_failure

pytestmark = pytest.mark.unit

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:17303: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)


def _raise_wrapped() -> None:
    # what torch.distributed.pipelining's stage_backward does with a collective's error
    try:
        raise RuntimeError(GLOO_RESET)
    except RuntimeError as e:
        raise RuntimeError(
            "\n        Failed to run stage backward:\n        Stage output: ..."
        ) from e


def test_a_gloo_reset_is_a_peer_failure() -> None:
    assert peer_failure(RuntimeError(GLOO_RESET))


def test_a_peer_failure_wrapped_by_pipelining_is_still_one() -> None:
    """A dp1×pp2×tp2 drill: the rank whose tp peer was killed failed inside pipelining's
    backward, which re-raises a bare RuntimeError from the gloo error; the worker exited and
    the whole world restarted instead of recovering in the job."""
    with pytest.raises(RuntimeError) as info:
        _raise_wrapped()
    assert "Connection reset" not in str(info.value)
    assert peer_failure(info.value)


def test_an_error_raised_while_handling_a_peer_failure_is_one() -> None:
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError:
            raise ValueError("cleanup failed") from None
    except ValueError as e:
        # `from None` hides the context from tracebacks, but it is still the peer's failure
        assert peer_failure(e)


def test_own_errors_are_not_peer_failures() -> None:
    assert not peer_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not peer_failure(ValueError("loss is nan"))
    try:
        try:
            raise KeyError("x")
        except KeyError as e:
            raise RuntimeError("Failed to run stage backward") from e
    except RuntimeError as e:
        assert not peer_failure(e)


def test_a_cycle_in_the_chain_ends() -> None:
    a = RuntimeError("a")
    b = RuntimeError("b")
    a.__cause__ = b
    b.__cause__ = a
    assert not peer_failure(a)
