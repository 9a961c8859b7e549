"""ElasticAverageOptimizer (synchronous all-reduce centre): TF's 1-worker oracle with the centre
export, TF's defaults and penalty, randomised runs at world sizes 2 and 3 against the float64
simulation, validation and checkpoints."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import gradfleet
from gradfleet.distributed import ElasticAverageOptimizer
from gradfleet.distributed.testing import run_ranks
from tests.distributed import ranks
from tests.distributed.sims import F64, batch, make_mlp, mse, simulate_easgd

pytestmark = pytest.mark.timeout(90)


class TwoVars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v0 = nn.Parameter(torch.tensor(0.0, dtype=F64))
        self.v1 = nn.Parameter(torch.tensor(1.0, dtype=F64))


@pytest.mark.parametrize("family", ["torch", "gradfleet"])
def test_tf_oracle_one_worker_period_two_and_swapping_export(family, tmp_path):
    m = TwoVars()
    params = [m.v0, m.v1]
    inner = (
        torch.optim.SGD(params, lr=1.0)
        if family == "torch"
        else gradfleet.GradientDescentOptimizer(params, 1.0)
    )
    opt = ElasticAverageOptimizer(inner, num_worker=1, communication_period=2, moving_rate=1.0)
    gstep = torch.zeros((), dtype=torch.int64)
    g = torch.tensor(-1.0, dtype=F64)

    def state():
        c = opt.centre()
        return (m.v0.item(), m.v1.item(), c[0].item(), c[1].item(), int(gstep))

    assert state() == (0.0, 1.0, 0.0, 1.0, 0)
    expected = [(1.0, 2.0, 0.0, 1.0, 0), (0.0, 1.0, 2.0, 3.0, 1), (1.0, 2.0, 2.0, 3.0, 1)]
    for want in expected:
        opt.apply_gradients([(g, m.v0), (g, m.v1)], global_step=gstep)
        assert state() == want
    opt.apply_gradients([(g, m.v0), (g, m.v1)], global_step=gstep)
    path = tmp_path / "centre.pt"
    torch.save(opt.swapping_state_dict(m), path)
    plain = TwoVars()  # a plain model, no EASGD
    plain.load_state_dict(torch.load(path, weights_only=True))
    assert (plain.v0.item(), plain.v1.item()) == (2.0, 3.0)


@pytest.mark.parametrize(
    ("world", "tau", "steps", "family", "lr"),
    [(2, 2, 6, "torch", 0.05), (3, 3, 7, "gradfleet", 0.02)],
)
def test_random_matches_simulation(world, tau, steps, family, lr):
    out = run_ranks(ranks.easgd_random, world, args=(tau, steps, family, lr))
    ref = simulate_easgd(world, tau, steps, ranks.easgd_opt_fn(family), lr)
    for r in range(world):
        assert out[r]["moving_rate"] == 0.9 / tau / world
        assert out[r]["global_step"] == ref["global_step"]
        for s in range(steps):
            for got, want in zip(out[r]["traj"][s], ref["traj"][r][s], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
            for got, want in zip(out[r]["centres"][s], ref["centres"][s], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for s in range(steps):  # the replicated centre is bitwise identical on every rank
        assert all(
            torch.equal(a, b)
            for a, b in zip(out[0]["centres"][s], out[-1]["centres"][s], strict=True)
        )


# --------------------------------------------------------------------- one process
def test_defaults_follow_tf_for_any_optimizer():
    for inner_fn, lr in (
        (lambda p: torch.optim.SGD(p, lr=0.5), 0.5),
        (lambda p: torch.optim.Adam(p, lr=0.01), 0.01),
        (lambda p: gradfleet.AdamOptimizer(p, 0.01), 0.01),
    ):
        p = nn.Parameter(torch.tensor([1.0, 2.0], dtype=F64))
        opt = ElasticAverageOptimizer(inner_fn([p]), num_worker=1, communication_period=4)
        assert opt.moving_rate == 0.9 / 4 and opt.rho is None
        with torch.no_grad():
            p.add_(torch.tensor([1.0, -2.0], dtype=F64))  # x - c_loc = (1, -2)
        ((g, _),) = opt.compute_gradients((p * 0).sum())
        rho = opt.moving_rate / lr  # TF: rho = moving_rate / learning_rate
        torch.testing.assert_close(g, torch.tensor([rho, -2 * rho], dtype=F64))


def test_penalty_uses_the_centre_read_at_the_last_exchange():
    # rho * (x - c_loc): c_loc is the centre *before* the exchange's update (TF's local centre)
    p = nn.Parameter(torch.tensor([0.0], dtype=F64))
    opt = ElasticAverageOptimizer(
        torch.optim.SGD([p], lr=1.0), 1, communication_period=1, moving_rate=0.5, rho=0.25
    )
    opt.apply_gradients([(torch.tensor([-4.0], dtype=F64), p)])
    # x: 0 -> 4; exchange: c_loc = 0, d = 4, x = 2, c = 2
    assert (p.item(), opt.centre()[0].item(), opt.local_centre()[0].item()) == (2.0, 2.0, 0.0)
    ((g, _),) = opt.compute_gradients((3 * p).sum())
    assert g.item() == 3.0 + 0.25 * (2.0 - 0.0)
    opt.zero_grad()
    (3 * p).sum().backward()
    opt.add_elastic_penalty_()  # the torch-style loop gets the same gradient
    assert p.grad.item() == g.item()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_worker": 0}, "num_worker must be an integer >= 1"),
        ({"communication_period": 0}, "communication_period must be an integer >= 1"),
        ({"moving_rate": 0.0}, r"moving_rate must be a number in \(0, 1\]"),
        ({"moving_rate": 1.5}, r"moving_rate must be a number in \(0, 1\]"),
        ({"moving_rate": float("nan")}, "moving_rate must be a number"),
        ({"rho": -1.0}, "rho must be a number >= 0"),
        ({"synchronous": "yes"}, "synchronous must be a bool"),
        ({"mode": "gossip"}, r"mode must be one of \[.*'allreduce'.*\], got 'gossip'"),
    ],
)
def test_bad_arguments(kwargs, match):
    p = nn.Parameter(torch.tensor([1.0], dtype=F64))
    inner = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match=match):
        ElasticAverageOptimizer(inner, **{"num_worker": 1, **kwargs})
    assert p.item() == 1.0 and not inner.state


def test_rho_default_needs_a_learning_rate_and_group_size():
    p = nn.Parameter(torch.tensor([1.0], dtype=F64))
    with pytest.raises(ValueError, match="has no positive 'lr'; pass rho explicitly"):
        ElasticAverageOptimizer(torch.optim.SGD([p], lr=0.0), 1)
    ElasticAverageOptimizer(torch.optim.SGD([p], lr=0.0), 1, rho=0.0)  # explicit rho is fine
    with pytest.raises(RuntimeError, match="num_worker=3 needs torch.distributed"):
        ElasticAverageOptimizer(torch.optim.SGD([p], lr=0.1), 3)


def test_state_dict_round_trip_with_centre():
    def build(seed):
        model = make_mlp(seed)
        inner = torch.optim.Adam(model.parameters(), lr=0.05)
        return model, ElasticAverageOptimizer(inner, 1, communication_period=2, moving_rate=0.3)

    model, opt = build(100)
    for s in range(3):
        x, y = batch(0, s)
        opt.minimize(lambda x=x, y=y: mse(model, x, y))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = build(7)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert (opt2.local_step, opt2.global_step) == (3, 1)
    for m, o in ((model, opt), (model2, opt2)):
        x, y = batch(0, 3)
        o.minimize(lambda m=m, x=x, y=y: mse(m, x, y))  # step 4 exchanges with the centre
    for a, b in zip(
        opt.centre() + list(model.parameters()),
        opt2.centre() + list(model2.parameters()),
        strict=True,
    ):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="checkpoint has communication_period=2"):
        _, opt3 = build(1)
        opt3.communication_period = 5
        opt3.load_state_dict(ckpt["opt"])
