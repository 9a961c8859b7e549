"""A worker's error latch: an error of one of its threads surfaces once, at the step boundary
where the worker waits for that thread, and is logged once."""

from __future__ import annotations

import logging
import threading

import pytest

from gradfleet.distributed.sync.worker.early_pushes import EarlyPushes
from gradfleet.distributed.sync.worker.error_latch import ErrorLatch


def test_first_error_kept_logged_once_raised_once(caplog):
    latch = ErrorLatch(3)
    first, second = ConnectionError("shard 2 is gone"), ConnectionError("again")
    with caplog.at_level(logging.DEBUG, logger="gradfleet.distributed.sync.worker.error_latch"):
        threads = [
            threading.Thread(target=latch.report, args=(f"the push to shard {k}", exc))
            for k, exc in ((2, first), (1, second))
        ]
        for t in threads:
            t.start()
            t.join()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "worker rank 3: the push to shard 2 failed" in errors[0].message
    with pytest.raises(ConnectionError, match="shard 2 is gone"):
        latch.raise_if_failed()
    assert latch.take() is None  # raised once: the next boundary goes on


def test_a_failed_early_push_surfaces_at_drain_once(caplog):
    """Overlap's pushing thread fails on shard 1: nothing more goes out that step, the error
    is logged once by the latch and raised by the step's drain, and the next step's drain is
    clean."""
    sent = []

    def send(k, job):
        if k == 1:
            raise ConnectionError("shard 1's link broke")
        sent.append(k)

    latch = ErrorLatch(0)
    pushes = EarlyPushes(send, [0, 1, 2], latch)
    try:
        with caplog.at_level(logging.ERROR, logger="gradfleet.distributed.sync.worker.error_latch"):
            pushes.submit({1: "a"})
            with pytest.raises(ConnectionError, match="shard 1's link broke"):
                pushes.drain(5.0)
        assert len(caplog.records) == 1
        pushes.submit({0: "b", 2: "c"})  # the next step
        pushes.drain(5.0)
        assert sent == [0, 2]
    finally:
        pushes.close()


def test_an_error_of_the_own_thread_is_decided_once_with_a_threads(caplog):
    """The read-ahead thread and then the step itself find shard 1 unreachable: one ERROR,
    the step raises its own error, and the next boundary is clean (the thread's was the same
    failure)."""
    latch = ErrorLatch(2)
    with caplog.at_level(logging.DEBUG, logger="gradfleet.distributed.sync.worker.error_latch"):
        latch.report("the answers of shard 1", ConnectionError("shard 1 closed"))
        latch.decide("step 7", ConnectionError("shard 1 closed, seen by the step"))
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.ERROR, logging.DEBUG], caplog.records
    assert "worker rank 2: the answers of shard 1 failed" in caplog.records[0].message
    assert latch.take() is None  # nothing left to raise: the thread's was the same failure
