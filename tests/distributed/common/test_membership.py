"""Membership: which workers a server still expects.  A worker that has not said hello yet is
expected (the close-before-hello race), one that is silent for longer than the timeout is lost
and logged, a forgotten one is gone at once and a hello brings it back."""

from __future__ import annotations

import logging

import pytest

from gradfleet.distributed.common.membership import Membership
from gradfleet.distributed.testing import run_ranks

from . import membership_ranks

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_worker_not_yet_heard_from_is_expected_until_the_timeout():
    clock = Clock()
    members = Membership(2, timeout=10.0, clock=clock)
    members.hello(0)
    members.leave(0)
    assert not members.finished()  # worker 1 may still come
    clock.now += 9.0
    assert not members.finished()
    clock.now += 2.0
    assert members.finished() and members.silent() == [1]


def test_silence_counts_from_the_last_message_and_is_logged_once(caplog):
    clock = Clock()
    members = Membership(2, timeout=5.0, server="chief", clock=clock)
    members.hello(0)
    members.hello(1)
    clock.now += 4.0
    members.heard(0)
    clock.now += 2.0
    with caplog.at_level(logging.WARNING, logger="gradfleet.distributed.common.membership"):
        assert members.silent() == [1]
        assert members.silent() == [1]  # logged once
    lost = [r.getMessage() for r in caplog.records]
    assert lost == ["chief: worker rank 1 lost: no message for 6.0s (timeout 5s)"]
    assert members.silent(busy=[1]) == []  # blocked in a request: not silent


def test_forgotten_worker_is_gone_at_once_and_a_hello_brings_it_back(caplog):
    members = Membership(3, timeout=60.0, clock=Clock())
    for w in range(3):
        members.hello(w)
    members.leave(0)
    with caplog.at_level(logging.INFO, logger="gradfleet.distributed.common.membership"):
        members.leave(1, forgotten=True)
        members.leave(2, forgotten=True)
    assert members.finished()
    assert any("worker rank 1 forgotten" in r.getMessage() for r in caplog.records)
    members.hello(2)
    assert not members.finished()


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["sync", "async-easgd"])
def test_server_rank_close_waits_for_a_worker_that_has_not_said_hello(wrapper):
    """Rank 0 closes at once; rank 1 connects ``HELLO_DELAY`` s later.  The server must still
    be there for its hello, step and done, and rank 0's close ends when rank 1 left."""
    out = run_ranks(membership_ranks.close_before_hello, 2, args=(wrapper,), timeout=90)
    delay = membership_ranks.HELLO_DELAY
    assert out[0]["close_s"] >= 0.9 * delay, out  # it waited for the late worker
    assert out[0]["close_s"] < 25, out  # and not for the whole timeout (30 s)
    assert out[1]["x"] != [0.0, 0.0, 0.0], out  # rank 1 stepped through the server


def test_worker_silence_reports_every_expected_worker():
    import torch

    import gradfleet
    from gradfleet.distributed import SyncReplicasOptimizer

    x = torch.zeros(2, requires_grad=True)
    inner = gradfleet.GradientDescentOptimizer([x], 1.0)
    opt = SyncReplicasOptimizer(inner, 1, timeout=5, server_rank=0)
    try:
        silence = opt.worker_silence()
        assert list(silence) == [0] and 0 <= silence[0] < 5.0
        x.grad = torch.ones(2)
        opt.step()
        assert opt.worker_silence()[0] < 1.0
    finally:
        opt.close()
    members = Membership(3, timeout=60.0, clock=Clock())
    members.hello(0)
    members.leave(0)
    assert members.report() == {"silence": {1: 0.0, 2: 0.0}, "left": [0]}
