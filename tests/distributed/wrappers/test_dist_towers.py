"""TowerOptimizer + replicate_model: TF's replicate_model_fn_test oracles, errors, and a
randomised comparison with a float64 full-batch reference. One process, CPU "devices"."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import gradfleet
from gradfleet.distributed import TowerOptimizer, replicate_model, split_batch

pytestmark = pytest.mark.timeout(60)

F64 = torch.float64
FEATURES = torch.tensor([[1.0], [2.0]], dtype=F64)
LABELS = torch.tensor([[1.0], [2.0]], dtype=F64)


class Scalars(nn.Module):
    """TF test model: scalar variables ``c`` (init 10) and ``d`` (init 2)."""

    def __init__(self, c: float = 10.0, d: float = 2.0) -> None:
        super().__init__()
        self.c = nn.Parameter(torch.tensor(c, dtype=F64))
        self.d = nn.Parameter(torch.tensor(d, dtype=F64))


def abs_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (pred - labels).abs().sum()  # absolute_difference with SUM reduction


def sgd(params, lr=1.0, family="torch"):
    if family == "gradfleet":
        return gradfleet.GradientDescentOptimizer(params, lr)
    return torch.optim.SGD(params, lr=lr)


def minimize_fn(opt):
    def model_fn(m, f, y):
        loss = abs_loss(f * m.c, y)
        opt.minimize(loss)
        return loss

    return model_fn


FAMILIES = ["torch", "gradfleet"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("reduction", "loss", "c"), [("sum", 27.0, 7.0), ("mean", 13.5, 8.5)])
def test_oracle_sum_and_mean(family, reduction, loss, c):
    m = Scalars()
    opt = TowerOptimizer(sgd([m.c], family=family))
    rm = replicate_model(minimize_fn(opt), m, loss_reduction=reduction, devices=["cpu", "cpu"])
    out = rm(FEATURES, LABELS)
    assert out.loss.item() == loss
    assert m.c.item() == c
    assert all(t.c.item() == c for t in rm.towers)  # towers stay identical


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_two_steps_and_global_step(family):
    m = Scalars()
    opt = TowerOptimizer(sgd([m.c], family=family))
    gstep = torch.zeros((), dtype=torch.int64)

    def model_fn(mod, f, y):
        loss = abs_loss(f * mod.c, y)
        opt.apply_gradients(opt.compute_gradients(loss), global_step=gstep)
        return loss

    rm = replicate_model(model_fn, m, loss_reduction="sum", devices=["cpu", "cpu"])
    assert rm(FEATURES, LABELS).loss.item() == 27.0 and m.c.item() == 7.0
    f2 = torch.tensor([[1.5], [2.5]], dtype=F64)
    assert rm(f2, f2).loss.item() == 24.0 and m.c.item() == 3.0
    assert gstep.item() == 2  # once per replicated step, not once per tower


def test_oracle_single_tower_variants():
    # one device: no split, no scaling; TowerOptimizer without replication: plain delegation
    for wrap in (True, False):
        m = Scalars()
        inner = torch.optim.SGD([m.c], lr=1.0)
        opt = TowerOptimizer(inner) if wrap else inner

        def model_fn(mod, f, y, opt=opt):
            loss = abs_loss(f * mod.c, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        replicate_model(model_fn, m, loss_reduction="mean", devices=["cpu"])(FEATURES, LABELS)
        assert m.c.item() == 7.0
    m = Scalars()
    opt = TowerOptimizer(torch.optim.SGD([m.c], lr=1.0))
    opt.minimize(abs_loss(FEATURES * m.c, LABELS))
    assert m.c.item() == 7.0


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_two_optimizers_per_tower(family):
    m = Scalars()
    calls = []
    sgd_opt = TowerOptimizer(sgd([m.c], family=family))
    if family == "gradfleet":
        adam = TowerOptimizer(lambda: gradfleet.AdamOptimizer([m.c], 1.0))
    else:
        adam = TowerOptimizer(lambda: torch.optim.Adam([m.c], lr=1.0))

    def model_fn(mod, f, y):
        calls.append(1)  # side-effect counter: once per tower
        loss = abs_loss(f * mod.c, y)
        sgd_opt.apply_gradients(sgd_opt.compute_gradients(loss))
        adam.minimize(lambda: abs_loss(f * mod.c, y))  # eager: a fresh graph per gradient
        return loss

    replicate_model(model_fn, m, loss_reduction="sum", devices=["cpu", "cpu"])(FEATURES, LABELS)
    assert m.c.item() == pytest.approx(6.0, abs=1e-6)  # SGD -3, Adam's first step -(1 - eps)
    assert len(calls) == 2


def test_oracle_two_losses_two_optimizers_and_call_mismatch():
    m = Scalars()
    opt_c = TowerOptimizer(torch.optim.SGD([m.c], lr=1.0))
    opt_d = TowerOptimizer(torch.optim.SGD([m.d], lr=1.0))

    def model_fn(mod, f, y):
        opt_c.minimize(abs_loss(f * mod.c, y), var_list=[m.c])
        opt_d.minimize(abs_loss(f * mod.d, y), var_list=[m.d])
        return abs_loss(f * mod.c, y)

    replicate_model(model_fn, m, loss_reduction="sum", devices=["cpu", "cpu"])(FEATURES, LABELS)
    assert (m.c.item(), m.d.item()) == (7.0, -1.0)

    m2 = Scalars()
    o1 = TowerOptimizer(torch.optim.SGD([m2.c], lr=1.0))
    o2 = TowerOptimizer(torch.optim.SGD([m2.d], lr=1.0))

    def skipping_fn(mod, f, y):
        o1.minimize(abs_loss(f * mod.c, y))
        if f[0, 0] == 1.0:
            o2.minimize(abs_loss(f * mod.d, y))  # only tower 0 calls the second optimizer
        return abs_loss(f * mod.c, y)

    rm = replicate_model(skipping_fn, m2, loss_reduction="sum", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="supposed to make the same optimizer calls"):
        rm(FEATURES, LABELS)
    assert (m2.c.item(), m2.d.item()) == (10.0, 2.0)  # nothing applied


def test_oracle_reduce_constant_tower_losses():
    m = Scalars()
    opt = TowerOptimizer(torch.optim.SGD([m.c], lr=0.0))

    def model_fn(mod, f, y):
        opt.minimize((mod.c * 0).sum())
        return torch.tensor(2.0 * (int(f[0, 0].item()) + 1), dtype=F64)  # 2, 4, 6

    rm = replicate_model(model_fn, m, loss_reduction="sum", devices=["cpu"] * 3)
    out = rm(torch.arange(3, dtype=F64).reshape(3, 1), None)
    assert out.loss.item() == 12.0
    assert [t.item() for t in out.tower_losses] == [2.0, 4.0, 6.0]


def test_split_batch_and_errors():
    x = torch.arange(4)
    assert [t.tolist() for t in split_batch(x, 2)] == [[0, 1], [2, 3]]
    assert [t.tolist() for t in split_batch(x, 4)] == [[0], [1], [2], [3]]
    parts = split_batch({"a": x, "b": (x * 2, None)}, 2)
    assert parts[1]["a"].tolist() == [2, 3] and parts[1]["b"][0].tolist() == [4, 6]
    with pytest.raises(ValueError, match="Batch size 3 needs to be divisible .* which is 2"):
        split_batch(torch.arange(3), 2)

    m = Scalars()
    opt = TowerOptimizer(torch.optim.SGD([m.c], lr=1.0))
    rm = replicate_model(minimize_fn(opt), m, loss_reduction="sum", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="needs to be divisible"):
        rm(torch.ones(3, 1, dtype=F64), torch.ones(3, 1, dtype=F64))
    assert m.c.item() == 10.0
    with pytest.raises(ValueError, match="Tower losses need to be reduced in some way"):
        replicate_model(minimize_fn(opt), m, loss_reduction="none", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        replicate_model(minimize_fn(opt), m, loss_reduction="avg", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="devices must name at least one device"):
        replicate_model(minimize_fn(opt), m, devices=[])
    with pytest.raises(TypeError, match="optimizer_or_optimizer_fn"):
        TowerOptimizer(3)


def test_plain_optimizer_in_towers_is_rejected():
    m = Scalars()
    plain = torch.optim.SGD([m.c], lr=1.0)

    def model_fn(mod, f, y):
        loss = abs_loss(f * mod.c, y)
        plain.zero_grad()
        loss.backward()
        plain.step()
        return loss

    rm = replicate_model(model_fn, m, loss_reduction="sum", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="Please wrap optimizers with TowerOptimizer"):
        rm(FEATURES, LABELS)


def test_towers_run_in_parallel_threads():
    m = Scalars()
    opt = TowerOptimizer(torch.optim.SGD([m.c], lr=1.0))
    barrier = threading.Barrier(2, timeout=5)  # deadlocks unless both towers run at once
    seen = set()

    def model_fn(mod, f, y):
        barrier.wait()
        seen.add(threading.get_ident())
        loss = abs_loss(f * mod.c, y)
        opt.minimize(loss)
        return loss

    replicate_model(model_fn, m, loss_reduction="sum", devices=["cpu", "cpu"])(FEATURES, LABELS)
    assert len(seen) == 2 and m.c.item() == 7.0


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_gradients_are_concatenated(family):
    emb = nn.Embedding(5, 3, sparse=True).double()
    start = emb.weight.detach().clone()
    opt = TowerOptimizer(sgd(emb.parameters(), lr=0.5, family=family))
    grads_seen = []

    def model_fn(mod, ids, _):
        loss = mod(ids).sum()
        pairs = opt.compute_gradients(loss)
        grads_seen.append(pairs[0][0])
        opt.apply_gradients(pairs)
        return loss

    ids = torch.tensor([1, 1, 2, 1, 4, 4])
    replicate_model(model_fn, emb, loss_reduction="sum", devices=["cpu", "cpu"])(ids, None)
    assert all(g.is_sparse for g in grads_seen)
    counts = torch.bincount(ids, minlength=5).to(F64)
    expected = start - 0.5 * counts[:, None]  # duplicates (within and across towers) add up
    torch.testing.assert_close(emb.weight.detach(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("towers", [2, 3])
def test_random_mean_towers_match_full_batch(towers):
    gen = torch.Generator().manual_seed(towers)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    ref = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    ref.load_state_dict(net.state_dict())
    opt = TowerOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def model_fn(mod, x, y):
        loss = ((mod(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()  # torch-style inside a tower: step() scales by 1/T
        opt.step()
        return loss

    rm = replicate_model(model_fn, net, loss_reduction="mean", devices=["cpu"] * towers)
    for _ in range(4):
        x = torch.randn(6, 4, generator=gen, dtype=F64)
        y = torch.randn(6, 1, generator=gen, dtype=F64)
        out = rm(x, y)
        # Reference: mean of per-tower mean losses == full-batch mean (equal shards).
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out.loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for t in rm.towers:
        for a, b in zip(t.parameters(), net.parameters(), strict=True):
            assert torch.equal(a, b)


def test_tower_state_dict_and_properties():
    m = Scalars()
    inner = torch.optim.SGD([m.c], lr=1.0, momentum=0.5)
    opt = TowerOptimizer(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    replicate_model(minimize_fn(opt), m, loss_reduction="sum", devices=["cpu", "cpu"])(
        FEATURES, LABELS
    )
    assert torch.equal(opt.get_slot(m.c, "momentum_buffer"), torch.tensor(3.0, dtype=F64))
    assert opt.get_slot_names() == ["momentum_buffer"]
    sd = opt.state_dict()
    m2 = Scalars()
    opt2 = TowerOptimizer(torch.optim.SGD([m2.c], lr=1.0, momentum=0.5))
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.get_slot(m2.c, "momentum_buffer"), torch.tensor(3.0, dtype=F64))
    with pytest.raises(ValueError, match="saved by ModelAverageOptimizer"):
        opt2.load_state_dict(dict(sd, wrapper="ModelAverageOptimizer"))
