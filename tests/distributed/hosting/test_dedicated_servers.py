"""Dedicated server ranks (``serve()``): SyncReplicas shards and the asynchronous EASGD centre
on processes that only serve.

References: a float64 single-process simulation of lockstep synchronous SGD (the average of
the workers' gradients applied with the same optimizer), the same job with its servers inside
the worker ranks, and the uninterrupted run for checkpoints.  Failure rows: a server lost makes
every worker fail with one error naming its rank and address.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

import gradfleet
from gradfleet.distributed.sync.common.job import Job
from gradfleet.distributed.sync.layout.assignment import check_server_ranks
from gradfleet.distributed.testing import RankKilled, run_ranks
from tests.distributed import dedicated_ranks
from tests.distributed.dedicated_ranks import LR, LR_DROP_AT, LR_LATER
from tests.distributed.sync_ranks import loss_of, make_model

STEPS = 6


def reference(N: int, steps: int) -> list[list[torch.Tensor]]:
    """Lockstep synchronous SGD in one process: every step, each worker's gradient at the
    current variables, their mean, one Adam update (LR drops after step ``LR_DROP_AT``)."""
    model = make_model(width=4)
    opt = gradfleet.AdamOptimizer(model.parameters(), LR)
    out = []
    for step in range(steps):
        if step == LR_DROP_AT:
            for g in opt.param_groups:
                g["lr"] = LR_LATER
        grads = []
        for w in range(N):
            model.zero_grad()
            loss_of(model, w, step).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            total = torch.zeros_like(p)
            for g in gs:
                total += g
            p.grad = total / N
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _worker_traces(out, N):
    return [out[w]["trace"] for w in range(N)]


@pytest.mark.timeout(240)
def test_dedicated_servers_match_colocated_and_the_reference():
    """2 workers: two shards on two dedicated ranks, one dedicated server, and the shards
    inside the workers give the same trajectory, equal to the float64 simulation -- the LR
    drop on the workers reaches the dedicated servers with the pushes."""
    want = reference(2, STEPS)
    sharded = run_ranks(dedicated_ranks.sync_train, 4, args=(2, [2, 3], STEPS), timeout=120)
    single = run_ranks(dedicated_ranks.sync_train, 3, args=(2, [2], STEPS), timeout=120)
    colocated = run_ranks(dedicated_ranks.sync_train, 2, args=(2, [0, 1], STEPS), timeout=120)
    assert sharded[2:] == [{"served": "SyncReplicasOptimizer"}] * 2
    assert sharded[0]["dedicated"] == [2, 3] and colocated[0]["dedicated"] == []
    for run in (sharded, single, colocated):
        for trace in _worker_traces(run, 2):
            assert [s for s, _ in trace] == list(range(1, STEPS + 1))
            for (_, got), ref in zip(trace, want, strict=True):
                for g, r in zip(got, ref, strict=True):
                    # the same sums in the same order: equal up to float64 rounding of the
                    # two-term mean (exact in practice)
                    torch.testing.assert_close(g, r, rtol=4e-16, atol=0)
    for a, b in zip(_worker_traces(sharded, 2), _worker_traces(colocated, 2), strict=True):
        for (_, x), (_, y) in zip(a, b, strict=True):
            for u, v in zip(x, y, strict=True):
                assert torch.equal(u, v)


@pytest.mark.timeout(240)
def test_an_lr_change_reaches_dedicated_shards_with_overlap():
    """With overlap the shards are pushed from backward's hooks, before ``step()``; the LR drop
    on the workers still reaches the dedicated shards with those pushes, so the trajectory is
    the reference's."""
    want = reference(2, STEPS)
    args = (2, [2, 3], STEPS, 0, None, "bytes", True)
    run = run_ranks(dedicated_ranks.sync_train, 4, args=args, timeout=120)
    for trace in _worker_traces(run, 2):
        assert [s for s, _ in trace] == list(range(1, STEPS + 1))
        for (_, got), ref in zip(trace, want, strict=True):
            for g, r in zip(got, ref, strict=True):
                torch.testing.assert_close(g, r, rtol=4e-16, atol=0)  # as above


@pytest.mark.timeout(240)
def test_dedicated_server_checkpoints_resume_the_same_trajectory():
    """Each dedicated server saves its own state at the end of a job; the next job's servers
    load it and the workers continue as if never stopped."""
    path = tempfile.mkdtemp()
    try:
        full = run_ranks(dedicated_ranks.sync_train, 4, args=(2, [2, 3], STEPS), timeout=120)
        half = STEPS // 2
        first = run_ranks(
            dedicated_ranks.sync_train, 4, args=(2, [2, 3], half, 0, path), timeout=120
        )
        second = run_ranks(
            dedicated_ranks.sync_train, 4, args=(2, [2, 3], STEPS, half, path), timeout=120
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)
    for w in range(2):
        resumed = first[w]["trace"] + second[w]["trace"]
        assert [s for s, _ in resumed] == [s for s, _ in full[w]["trace"]]
        for (_, got), (_, want) in zip(resumed, full[w]["trace"], strict=True):
            for g, x in zip(got, want, strict=True):
                assert torch.equal(g, x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("victim", "ranks"),
    [(2, [2, 3]), (3, [2, 3]), (3, [2, 3, 2, 3])],
    ids=["chief", "shard", "two-shards-per-rank"],
)
def test_lost_dedicated_server_is_named_on_every_worker(victim, ranks):
    """A dedicated server rank is SIGKILLed mid-training: every worker's step raises one
    ServerUnreachable naming its rank and an address it served, and close() then returns at
    once (with two shards per rank, the chief probes each rank once)."""
    out = run_ranks(
        dedicated_ranks.sync_server_lost, 4, args=(2, ranks, victim),
        timeout=90, kill_on={victim: "die"},
    )  # fmt: skip
    assert isinstance(out[victim], RankKilled)
    for w in range(2):
        errors = out[w]["errors"]
        assert len(errors) == 1, errors
        kind, message = errors[0]
        served = [a for a, r in zip(out[w]["addresses"], ranks, strict=True) if r == victim]
        assert kind == "ServerUnreachable", message
        assert f"server rank {victim}" in message, message
        assert any(a in message for a in served), (served, message)
        assert out[w]["close_s"] < 10


