"""Every decision of the servers leaves a log record: a stale gradient dropped, a non-finite
gradient dropped, a worker forgotten or lost, a dead shard server, a bug that stops the chief,
a dropped peer."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import gradfleet
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.server.aggregator import GradientAggregator
from gradfleet.distributed.sync.server.chief import SyncChief
from gradfleet.distributed.transport import MailboxClient, MailboxServer
from tests.distributed.sync.test_sync_replicas import serve

pytestmark = pytest.mark.timeout(120)


def messages(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_stale_gradient_dropped_is_logged(caplog):
    agg = GradientAggregator([torch.zeros(2)], replicas_to_aggregate=1)
    assert agg.push(0, 0, [torch.ones(2)])
    agg.take_average()  # the accumulators move to step 1
    with caplog.at_level(logging.DEBUG, logger="gradfleet.distributed.sync.server.aggregator"):
        assert not agg.push(1, 0, [torch.ones(2)])
    (msg,) = messages(caplog, "gradfleet.distributed.sync.server.aggregator")
    assert msg == "worker rank 1: stale gradient dropped (computed at step 0, accumulators at 1)"


def test_nonfinite_gradient_dropped_is_logged(caplog):
    agg = GradientAggregator([torch.zeros(2)], 1, nonfinite="drop")
    with caplog.at_level(logging.WARNING, logger="gradfleet.distributed.sync.server.aggregator"):
        assert not agg.push(3, 0, [torch.tensor([1.0, float("nan")])])
    (msg,) = messages(caplog, "gradfleet.distributed.sync.server.aggregator")
    assert "worker rank 3" in msg and "non-finite" in msg and "dropped" in msg


def test_forgotten_and_lost_workers_are_logged_by_the_chief(caplog):
    x = torch.zeros(1, requires_grad=True)
    chief = SyncChief(
        gradfleet.GradientDescentOptimizer([x], 1.0), Job(1, 3, "shared", 1, timeout=0.01)
    )
    with caplog.at_level(logging.INFO, logger="gradfleet.distributed.common.membership"):
        serve(chief, {"op": "done", "worker": 2, "forgotten": True})
        assert chief.silent_workers(now=chief.members.start + 1.0) == [0, 1]
    got = messages(caplog, "gradfleet.distributed.common.membership")
    assert "SyncReplicas chief: worker rank 2 forgotten (reported dead for good)" in got
    assert any("worker rank 0 lost: never said hello" in m for m in got)


def _chief_with_a_worker_waiting():
    """A sharded chief (2 shards, R = N = 2) and worker 0's token request, waiting."""
    x = torch.zeros(1, requires_grad=True)
    chief = SyncChief(
        gradfleet.GradientDescentOptimizer([x], 1.0),
        Job(2, 2, "shared", 0, timeout=10),
        num_shards=2,
    )
    return chief, serve(chief, {"op": "step", "worker": 0, "tag": 0, "grads": [None], "version": 0})


def test_unreachable_shard_server_is_logged_and_fails_the_waiting_workers(caplog):
    chief, waiting = _chief_with_a_worker_waiting()
    with caplog.at_level(logging.ERROR, logger="gradfleet.distributed.sync.server.chief"):
        for answer in chief.unreachable("shard server rank 1 is unreachable"):
            answer.ticket.send(answer.payload)
    assert waiting.payload["error"] == "ServerUnreachable"
    assert messages(caplog, "gradfleet.distributed.sync.server.chief") == [
        "shard server rank 1 is unreachable"
    ]


def test_the_chief_decides_once_and_a_bug_stays_a_bug(caplog):
    """A bug in the chief's watching (its probe) stops the chief: the waiting worker and every
    later one get that error's own class, the first cause is logged once with its traceback,
    and a later verdict (the same probe's server now unreachable) changes nothing."""
    chief, waiting = _chief_with_a_worker_waiting()
    try:
        {}["shard 1"]
    except KeyError as exc:
        bug = exc
    with caplog.at_level(logging.ERROR, logger="gradfleet.distributed.sync.server.chief"):
        for answer in chief.fail("KeyError", "the chief's probe raised KeyError", cause=bug):
            answer.ticket.send(answer.payload)
        for answer in chief.unreachable("shard server rank 1 is unreachable"):
            answer.ticket.send(answer.payload)
    assert waiting.payload == {"error": "KeyError", "message": "the chief's probe raised KeyError"}
    later = serve(chief, {"op": "step", "worker": 1, "tag": 0, "grads": [None], "version": 0})
    assert later.payload["error"] == "KeyError"
    (record,) = caplog.records
    assert record.getMessage() == "the chief's probe raised KeyError" and record.exc_info


def test_a_dropped_peer_is_logged(caplog):
    """A client whose link dies while its tensors are on the way (its gloo groups destroyed
    under the server's feet): the server drops its pair (and only its pair) and says so, at
    WARNING, naming it; a bug would be an ERROR instead (``tests/distributed/transport/
    test_errors.py``)."""
    server = MailboxServer(lambda msg, reply: reply.send({"n": len(msg.get("x", []))}))
    logger = "gradfleet.distributed.transport.mailbox"
    try:
        client = MailboxClient(server.address, "w9", 10.0, "test server", in_process=False)
        # the server registers the pair once its side of gloo's connect returned, which can
        # be after the client's side did
        deadline = time.monotonic() + 30
        while "w9" not in server.peers and time.monotonic() < deadline:
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger=logger):
            client.link.close()  # its gloo groups go: the server's side sees the socket close
            layout = b'{"packed": 16, "entries": [["torch.float32", [4], 0, false]]}'
            client.store.queue_push(
                "gf/req",
                b'{"op": "x", "client": "w9", "seq": 99, "inc": "%s", "$layout": %s}'
                % (client.inc.encode(), layout),
            )
            while "w9" in server.peers and time.monotonic() < deadline:
                time.sleep(0.01)
        assert "w9" not in server.peers
        (dropped,) = [r for r in caplog.records if r.name == logger]
        assert dropped.levelno == logging.WARNING
        got = dropped.getMessage()
        assert "receiving from w9 failed, peer dropped: client w9: receive failed" in got, got
        assert "Connection closed by peer" in got, got
    finally:
        server.close()
