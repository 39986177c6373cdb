"""The rank runner's time-out says what it measured: ranks that wait on nothing are told apart from ranks
still computing on a loaded machine (the suite at load 7-14 called slow ranks "a hang")."""

import time

import pytest
from helpers import spawn_ranks


def _waiting_rank(rank: int) -> None:
    time.sleep(600)


def _computing_rank(rank: int) -> None:
    end = time.monotonic() + 600
    while time.monotonic() < end:
        sum(range(10_000))


@pytest.mark.slow
def test_ranks_that_wait_are_called_a_hang_and_ranks_that_compute_are_not():
    with pytest.raises(TimeoutError, match=r"none computed in the last 10 s.*\(a hang\).*load average"):
        spawn_ranks(_waiting_rank, (), world=2, what="sleeping", timeout_s=20)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still computing .* not a hang.*CPU time: rank 0"):
        spawn_ranks(_computing_rank, (), world=1, what="spinning", timeout_s=5)
    assert time.monotonic() - started >= 15  # given three times its limit while it computed
