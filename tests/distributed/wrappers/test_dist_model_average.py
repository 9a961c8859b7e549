"""ModelAverageOptimizer: TF's oracle on 2 real ranks, randomised runs at world sizes 2 and 3
against the float64 simulation, and single-process interface tests (num_worker=1)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import gradfleet
from gradfleet.distributed import ModelAverageOptimizer
from gradfleet.distributed.testing import run_ranks
from tests.distributed import ranks
from tests.distributed.sims import F64, batch, make_bn_model, mse, simulate_model_average

pytestmark = pytest.mark.timeout(90)


def test_tf_oracle_two_workers_interval_two():
    out = run_ranks(ranks.model_average_oracle, 2)
    for family in ("torch", "gradfleet"):
        # (v0, v1, global_step tensor, wrapper global_step, local_step) after each step
        assert out[0][family] == [(1.0, 2.0, 0, 0, 1), (3.0, 4.0, 1, 1, 2), (4.0, 5.0, 1, 1, 3)]
        assert out[1][family] == [(2.0, 3.0, 0, 0, 1), (3.0, 4.0, 1, 1, 2)]


@pytest.mark.parametrize(("world", "interval", "steps"), [(2, 2, 5), (3, 3, 7)])
def test_random_matches_simulation(world, interval, steps):
    out = run_ranks(ranks.model_average_random, world, args=(interval, steps))
    ref = simulate_model_average(world, interval, steps)
    for r in range(world):
        assert out[r]["global_step"] == steps // interval and out[r]["local_step"] == steps
        for s in range(steps):
            for got, want in zip(out[r]["traj"][s], ref[r][s], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for s in range(steps):  # at averaging steps every replica holds the bitwise-same values
        same = all(
            torch.equal(a, b) for a, b in zip(out[0]["traj"][s], out[-1]["traj"][s], strict=True)
        )
        assert same == ((s + 1) % interval == 0)


# --------------------------------------------------------------------- one process
def _params():
    return [nn.Parameter(torch.tensor([1.0, 2.0], dtype=F64))]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_worker": 0}, "num_worker must be an integer >= 1"),
        ({"num_worker": 1.5}, "num_worker must be an integer >= 1"),
        ({"num_worker": 1, "interval_steps": 0}, "interval_steps must be an integer >= 1"),
        ({"num_worker": 1, "interval_steps": True}, "interval_steps must be an integer >= 1"),
    ],
)
def test_bad_arguments(kwargs, match):
    params = _params()
    inner = torch.optim.SGD(params, lr=1.0)
    with pytest.raises(ValueError, match=match):
        ModelAverageOptimizer(inner, **kwargs)
    assert torch.equal(params[0].detach(), torch.tensor([1.0, 2.0], dtype=F64))


def test_needs_process_group_and_optimizer():
    with pytest.raises(RuntimeError, match="num_worker=2 needs torch.distributed"):
        ModelAverageOptimizer(torch.optim.SGD(_params(), lr=1.0), num_worker=2)
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer"):
        ModelAverageOptimizer(object(), num_worker=1)


def test_torch_protocol_and_tf_methods():
    params = _params()
    inner = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    opt = ModelAverageOptimizer(inner, num_worker=1, interval_steps=2)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gstep = torch.zeros((), dtype=torch.int64)
    for _ in range(3):
        opt.zero_grad()
        (params[0] ** 2).sum().backward()
        opt.step()
        sched.step()
    opt.minimize(lambda: (params[0] ** 2).sum(), global_step=gstep)
    assert inner.param_groups[0]["lr"] == 0.5 * 0.5**3
    assert (opt.local_step, opt.global_step, int(gstep)) == (4, 2, 1)
    assert opt.get_slot_names() == ["momentum_buffer"]
    assert opt.get_slot(params[0], "momentum_buffer") is inner.state[params[0]]["momentum_buffer"]
    assert opt.variables() == [inner.state[params[0]]["momentum_buffer"]]
    assert opt.get_name() == "ModelAverageOptimizer"
    opt.zero_grad()
    pairs = opt.compute_gradients((params[0] * 3).sum())
    assert torch.equal(pairs[0][0], torch.full((2,), 3.0, dtype=F64)) and params[0].grad is None
    with pytest.raises(ValueError, match="Must supply at least one variable"):
        opt.apply_gradients([])
    with pytest.raises(ValueError, match="No gradients provided"):
        opt.apply_gradients([(None, params[0])])
    with pytest.raises(TypeError, match="global_step must be None or a 0-dim torch.int64"):
        opt.apply_gradients(pairs, global_step=torch.zeros(()))
    assert opt.local_step == 4  # rejected calls changed nothing


def test_gradfleet_inner_delegation():
    params = _params()
    inner = gradfleet.MomentumOptimizer(params, 0.5, 0.9)
    opt = ModelAverageOptimizer(inner, num_worker=1, interval_steps=1)
    opt.minimize(lambda: (params[0] ** 2).sum())
    assert opt.get_slot_names() == inner.get_slot_names()
    assert opt.get_slot(params[0], "momentum") is inner.get_slot(params[0], "momentum")
    torch.testing.assert_close(params[0].detach(), torch.tensor([0.0, 0.0], dtype=F64))


def test_state_dict_round_trip_includes_counters():
    torch.manual_seed(0)
    model = make_bn_model(0)
    opt = ModelAverageOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        1,
        interval_steps=3,
        buffers=model.buffers(),
        average_optimizer_state=True,
    )
    for s in range(4):
        opt.zero_grad()
        mse(model, *batch(0, s)).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2 = make_bn_model(1)
    model2.load_state_dict(ckpt["model"])
    opt2 = ModelAverageOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9),
        1,
        interval_steps=3,
        buffers=model2.buffers(),
        average_optimizer_state=True,
    )
    opt2.load_state_dict(ckpt["opt"])
    assert (opt2.local_step, opt2.global_step) == (4, 1)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        mse(m, *batch(0, 9)).backward()
        o.step()
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    bad = opt.state_dict()
    bad["wrapper_state"]["interval_steps"] = 5
    with pytest.raises(ValueError, match="checkpoint has interval_steps=5"):
        opt2.load_state_dict(bad)
    assert opt2.local_step == 5
