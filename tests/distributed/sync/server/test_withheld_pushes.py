"""Withheld pushes: a worker that knows its shard is past its gradient's tag sends the push
without the gradients; the shard counts it as the stale drop it would have been.

The decision (:func:`~gradfleet.distributed.sync.worker.shard_clients.push_data`) and the
servers' side
(``GradientAggregator.drop_withheld``, the chief's and the shards' ``push``/``step``) on the
state machines; the random schedules of ``test_read_ahead.py`` check, with and without
withholding, that nothing a worker or a server ends with changes; over processes, a job with a
backup worker withholds and trains to the same variables on every rank.
"""

from __future__ import annotations

import pytest
import torch

from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.server.aggregator import GradientAggregator
from gradfleet.distributed.sync.server.chief import SyncChief
from gradfleet.distributed.sync.server.shards import Shard, ShardServer
from gradfleet.distributed.sync.worker.shard_clients import push_data
from gradfleet.distributed.testing import run_ranks
from tests.distributed import sync_ranks
from tests.distributed.sync.test_sync_replicas import serve

SHAPES = [(2, 3), (3,)]


def grads(scale: float = 1.0) -> list[torch.Tensor]:
    return [torch.full(s, scale) for s in SHAPES]


@pytest.mark.parametrize(
    ("tag", "version", "given", "shapes", "withheld"),
    [
        (3, 5, grads(), SHAPES, True),  # the shard is past the tag: certainly dropped
        (4, 5, [None, torch.ones(3)], SHAPES, True),  # a None gradient is no obstacle
        (5, 5, grads(), SHAPES, False),  # the shard may still be at the tag: it may join
        (6, 5, grads(), SHAPES, False),
        (-1, 5, grads(), SHAPES, False),  # bad input: the shard must see and report it
        (3, 5, grads(float("nan")), SHAPES, False),  # reported even when stale (nonfinite)
        (3, 5, [None, torch.tensor([1.0, float("inf"), 0.0])], SHAPES, False),
        (3, 5, [torch.ones(3, 2), torch.ones(3)], SHAPES, False),  # wrong shape: reported there
        (3, 5, grads()[:1], SHAPES, False),  # wrong count: reported there
        (3, 5, grads(), None, False),  # before hello: nothing known of the shard
        (3, 5, [torch.ones(2, 3).to_sparse(), torch.ones(3)], SHAPES, False),  # sparse
    ],
)
def test_push_data_withholds_only_what_the_shard_certainly_drops(
    tag, version, given, shapes, withheld
):
    data = push_data(tag, version, given, shapes)
    assert data == ({"withheld": True} if withheld else {"grads": given})


def test_aggregator_counts_a_withheld_push_as_dropped_or_refuses_it_unchanged():
    agg = GradientAggregator([torch.zeros(s) for s in SHAPES], replicas_to_aggregate=1)
    for _ in range(2):
        assert agg.push(0, agg.global_step, grads())
        agg.take_average()
    agg.drop_withheld(1, 1)
    assert agg.stats[1] == {"accepted": 0, "dropped": 1, "nonfinite": 0}
    before = {w: dict(c) for w, c in agg.stats.items()}
    with pytest.raises(ValueError, match=r"worker 1 withheld .* step 2 .* at step 2"):
        agg.drop_withheld(1, 2)
    assert agg.stats == before and agg.global_step == 2 and agg.counter == 0


def _opt():
    params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    return torch.optim.SGD(params, lr=0.5)


def test_a_shard_answers_a_withheld_push_as_a_stale_one():
    """A read-ahead push without gradients, tag below the shard's step: answered at once, not
    accepted, without values (the worker reads after its token), counted dropped; the next
    update still waits for R fresh gradients."""
    job = Job(R=2, N=3, timeout=10)
    server = ShardServer(1, Shard(_opt(), [0, 1], job), job)
    for w in (0, 1):  # update 1
        push = {"op": "push", "worker": w, "tag": 0, "grads": grads(), "ahead": 0}
        serve(server, push, perform=lambda applied: None)
    values = [p.detach().clone() for p in server.shard.params]
    reply = serve(server, {"op": "push", "worker": 2, "tag": 0, "withheld": True, "ahead": 1})
    assert reply.payload == {"accepted": False, "step": 1, "version": 1}
    assert server.shard.aggregator.stats[2] == {"accepted": 0, "dropped": 1, "nonfinite": 0}
    assert server.shard.aggregator.counter == 0 and server.shard.step == 1
    for got, want in zip(server.shard.params, values, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="withheld"):  # a tag the shard is not past
        serve(server, {"op": "push", "worker": 2, "tag": 1, "withheld": True, "ahead": 1})
    with pytest.raises(KeyError):  # neither gradients nor withheld: malformed, not a drop
        serve(server, {"op": "push", "worker": 2, "tag": 0, "ahead": 1})
    assert server.shard.aggregator.counter == 0
    assert server.shard.aggregator.stats[2] == {"accepted": 0, "dropped": 1, "nonfinite": 0}


def test_the_chief_takes_a_withheld_gradient_with_a_token_request():
    """One server: the gradients travel with the token request (``step``); withheld, the
    request still pushes (counted dropped, not accepted) and gets a token."""
    chief = SyncChief(_opt(), Job(R=1, N=2, tokens="shared", initial_tokens=0, timeout=10))
    first = serve(chief, {"op": "step", "worker": 0, "tag": 0, "grads": grads(), "version": -1})
    assert first.payload["accepted"] and chief.global_step == 1
    late = serve(chief, {"op": "step", "worker": 1, "tag": 0, "withheld": True, "version": 1})
    assert late.payload["accepted"] is False and late.payload["token"] == 1
    assert chief.aggregator.stats[1] == {"accepted": 0, "dropped": 1, "nonfinite": 0}
    assert chief.global_step == 1


@pytest.mark.timeout(120)
def test_a_backup_job_withholds_and_trains_to_the_same_variables():
    """R = 2 of N = 3, two shards on each of ranks 0 and 1, rank 2 slowed: surplus tokens
    (TF's shared queue) send the fast workers' pushes stale, known so from the values they
    read, and withheld; every rank reaches the last step on the same variables."""
    args = (2, 3, 20, "server", 2, 0.15, 16, None, 20.0, [0, 1, 0, 1])
    args += (-1, False, False, "bytes", "shared")
    out = run_ranks(sync_ranks.sync_train, 3, args=args, timeout=100)
    for r in range(3):
        assert out[r]["global_step"] == 20
        for a, b in zip(out[r]["params"], out[0]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert sum(out[r]["withheld"] for r in range(3)) > 0
    for r in range(3):  # a step with a withheld push is one the worker counts dropped
        assert out[r]["withheld"] <= 4 * out[r]["counters"]["dropped"]
