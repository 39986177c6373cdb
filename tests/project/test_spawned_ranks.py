"""The rank runner's time-out says what it measured: ranks that wait on nothing are told apart from ranks
still computing on a loaded machine (the suite at load 7-14 called slow ranks "a hang"); a rank killed by a
signal (an abort in C++, which CI once reported as nothing but "SIGABRT") says what it printed and where
its Python was."""

import os
import sys
import time

import pytest
from helpers import spawn_ranks


def _waiting_rank(rank: int) -> None:
    time.sleep(600)


def _computing_rank(rank: int) -> None:
    end = time.monotonic() + 600
    while time.monotonic() < end:
        sum(range(10_000))


def _aborting_rank(rank: int) -> None:
    if rank == 1:
        print("rank 1 is about to abort", file=sys.stderr)
        os.abort()
    time.sleep(60)


@pytest.mark.slow  # starts processes
def test_a_rank_killed_by_a_signal_says_what_it_printed_and_where_it_was():
    said = r"(?s)process 1 terminated with signal SIGABRT.*about to abort"
    with pytest.raises(AssertionError, match=said) as e:
        spawn_ranks(_aborting_rank, (), world=2, what="aborting")
    assert "in _aborting_rank" in str(e.value)  # faulthandler's stack of the aborted rank


@pytest.mark.slow
def test_ranks_that_wait_are_called_a_hang_and_ranks_that_compute_are_not():
    with pytest.raises(TimeoutError, match=r"none computed in the last 10 s.*\(a hang\).*load average"):
        spawn_ranks(_waiting_rank, (), world=2, what="sleeping", timeout_s=20)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still computing .* not a hang.*CPU time: rank 0"):
        spawn_ranks(_computing_rank, (), world=1, what="spinning", timeout_s=5)
    assert time.monotonic() - started >= 15  # given three times its limit while it computed
