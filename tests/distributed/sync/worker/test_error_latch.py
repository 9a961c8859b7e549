"""A worker's error latch: an error of one of its threads surfaces once, at the step boundary
where the worker waits for that thread, and is logged once (a bug with its traceback); the
pushes and the pending step keep no error of their own."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

from gradfleet.distributed.sync.worker.early_pushes import EarlyPushes
from gradfleet.distributed.sync.worker.error_latch import ErrorLatch
from gradfleet.distributed.sync.worker.pending_step import PendingStep
from gradfleet.distributed.transport import ServerUnreachable


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


def test_a_bug_reported_by_a_thread_is_logged_with_its_traceback(caplog):
    """A lost shard is one line; a bug in a thread's work also says where it is."""
    latch = ErrorLatch(1)
    with caplog.at_level(logging.ERROR, logger="gradfleet.distributed.sync.worker.error_latch"):
        latch.report("the answers of shard 1", ServerUnreachable("shard 1 closed"))
        latch.take()
        try:
            {}["version"]
        except KeyError as bug:
            latch.report("loading the values of shard 2", bug)
    lost, bug_record = caplog.records
    assert lost.exc_info is None
    assert bug_record.exc_info is not None and bug_record.exc_info[0] is KeyError


def test_the_error_raised_from_the_latch_is_not_logged_again_when_decided(caplog):
    """A thread's error is raised at the step boundary (taken from the latch) and the step
    decides it as it goes up: one ERROR, not two."""
    latch = ErrorLatch(0)
    lost = ServerUnreachable("shard 2 closed the connection")
    with caplog.at_level(logging.DEBUG, logger="gradfleet.distributed.sync.worker.error_latch"):
        latch.report("the answers of shard 2", lost)
        with pytest.raises(ServerUnreachable) as raised:
            latch.raise_if_failed()
        latch.decide("the streamed reads", raised.value)
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert latch.take() is None


def test_a_servers_bug_is_raised_in_place_of_the_silence_that_follows_it(caplog):
    """The read-ahead thread takes an answer carrying the chief's own bug (after which the
    chief answers nothing); the step then times out waiting: the step raises the bug, logged
    once, at the thread's report.  A lost peer's error kept by a thread is not raised in
    place of the step's own."""
    latch = ErrorLatch(1)
    bug = KeyError("the chief's probe of shard server rank 1 raised KeyError (a bug)")
    silence = ServerUnreachable("server rank 0 sent no reply in 30s during 'step'")
    with caplog.at_level(logging.DEBUG, logger="gradfleet.distributed.sync.worker.error_latch"):
        latch.report("taking the read-ahead answer of shard 0", bug)
        assert latch.decide("step 108", silence) is bug
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.DEBUG]
    assert latch.take() is None and latch.last_raised is bug
    lost = ServerUnreachable("shard 1 closed the connection")
    latch.report("the answers of shard 1", lost)
    assert latch.decide("step 109", silence) is silence
    assert latch.take() is None
    # a bug met by the step itself is its own, whatever a thread kept
    latch.report("the answers of shard 1", lost)
    own = ValueError("a bug of the step's own")
    assert latch.decide("step 110", own) is own


def test_early_pushes_go_out_again_once_their_error_was_raised_elsewhere():
    """Overlap's push fails during backward; the step raises the error at its start (the
    latch's), before it drains the pushes.  The latch is the one record of the failure: the
    next step's pushes go out (they used to stay blocked by a flag of the pushes' own)."""
    sent = []

    def send(k, job):
        if job == "bad":
            raise ConnectionError("shard 1's link broke")
        sent.append(k)

    latch = ErrorLatch(0)
    pushes = EarlyPushes(send, [0, 1], latch)
    try:
        pushes.submit({1: "bad"})
        deadline = time.monotonic() + 10
        while not latch.failed and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ConnectionError, match="shard 1's link broke"):
            latch.raise_if_failed()  # ServerExchange.step's first boundary
        pushes.submit({0: "good", 1: "good"})  # the next step
        pushes.drain(5.0)
        assert sent == [0, 1]
    finally:
        pushes.close()


class _Taker:
    """An answer taker whose step failed: its error is in the worker's latch."""

    def __init__(self, latch: ErrorLatch) -> None:
        self.latch = latch

    def wait_loaded(self, k, timeout):
        return None  # the step failed

    def end(self, timeout):
        self.latch.raise_if_failed()
        raise RuntimeError("read-ahead: this step's answers failed (reported before)")


def test_a_failed_read_ahead_step_raises_its_error_once():
    """The taker's error reaches the step's first wait (streamed reads: a forward hook), from
    the latch; the step keeps no copy of it: a later wait says only that it failed before."""
    latch = ErrorLatch(0)
    lost = ServerUnreachable("shard 1 closed the connection")
    latch.report("taking the read-ahead answer of shard 1", lost)
    clients = SimpleNamespace(timeout=1.0, versions={0: 0, 1: 0})
    step = PendingStep(clients, _Taker(latch), {"token": 1}, [0, 1], lambda k, v: None)
    with pytest.raises(ServerUnreachable) as first:
        step.wait([1])
    assert first.value is lost
    with pytest.raises(RuntimeError, match="failed \\(its error was raised before\\)") as again:
        step.finish()
    assert not isinstance(again.value, ServerUnreachable)
