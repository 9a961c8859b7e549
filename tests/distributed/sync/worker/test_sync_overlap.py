"""``SyncReplicasOptimizer(overlap=True)``: shard pushes from gradient hooks during backward.

The reference is the same optimizer with ``overlap=False`` (itself checked against TF's
oracles and the float64 simulation in test_sync_replicas.py): the servers see the same pushes
in the same order, so the variables must be bit-identical.  Over real processes a scripted
step order with a backup worker (R=2 of N=3) is also checked against ``reference_fifo``, the
float64 simulation of TF's token FIFO.  In process (one worker, its servers on threads of the
same process): pushes really start before ``step()``, closure steps, parameters without
gradients, and misuse errors.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from torch import nn

import gradfleet
from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.testing import run_ranks
from tests.distributed.sync import overlap_ranks
from tests.distributed.sync.test_sync_replicas import reference_fifo

F64 = torch.float64
# TF's learning rate: the Python float becomes a float32 constant, cast to the variable's dtype
TF_LR = float(torch.tensor(0.1, dtype=torch.float32))


def _model(seed: int = 3, unused: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    if unused:  # a trainable parameter the loss never touches: its gradient stays None
        model.register_parameter("spare", nn.Parameter(torch.randn(4, dtype=F64)))
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 3, generator=gen, dtype=F64), torch.randn(6, 2, generator=gen, dtype=F64)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return ((model(x) - y) ** 2).mean()


def _sync(model, overlap, shards=2, adam=False, **kw):
    # Free the servers of the optimizers closed before: left to the collector, a closed
    # server's store may be destroyed in the middle of this constructor, which then stalls
    # for seconds (the in-process probe of a shard server can time out)
    gc.collect()
    inner = (
        gradfleet.AdamOptimizer(model.parameters(), 0.01)
        if adam
        else gradfleet.GradientDescentOptimizer(model.parameters(), 0.1)
    )
    kw.setdefault("nonfinite", "apply" if shards > 1 else "raise")
    # no initial token: the first push makes the update and its token (no wasted round)
    return SyncReplicasOptimizer(
        inner, 1, 1, num_tokens=0, timeout=10, server_ranks=[0] * shards, overlap=overlap, **kw
    )


def _train(overlap, steps=4, shards=2, closure=False, unused=False, adam=False):
    model = _model(unused=unused)
    opt = _sync(model, overlap, shards, adam=adam, shard_assignment="round_robin")
    try:
        for step in range(steps):
            if closure:

                def run(step=step):
                    opt.zero_grad()
                    loss = _loss(model, step)
                    loss.backward()
                    return loss

                opt.step(run)
            else:
                opt.zero_grad()
                _loss(model, step).backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()], opt.global_step
    finally:
        opt.close()


def _plain_sgd(steps=4):
    """The float64 reference for R = N = 1: every push is one SGD update (TF's rate)."""
    lr = TF_LR
    model = _model()
    for step in range(steps):
        model.zero_grad()
        _loss(model, step).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return [p.detach() for p in model.parameters()]


def _equal(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# --------------------------------------------------------------------- in process
def test_readiness_hands_over_what_one_gradient_completes_together():
    """A parameter cut over shards 1-3 completes them with one gradient: one hand-over of all
    three (so they go out in push order), and each shard once per step."""
    from gradfleet.distributed.sync.layout.shard_layout import shards_holding
    from gradfleet.distributed.sync.worker.overlap import ShardReadiness

    big, small = torch.zeros(6, requires_grad=True), torch.zeros(2, requires_grad=True)
    calls = []
    owners = [[1], [0], [0], [0, 1]]
    ready = ShardReadiness([big, small], owners, shards_holding(owners), calls.append, "test")
    try:
        (big.sum() * 0).backward()
        assert calls == [[1, 2]]  # shard 3 also waits for `small`
        (small.sum() * 0).backward()
        assert calls == [[1, 2], [0, 3]]
        ready.reset()
        ((big.sum() + small.sum()) * 0).backward()
        assert sorted(k for c in calls[2:] for k in c) == [0, 1, 2, 3]
    finally:
        ready.remove()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_same_variables_as_without_overlap_and_as_sgd(shards):
    with_overlap, steps = _train(True, shards=shards)
    _equal(with_overlap, _train(False, shards=shards)[0])
    assert steps == 4
    # one update of x - lr * g per step, in float64: a few ulps of the largest value
    for got, want in zip(with_overlap, _plain_sgd(), strict=True):
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(F64).eps, atol=1e-15)


@pytest.mark.timeout(60)
def test_shards_are_pushed_during_backward():
    """R = N = 1: a push is an update, so each shard's step shows its push arrived; after
    backward and before step() every shard has stepped."""
    model = _model()
    opt = _sync(model, True, shards=2, shard_assignment="round_robin")
    try:
        hosted = opt.exchange.servers
        shard_steps = lambda: [hosted.chief.shard.step, hosted.shards[1][0].shard.step]  # noqa: E731
        assert shard_steps() == [0, 0]
        _loss(model, 0).backward()
        end = time.monotonic() + 10
        while shard_steps() != [1, 1] and time.monotonic() < end:
            time.sleep(0.01)
        assert shard_steps() == [1, 1], "the pushes waited for step()"
        opt.step()
        assert opt.global_step == 1 and opt.last_gradient_accepted is True
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_closure_step_same_as_without_overlap():
    _equal(_train(True, closure=True)[0], _train(False)[0])


@pytest.mark.timeout(60)
def test_parameter_without_gradient_pushed_by_step_as_none():
    """The unused parameter's shard is not complete during backward: step() pushes it with
    its None (Adam leaves such a variable unchanged), same as without overlap."""
    got = _train(True, shards=3, unused=True, adam=True)[0]
    _equal(got, _train(False, shards=3, unused=True, adam=True)[0])
    fresh = dict(_model(unused=True).named_parameters())
    spare = list(fresh).index("spare")
    torch.testing.assert_close(got[spare], fresh["spare"].detach(), rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_shard_with_missing_gradient_waits_for_step():
    model = _model(unused=True)
    opt = _sync(model, True, shards=2, shard_assignment="round_robin")
    try:  # round robin: parameters 0 (spare), 2, 4 on shard 0; 1, 3 on shard 1
        _loss(model, 0).backward()
        end = time.monotonic() + 10
        while opt.exchange.servers.shards[1][0].shard.step != 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert opt.exchange.servers.shards[1][0].shard.step == 1
        time.sleep(0.2)
        chief = opt.exchange.servers.chief
        assert chief.shard.step == 0, "shard 0 went before its spare's gradient"
        opt.step()
        assert opt.exchange.servers.chief.shard.step == 1 and opt.global_step == 1
    finally:
        opt.close()


# --------------------------------------------------------------------- misuse
@pytest.mark.timeout(60)
def test_second_backward_before_step_raises():
    model = _model()
    opt = _sync(model, True, shards=2)
    try:
        _loss(model, 0).backward()
        with pytest.raises(RuntimeError, match=r"accumulated twice.*overlap=False"):
            _loss(model, 1).backward()
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_apply_gradients_after_overlapped_backward_raises():
    model = _model()
    opt = _sync(model, True, shards=2)
    try:
        _loss(model, 0).backward()
        pairs = [(p.grad * 0.5, p) for p in model.parameters()]
        gs = torch.zeros((), dtype=torch.int64)
        with pytest.raises(RuntimeError, match=r"overlap=True backward already pushed"):
            opt.apply_gradients(pairs, gs)
    finally:
        opt.close()


def test_apply_gradients_without_backward_works_with_overlap():
    model = _model()
    opt = _sync(model, True, shards=2)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        grads = [torch.ones_like(p) for p in model.parameters()]
        opt.apply_gradients(list(zip(grads, model.parameters(), strict=True)), torch.zeros(()))
        for p, b in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(p.detach(), b - TF_LR, rtol=0, atol=4e-16)
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_query_between_backward_and_step_raises_and_step_still_works():
    model = _model()
    opt = _sync(model, True, shards=2)
    try:
        _loss(model, 0).backward()
        with pytest.raises(RuntimeError, match=r"'stats' while this step's pushes are in flight"):
            opt.worker_counters(1)
        opt.step()
        assert opt.global_step == 1
        assert opt.worker_counters(1) == {0: {"accepted": 1, "dropped": 0, "nonfinite": 0}}
    finally:
        opt.close()


@pytest.mark.timeout(60)
def test_one_server_keeps_nonfinite_raise():
    """One server judges the whole gradient set: a NaN still raises FloatingPointError from
    step() with nothing applied, and the next finite step is an update."""
    model = _model()
    opt = _sync(model, True, shards=1)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        (_loss(model, 0) * float("nan")).backward()
        with pytest.raises(FloatingPointError, match="non-finite gradient"):
            opt.step()
        _equal([p.detach() for p in model.parameters()], before)
        assert opt.global_step == 0
        opt.zero_grad()
        _loss(model, 1).backward()
        opt.step()
        assert opt.global_step == 1 and opt.last_gradient_accepted is True
    finally:
        opt.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"overlap": "yes"}, r"overlap must be True, False or None, got 'yes'"),
        (
            {"overlap": True, "server_ranks": [0, 0], "nonfinite": "raise"},
            r"overlap=True with 2 shards needs nonfinite='apply' \(got 'raise'\)",
        ),
        (
            {"overlap": True, "server_ranks": [0, 0], "nonfinite": "drop"},
            r"overlap=True with 2 shards needs nonfinite='apply' \(got 'drop'\)",
        ),
    ],
)
def test_constructor_errors(kwargs, match):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        SyncReplicasOptimizer(gradfleet.GradientDescentOptimizer(model.parameters(), 0.1), 1, 1,
                              **kwargs)  # fmt: skip
    _equal([p.detach() for p in model.parameters()], before)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


