"""torch conventions and TF1's API on every optimizer of the conformance table."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import gradfleet as gf
from tests.conformance.specs import SPECS
from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS

ALL_SPECS = SPECS + RETURNN_SPECS
SPEC_IDS = [s.name for s in ALL_SPECS]


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=dtype)),
        torch.nn.Parameter(torch.randn(5, generator=g, dtype=dtype)),
    ]


def _grads(step, params):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _run(opt, params, steps, start=0):
    for s in range(start, start + steps):
        for p, g in zip(params, _grads(s, params)):
            p.grad = g
        opt.step()


def _snapshot(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [opt.get_slot(p, n).clone() for n in opt.get_slot_names()]
    return out


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_state_dict_round_trip_continues_identically(spec):
    params = _params()
    opt = spec.build(params, dict(spec.configs[0]))
    _run(opt, params, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = spec.build(params2, dict(spec.configs[0]))
    opt2.load_state_dict(saved)
    _run(opt, params, 3, start=3)
    _run(opt2, params2, 3, start=3)
    for a, b in zip(_snapshot(opt, params), _snapshot(opt2, params2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_state_dict_from_other_parameters_is_refused(spec):
    params = _params()
    opt = spec.build(params, dict(spec.configs[0]))
    _run(opt, params, 1)
    other = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    opt_other = spec.build(other, dict(spec.configs[0]))
    before = _snapshot(opt_other, other) if opt_other.state else None
    with pytest.raises(ValueError, match="shapes"):
        opt_other.load_state_dict(opt.state_dict())
    assert before is None and not opt_other.state


def test_state_dict_from_another_optimizer_is_refused():
    params = _params()
    adam = gf.AdamOptimizer(params)
    _run(adam, params, 1)
    sgd = gf.MomentumOptimizer(params, 0.1, 0.9)
    with pytest.raises(ValueError, match="saved by AdamOptimizer"):
        sgd.load_state_dict(adam.state_dict())
    torch_adam = torch.optim.Adam(params)
    with pytest.raises(ValueError, match="not a gradfleet state dict"):
        adam.load_state_dict(torch_adam.state_dict())


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_invalid_learning_rate_names_the_argument(spec):
    config = dict(spec.configs[0], learning_rate=-1.0)
    with pytest.raises(ValueError, match="learning_rate"):
        spec.build(_params(), config)
    config = dict(spec.configs[0], learning_rate=float("nan"))
    with pytest.raises(ValueError, match="learning_rate"):
        spec.build(_params(), config)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_bad_gradient_changes_nothing(spec):
    params = _params()
    opt = spec.build(params, dict(spec.configs[0]))
    _run(opt, params, 1)
    before = _snapshot(opt, params)
    # torch refuses a wrong-shaped .grad itself; apply_gradients must refuse the whole step
    wrong = [(torch.ones(4, 3), params[0]), (torch.ones(6), params[1])]
    with pytest.raises(ValueError, match="does not match parameter"):
        opt.apply_gradients(wrong)
    if opt.sparse is not None:
        params[0].grad = torch.ones(4, 3)
        params[1].grad = torch.sparse_coo_tensor([[0, 5]], torch.ones(2), (5,))
        with pytest.raises(IndexError, match="out of range"):
            opt.step()
    for a, b in zip(before, _snapshot(opt, params)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_non_finite_gradient_policy(spec):
    # Default: TensorFlow's behaviour, NaN flows into the parameter (nothing is hidden).
    params = _params()
    opt = spec.build(params, dict(spec.configs[0]))
    params[0].grad = torch.full((4, 3), float("nan"))
    opt.step()
    assert torch.isnan(params[0]).any() or spec.name in _NAN_SAFE
    # check_finite=True: refused, nothing changed.
    params = _params()
    opt = spec.build(params, dict(spec.configs[0], check_finite=True))
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones(4, 3)
    params[1].grad = torch.tensor([1.0, float("inf"), 0.0, 0.0, 0.0])
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()
    assert not opt.state
    for a, p in zip(before, params):
        torch.testing.assert_close(a, p.detach(), rtol=0, atol=0)


# Optimizers whose closed form discards a NaN gradient's effect on w by construction
# (FTRL's select `|z| > l1 ? x/y : 0` maps NaN comparisons to 0, as TF's kernel does).
_NAN_SAFE = {"FtrlOptimizer"}


@pytest.mark.parametrize("spec", ALL_SPECS, ids=SPEC_IDS)
def test_minimize_equals_step_and_counts_global_step(spec):
    torch.manual_seed(0)
    x = torch.randn(8, 3)
    params_a, params_b = _params(), _params()
    opt_a = spec.build(params_a, dict(spec.configs[0]))
    opt_b = spec.build(params_b, dict(spec.configs[0]))
    gs = torch.zeros((), dtype=torch.int64)
    for _ in range(3):
        loss_b = lambda: ((x @ params_b[0].T) ** 2).sum() + params_b[1].pow(3).sum()  # noqa: E731
        opt_b.minimize(loss_b, global_step=gs)
        opt_a.zero_grad()
        (((x @ params_a[0].T) ** 2).sum() + params_a[1].pow(3).sum()).backward()
        opt_a.step()
    assert gs.item() == 3
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compute_gradients_returns_pairs_and_leaves_grad_alone():
    params = _params()
    unused = torch.nn.Parameter(torch.zeros(2))
    opt = gf.GradientDescentOptimizer(params + [unused], learning_rate=0.5)
    loss = (params[0] ** 2).sum() * 0.5 + params[1].sum()
    pairs = opt.compute_gradients(loss)
    assert [p is q for (_, p), q in zip(pairs, params + [unused])] == [True] * 3
    torch.testing.assert_close(pairs[0][0], params[0].detach())
    torch.testing.assert_close(pairs[1][0], torch.ones(5))
    assert pairs[2][0] is None
    assert all(p.grad is None for p in params)
    expected = [p.detach() - 0.5 * g for g, p in pairs[:2]]
    opt.apply_gradients(pairs)
    torch.testing.assert_close(params[0].detach(), expected[0])
    torch.testing.assert_close(params[1].detach(), expected[1])
    torch.testing.assert_close(unused.detach(), torch.zeros(2))


def test_apply_gradients_errors_like_tf():
    params = _params()
    opt = gf.AdamOptimizer(params)
    with pytest.raises(ValueError, match="No variables provided"):
        opt.apply_gradients([])
    with pytest.raises(ValueError, match="No gradients provided"):
        opt.apply_gradients([(None, params[0])])
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.apply_gradients([(torch.ones(3), stranger)])
    with pytest.raises(TypeError, match="int64"):
        opt.apply_gradients([(torch.ones(4, 3), params[0])], global_step=torch.zeros(()))
    assert not opt.state


def test_adam_shared_beta_powers_advance_once_per_step_and_skip_untouched_params():
    params = _params()
    opt = gf.AdamOptimizer(params, learning_rate=0.1, beta1=0.8, beta2=0.95)
    _run(opt, params, 2)
    frozen = [params[1].detach().clone(), opt.get_slot(params[1], "m").clone()]
    for s in range(3):  # params[1] gets no gradient: untouched, its slots do not decay
        params[0].grad, params[1].grad = _grads(10 + s, params)[0], None
        opt.step()
    torch.testing.assert_close(params[1].detach(), frozen[0], rtol=0, atol=0)
    torch.testing.assert_close(opt.get_slot(params[1], "m"), frozen[1], rtol=0, atol=0)
    b1 = np.float32(0.8)
    expected = b1
    for _ in range(5):  # float32 accumulation by repeated multiplication, as TF does
        expected = np.float32(expected * b1)
    shared = opt.param_groups[0]["non_slot"]
    assert shared["beta1_power"].dtype == torch.float32
    assert shared["beta1_power"].item() == float(expected)


def test_float64_hyperparameters_are_float32_rounded_like_tf():
    # optimizer-semantics.md 1.4: m = (1 - f32(0.9)) * 0.4 = 0.04000000953674317
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = gf.AdamOptimizer([w])
    w.grad = torch.tensor([0.4], dtype=torch.float64)
    opt.step()
    assert opt.get_slot(w, "m").item() == 0.04000000953674317


def test_param_groups_lr_scheduler_and_callable_hyperparameters():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = gf.GradientDescentOptimizer(
        [{"params": [a]}, {"params": [b], "learning_rate": 0.5}], learning_rate=0.25
    )
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.5]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    expected_a, expected_b = 0.0, 0.0
    for step in range(3):
        a.grad, b.grad = torch.ones(3), torch.ones(2)
        expected_a -= 0.25 * 0.5**step
        expected_b -= 0.5 * 0.5**step
        opt.step()
        sched.step()
    torch.testing.assert_close(a.detach(), torch.full((3,), expected_a))
    torch.testing.assert_close(b.detach(), torch.full((2,), expected_b))

    calls = []
    w = torch.nn.Parameter(torch.zeros(2))
    opt = gf.MomentumOptimizer([w], learning_rate=lambda: calls.append(1) or 0.1, momentum=0.0)
    w.grad = torch.ones(2)
    opt.step()
    opt.step()
    assert len(calls) == 2
    torch.testing.assert_close(w.detach(), torch.full((2,), -0.2))


@pytest.mark.parametrize("options", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_hyperparameter_changes_between_steps_reach_every_path(options):
    # The base class reuses last step's 0-dim hyperparameter tensors when the value is the
    # same; a changed value (also one going back to an earlier value) must take effect.
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = gf.MomentumOptimizer(
        [{"params": [a]}, {"params": [b], "lr": 0.5}],
        learning_rate=0.25,
        momentum=0.0,
        **options,
    )
    expected_a = expected_b = 0.0
    for lr_a in (0.25, 0.125, 0.125, 0.25, 0.0, 2.0):
        opt.param_groups[0]["lr"] = lr_a
        a.grad, b.grad = torch.ones(3), torch.ones(2)
        opt.step()
        expected_a -= lr_a
        expected_b -= 0.5
        assert a.detach().tolist() == [expected_a] * 3
        assert b.detach().tolist() == [expected_b] * 2


def test_closure_is_evaluated_with_grad_enabled():
    w = torch.nn.Parameter(torch.tensor([3.0]))
    opt = gf.GradientDescentOptimizer([w], learning_rate=0.1)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 9.0
    torch.testing.assert_close(w.detach(), torch.tensor([3.0 - 0.1 * 6.0]))


def test_slot_api_and_names():
    params = _params()
    opt = gf.AdamOptimizer(params)
    assert opt.get_name() == "Adam"
    assert opt.get_slot_names() == ["m", "v"]
    assert opt.get_slot(params[0], "m") is None
    _run(opt, params, 1)
    assert opt.get_slot(params[0], "m").shape == params[0].shape
    assert opt.get_slot(params[0], "nope") is None
    assert len(opt.variables()) == 2 * 2 + 2  # two slots per param + the beta powers
    with pytest.raises(ValueError, match="name"):
        gf.AdamOptimizer(params, name="")
    with pytest.raises(TypeError, match="unexpected keyword"):
        gf.AdamOptimizer(params, weightdecay=0.1)
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        gf.AdamOptimizer([torch.zeros(2, dtype=torch.int64)])


def test_state_dict_with_parameter_names_refuses_a_reordered_list():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    opt = gf.AdamOptimizer(model.named_parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    reordered = list(model.named_parameters())
    reordered[0], reordered[2] = reordered[2], reordered[0]  # same shapes, other order
    other = gf.AdamOptimizer(reordered)
    with pytest.raises(ValueError, match="names"):
        other.load_state_dict(opt.state_dict())
    gf.AdamOptimizer(model.named_parameters()).load_state_dict(opt.state_dict())
