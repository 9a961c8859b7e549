"""``EarlyPushes``: overlap's pushes go out on one thread, the ready ones in the worker's push
order, and the first failure is raised by ``drain()`` (pure: ``send`` is a recording fake)."""

from __future__ import annotations

import threading

import pytest

from gradfleet.distributed.sync.worker.early_pushes import EarlyPushes
from gradfleet.distributed.sync.worker.error_latch import ErrorLatch

pytestmark = pytest.mark.timeout(30)


class _Sends:
    """``send`` that records each shard and holds the first one until released."""

    def __init__(self, fail: int | None = None) -> None:
        self.sent: list[int] = []
        self.started, self.gate, self.fail = threading.Event(), threading.Event(), fail

    def __call__(self, k: int, job: str) -> None:
        self.started.set()
        assert self.gate.wait(10)
        if k == self.fail:
            raise ConnectionError(f"shard {k} is gone")
        self.sent.append(k)
        assert job == f"grads {k}"


def test_ready_shards_go_out_in_push_order_not_in_the_order_backward_finished_them():
    sends = _Sends()
    pushes = EarlyPushes(sends, order=[2, 0, 3, 1], latch=ErrorLatch(0))
    try:
        pushes.submit({1: "grads 1"})  # taken at once: the thread is idle
        assert sends.started.wait(10)
        for k in (3, 0, 2):  # ready while shard 1 is on its way
            pushes.submit({k: f"grads {k}"})
        sends.gate.set()
        pushes.drain(10)
        assert sends.sent == [1, 2, 0, 3]
    finally:
        pushes.close()


def test_a_failed_push_stops_the_step_and_drain_raises_it_once():
    sends = _Sends(fail=0)
    pushes = EarlyPushes(sends, order=[0, 1, 2], latch=ErrorLatch(0))
    try:
        pushes.submit({0: "grads 0"})
        assert sends.started.wait(10)
        pushes.submit({1: "grads 1"})
        sends.gate.set()
        with pytest.raises(ConnectionError, match="shard 0 is gone"):
            pushes.drain(10)
        assert sends.sent == []  # shard 1 was dropped with the failed step
        pushes.submit({2: "grads 2"})  # the next step sends again
        pushes.drain(10)
        assert sends.sent == [2]
    finally:
        pushes.close()


def test_drain_gives_up_after_its_timeout():
    sends = _Sends()
    pushes = EarlyPushes(sends, order=[0], latch=ErrorLatch(0))
    try:
        pushes.submit({0: "grads 0"})
        with pytest.raises(TimeoutError, match="overlap's pushes not sent after 0.2s"):
            pushes.drain(0.2)
    finally:
        sends.gate.set()
        pushes.close()


def test_in_step_from_the_first_submit_until_drain():
    """What tells a query between backward and step() that the links are busy: a submitted
    shard counts before its push has gone out."""
    sends = _Sends()
    pushes = EarlyPushes(sends, order=[0], latch=ErrorLatch(0))
    try:
        assert not pushes.in_step
        pushes.submit({0: "grads 0"})
        assert pushes.in_step and sends.sent == []
        sends.gate.set()
        pushes.drain(10)
        assert not pushes.in_step and sends.sent == [0]
    finally:
        pushes.close()


def test_shards_handed_over_together_go_out_in_push_order_among_themselves():
    """What one gradient completes (a layer cut over every shard) is one hand-over: the idle
    thread must not start with whichever shard the hook listed first."""
    sends = _Sends()
    sends.gate.set()
    pushes = EarlyPushes(sends, order=[2, 3, 0, 1], latch=ErrorLatch(0))
    try:
        pushes.submit({k: f"grads {k}" for k in (0, 1, 2, 3)})
        pushes.drain(10)
        assert sends.sent == [2, 3, 0, 1]
    finally:
        pushes.close()