# --------------------------------------------------------------------- real processes
SCHEDULE = [0, 0, 1, 1, 0, 2] * 2  # R=2 of N=3, one initial token: nobody ever blocks


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("server_ranks", "nonfinite"), [(None, "raise"), ([0, 1], "apply")])
def test_backup_worker_sequence_over_processes(server_ranks, nonfinite):
    R, N, tokens = 2, 3, 1
    out = run_ranks(
        overlap_ranks.sequenced, N, args=(R, N, tokens, SCHEDULE, server_ranks, nonfinite),
        timeout=100,
    )  # fmt: skip
    for rank in range(N):
        for model in ("linear", "mlp"):
            off, on = out[rank][f"{model}-False"], out[rank][f"{model}-True"]
            _equal(on["params"], off["params"])
            assert on["global_step"] == off["global_step"]
            assert on["counters"] == off["counters"]
    # the last worker to step read the final variables: TF's FIFO simulation in float64
    schedule = [k for k in SCHEDULE for _ in (0, 1)]  # a step: push + token, then ready
    grads = {k: [overlap_ranks.linear_grads(k)] for k in range(N)}
    tf_lr = float(torch.tensor(overlap_ranks.LR, dtype=torch.float32))  # TF casts it
    want, want_step, _ = reference_fifo(R, N, tokens, schedule, grads, tf_lr)
    last = out[SCHEDULE[-1]]["linear-True"]
    assert last["global_step"] == want_step == 4
    torch.testing.assert_close(
        torch.cat(last["params"]),
        torch.tensor(want, dtype=F64),
        rtol=0,
        atol=1e-15,
        msg=lambda m: f"{m}\n{out}",
    )
    dropped = sum(out[r]["linear-True"]["counters"]["dropped"] for r in range(N))
    assert dropped > 0  # the backup worker's stale gradients were dropped


@pytest.mark.timeout(120)
def test_dedicated_server_ranks_same_as_without_overlap():
    """Two workers in lockstep, two dedicated shard servers (ranks 2, 3) taking the workers'
    learning rate from their pushes (it drops after step 2): bit-identical with overlap, so
    the early pushes carried the new rate too."""
    out = run_ranks(overlap_ranks.dedicated_lockstep, 4, args=(2, [2, 3], 5), timeout=100)
    for rank in (0, 1):
        off, on = out[rank][False], out[rank][True]
        assert [s for s, _ in on] == [s for s, _ in off] == [1, 2, 3, 4, 5]
        for (_, a), (_, b) in zip(on, off, strict=True):
            _equal(a, b)