@pytest.mark.timeout(120)
def test_dedicated_easgd_centre_matches_the_centre_inside_a_worker():
    """One worker: the centre on a dedicated rank gives exactly the numbers of the centre on
    the worker's own rank (TF's asynchronous EASGD with one worker)."""
    dedicated = run_ranks(dedicated_ranks.easgd_train, 2, args=(1, 1, 8), timeout=90)
    inside = run_ranks(dedicated_ranks.easgd_train, 1, args=(1, 0, 8), timeout=90)
    for key in ("params", "local_centre", "centre"):
        for a, b in zip(dedicated[0][key], inside[0][key], strict=True):
            assert torch.equal(a, b), key
    final = dedicated[1]
    assert final["kind"] == "AsyncCentre"
    for a, b in zip(final["centre"], inside[0]["centre"], strict=True):
        assert torch.equal(a, b)
    assert dedicated[0]["counters"]["exchanges"] == {0: 4}


@pytest.mark.timeout(120)
def test_dedicated_easgd_centre_serves_two_workers():
    """Two workers, centre on rank 2: every exchange reached the server (4 each)."""
    out = run_ranks(dedicated_ranks.easgd_train, 3, args=(2, 2, 8), timeout=90)
    for w in range(2):
        assert out[w]["counters"]["joins"] == {0: 1, 1: 1}
    assert out[0]["counters"]["exchanges"][0] == 4
    assert out[1]["counters"]["exchanges"][1] == 4
    assert out[2]["kind"] == "AsyncCentre"


@pytest.mark.timeout(120)
def test_lost_dedicated_easgd_centre_is_named():
    out = run_ranks(dedicated_ranks.easgd_server_lost, 3, args=(2,), timeout=90, kill_on={2: "die"})
    for w in range(2):
        (kind, message), *rest = out[w]["errors"]
        assert not rest
        assert kind == "ServerUnreachable"
        assert "server rank 2" in message and out[w]["address"] in message, message


@pytest.mark.timeout(60)
def test_serve_without_optimizer_fails_on_every_rank():
    out = run_ranks(dedicated_ranks.serve_without_optimizer, 2, timeout=45)
    for message in out:
        assert "dedicated server rank 1" in message and "serve(optimizer=...)" in message


# --------------------------------------------------------------------- arguments
def test_server_ranks_of_a_job_with_dedicated_servers():
    assert check_server_ranks([4, 5], 4, 10, "server", None, world_size=6) == [4, 5]
    assert check_server_ranks([0, 4], 4, 10, "server", None, world_size=5) == [0, 4]
    # a restarted worker outside the group joins the running dedicated shards by address
    assert check_server_ranks([4, 5], 4, 10, "server", ["h:1", "h:2"]) == [4, 5]
    with pytest.raises(ValueError, match="server rank 4 is neither a worker rank"):
        check_server_ranks([4], 4, 10, "server", None)  # inside a group of 4: no rank 4
    with pytest.raises(ValueError, match=r"rank\(s\) \[5\] of the 6 processes are neither"):
        check_server_ranks([4], 4, 10, "server", None, world_size=6)
    with pytest.raises(ValueError, match="server rank 6 is neither a worker rank"):
        check_server_ranks([4, 5, 6], 4, 10, "server", None, world_size=6)
    with pytest.raises(ValueError, match="dedicated server ranks \\[4\\] need transport"):
        check_server_ranks([4], 4, 10, "allreduce", None, world_size=5)


def test_a_dedicated_shard_takes_the_workers_hyperparameters_and_a_colocated_one_does_not():
    """``Shard.follow``: a dedicated server's optimizer copy takes the pushed numbers before its
    next update (SGD: x -= lr * mean gradient, checked by hand); inside a worker rank the
    shard keeps reading that rank's own optimizer."""
    from gradfleet.distributed.sync.server.shards import Shard

    for dedicated, lr in ((True, 0.25), (False, 1.0)):
        x = torch.zeros(2, dtype=torch.float64)
        source = torch.optim.SGD([x], lr=1.0)
        shard = Shard(source, [0], Job(R=1, N=1))
        shard.follow_workers = dedicated
        shard.follow([{"lr": 0.25, "momentum": 0.0}])
        accepted, updated = shard.push(0, 0, [torch.tensor([1.0, -2.0], dtype=torch.float64)])
        assert accepted and updated
        assert torch.equal(shard.params[0], torch.tensor([-lr, 2 * lr], dtype=torch.float64))
    shard.follow_workers = True
    with pytest.raises(ValueError, match="a worker has 2 param groups, the server 1"):
        shard.follow([{"lr": 0.1}, {"lr": 0.2}])
