"""gradfleet under the tools torch users already run: momentum-cycling schedulers, torch's
argument names, warmup from a learning rate of 0, and the checks on what a constructor or a
param group is given (types, a parameter listed twice).

References: a float64 Adam written from the spec (optimizer-semantics.md section 8) with the
beta1 each step saw; TF's callable hyperparameters (an independent way to give a per-step
value, checked against TensorFlow by the conformance suite); the maths at lr = 0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradfleet as gf
from tests.kernels.test_fast_paths import FUSED_TOL, _snapshot
from tests.test_torch_conventions import CONCRETE, PATHS, _config

# Classes whose maths has a coefficient torch's momentum-cycling schedulers edit: the group
# key they find ("betas": beta1 is cycled; "momentum").
CYCLED = {
    gf.AdamOptimizer: "betas",
    gf.AMSGradOptimizer: "betas",
    gf.CustomAdamOptimizer: "betas",
    gf.GradVarianceScaledOptimizer: "betas",
    gf.NeuralOptimizer1: "betas",
    gf.MomentumOptimizer: "momentum",
    gf.RMSPropOptimizer: "momentum",
}
STEPS = 8


def _params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in [(5, 3), (4,)]]


def _grads(step: int, params) -> None:
    gen = torch.Generator().manual_seed(50 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def _scheduler(kind: str, opt):
    if kind == "OneCycleLR":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3)


def _cycled(group, key):
    return group[key][0] if key == "betas" else group[key]


def _scheduled_run(cls, kind, options):
    """``STEPS`` steps under the scheduler; returns the snapshot and the (lr, coefficient)
    each step was given."""
    params = _params()
    opt = cls(params, **_config(cls), **options)
    sched = _scheduler(kind, opt)
    seen = []
    for step in range(STEPS):
        group = opt.param_groups[0]
        seen.append((group["lr"], _cycled(group, CYCLED[cls])))
        _grads(step, params)
        opt.step()
        sched.step()
    return _snapshot(opt), seen


@pytest.mark.parametrize("kind", ["OneCycleLR", "CyclicLR"])
@pytest.mark.parametrize("cls", list(CYCLED), ids=lambda c: c.__name__)
def test_momentum_cycling_scheduler_value_is_the_next_steps(cls, kind):
    """Each step uses the lr and beta1/momentum the scheduler wrote: the same bits as the
    same values given through TF's callable hyperparameters."""
    got, seen = _scheduled_run(cls, kind, PATHS["loop"])
    assert len({c for _, c in seen}) > 2  # the coefficient really cycles
    config = _config(cls)
    name = "beta1" if CYCLED[cls] == "betas" else "momentum"
    # Before the first step (construction, where Adam's beta powers start) the callable
    # gives the constructor's value, as the scheduled run had it.
    first = {"learning_rate": config["learning_rate"], name: config.get(name, 0.9)}
    step = {"t": -1}
    config["learning_rate"] = lambda: (
        seen[step["t"]][0] if step["t"] >= 0 else first["learning_rate"]
    )
    config[name] = lambda: seen[step["t"]][1] if step["t"] >= 0 else first[name]
    params = _params()
    opt = cls(params, **config, **PATHS["loop"])
    for t in range(STEPS):
        step["t"] = t
        _grads(t, params)
        opt.step()
    for a, b in zip(_snapshot(opt), got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["foreach", "fused"])
@pytest.mark.parametrize("cls", list(CYCLED), ids=lambda c: c.__name__)
def test_momentum_cycling_on_fast_paths(cls, path):
    loop, _ = _scheduled_run(cls, "OneCycleLR", PATHS["loop"])
    got, _ = _scheduled_run(cls, "OneCycleLR", PATHS[path])
    rtol, atol = FUSED_TOL[torch.float32] if path == "fused" else (0, 0)
    for a, b in zip(loop, got):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


def _f32(x: float) -> float:
    return float(np.float32(x))


@pytest.mark.parametrize("path", list(PATHS))
def test_one_cycle_adam_against_float64_reference(path):
    """Adam under OneCycleLR against the spec's update in float64, with each step's lr and
    beta1 as the scheduler wrote them and TF's float32 beta powers (started from the
    constructor's beta1, multiplied by each step's beta1 after the step)."""
    params = _params(3, torch.float64)
    opt = gf.AdamOptimizer(params, lr=0.1, betas=(0.9, 0.99), eps=1e-8, **PATHS[path])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)
    w = [p.detach().numpy().copy() for p in params]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    b1p, b2p = np.float32(0.9), np.float32(0.99)
    for step in range(STEPS):
        lr, (beta1, beta2) = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]
        _grads(step, params)
        b1, b2, lr32 = _f32(beta1), _f32(beta2), _f32(lr)
        alpha = lr32 * math.sqrt(1 - float(b2p)) / (1 - float(b1p))
        for i, p in enumerate(params):
            g = p.grad.numpy()
            m[i] = m[i] + (g - m[i]) * (1 - b1)
            v[i] = v[i] + (g * g - v[i]) * (1 - b2)
            w[i] = w[i] - m[i] * alpha / (np.sqrt(v[i]) + _f32(1e-8))
        b1p, b2p = np.float32(b1p * np.float32(b1)), np.float32(b2p * np.float32(b2))
        opt.step()
        sched.step()
    # float64 maths on both sides: a few roundings per step, each <= 2^-53 relative.
    for p, expected in zip(params, w):
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=STEPS * 16 * 2**-53)
    assert opt.param_groups[0]["non_slot"]["beta1_power"].item() == float(b1p)


def test_optimizer_without_momentum_needs_cycle_momentum_false():
    opt = gf.GradientDescentOptimizer(_params(), lr=0.1)
    with pytest.raises(ValueError, match="momentum or beta1"):
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5, cycle_momentum=False)


# ---------------------------------------------------------------- torch's argument names

_ADAM_TF = {"beta1": 0.8, "beta2": 0.95, "epsilon": 1e-6}
ALIASES = [
    (gf.AdamOptimizer, {"betas": (0.8, 0.95), "eps": 1e-6}, _ADAM_TF),
    (gf.AMSGradOptimizer, {"betas": (0.8, 0.95), "eps": 1e-6}, _ADAM_TF),
    (gf.CustomAdamOptimizer, {"betas": (0.8, 0.95), "eps": 1e-6}, _ADAM_TF),
    (gf.GradVarianceScaledOptimizer, {"betas": (0.8, 0.95)}, {"beta1": 0.8, "beta2": 0.95}),
    (gf.NeuralOptimizer1, {"betas": (0.8,)}, {"beta1": 0.8}),
    (gf.AdadeltaOptimizer, {"eps": 1e-6}, {"epsilon": 1e-6}),
    (gf.RMSPropOptimizer, {"alpha": 0.8, "eps": 1e-6}, {"decay": 0.8, "epsilon": 1e-6}),
    (
        gf.MomentumOptimizer,
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.9, "use_nesterov": True},
    ),
]


@pytest.mark.parametrize("cls,torch_kw,tf_kw", ALIASES, ids=lambda x: getattr(x, "__name__", ""))
def test_torch_names_are_aliases(cls, torch_kw, tf_kw):
    runs = []
    for kwargs in (torch_kw, tf_kw):
        params = _params()
        opt = cls(params, lr=0.1, **kwargs)
        for step in range(3):
            _grads(step, params)
            opt.step()
        runs.append((opt.param_groups[0], _snapshot(opt)))
    (g1, s1), (g2, s2) = runs
    assert {k: v for k, v in g1.items() if k not in ("params", "non_slot")} == {
        k: v for k, v in g2.items() if k not in ("params", "non_slot")
    }
    assert all(torch.equal(a, b) for a, b in zip(s1, s2))


@pytest.mark.parametrize("cls,torch_kw,tf_kw", ALIASES, ids=lambda x: getattr(x, "__name__", ""))
def test_torch_name_and_tf_name_together_are_refused(cls, torch_kw, tf_kw):
    for torch_name, value in torch_kw.items():
        if torch_name in tf_kw:  # the same name in both (momentum)
            continue
        tf_name = next(iter(set(tf_kw) - set(torch_kw)))
        both = dict(tf_kw, **{torch_name: value})
        with pytest.raises(TypeError, match=f"both {torch_name} and"):
            cls(_params(), lr=0.1, **both)
        del tf_name


@pytest.mark.parametrize(
    "cls,kwargs,alternative",
    [
        (gf.AdamOptimizer, {"weight_decay": 0.01}, "AdamW"),
        (gf.AdamOptimizer, {"amsgrad": True}, "AMSGradOptimizer"),
        (gf.AdamOptimizer, {"maximize": True}, "negate the loss"),
        (gf.GradientDescentOptimizer, {"momentum": 0.9}, "MomentumOptimizer"),
        (gf.GradientDescentOptimizer, {"nesterov": True}, "use_nesterov=True"),
        (gf.MomentumOptimizer, {"momentum": 0.9, "dampening": 0.1}, "no dampening"),
        (gf.AdagradOptimizer, {"lr_decay": 0.1}, "scheduler"),
        (gf.RMSPropOptimizer, {"weight_decay": 1e-4}, "weight decay"),
    ],
    ids=lambda x: getattr(x, "__name__", None) or "-".join(x) if not isinstance(x, str) else "",
)
def test_torch_only_arguments_are_refused_with_the_alternative(cls, kwargs, alternative):
    torch_only = [k for k in kwargs if k != "momentum" or cls is not gf.MomentumOptimizer]
    with pytest.raises(TypeError, match=f"{torch_only[0]}=.*no counterpart.*{alternative}"):
        cls(_params(), lr=0.1, **kwargs)
    off = {k: type(v)(0) for k, v in kwargs.items() if k in torch_only}
    rest = {k: v for k, v in kwargs.items() if k not in torch_only}
    cls(_params(), lr=0.1, **off, **rest)  # the "off" value is torch's default: accepted


@pytest.mark.parametrize("value", [False, True])
def test_capturable_is_accepted_either_way(value):
    """torch's ``capturable=True`` asks for a step a CUDA graph can replay; every gradfleet
    step already is one (tests/kernels/test_cuda.py replays each optimizer on each path), so both
    values build the same optimizer, and anything but a bool is still refused."""
    opt = gf.AdamOptimizer(_params(), lr=0.1, capturable=value)
    assert "capturable" not in opt.defaults
    with pytest.raises(TypeError, match="capturable='yes'"):
        gf.AdamOptimizer(_params(), lr=0.1, capturable="yes")


def test_param_groups_take_both_names_but_not_together():
    a, b, c = _params() + [torch.nn.Parameter(torch.zeros(2))]
    opt = gf.AdamOptimizer([{"params": [a], "betas": (0.5, 0.6)}, {"params": [b], "beta1": 0.7}])
    assert [g["betas"] for g in opt.param_groups] == [(0.5, 0.6), (0.7, 0.999)]
    opt.add_param_group({"params": [c], "eps": 1e-3})
    assert opt.param_groups[2]["epsilon"] == 1e-3 and "eps" not in opt.param_groups[2]
    with pytest.raises(ValueError, match="both betas and beta2"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(1))], "betas": (0.5, 0.6), "beta2": 0.9}
        )
    with pytest.raises(ValueError, match="both eps and epsilon"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(1))], "eps": 1e-3, "epsilon": 1e-3}
        )
    assert len(opt.param_groups) == 3


# ---------------------------------------------------------------- types, duplicates


def _hyper_names(cls) -> list[str]:
    """TF names of the hyperparameters a constructor takes (beyond learning_rate)."""
    import inspect

    sig = inspect.signature(cls.__init__).parameters
    tf = {"lr": "learning_rate"}
    return [tf.get(k, k) for k in cls.hyperparameters if tf.get(k, k) in sig] + [
        f for f in cls.flags if f in sig
    ]


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_every_hyperparameter_of_a_wrong_type_is_refused(cls):
    names = _hyper_names(cls)
    assert "learning_rate" in names
    for name in names:
        for bad in ("0.1", None, [0.1], 1j):
            if bad is None and (cls, name) == (gf.FtrlOptimizer, "beta"):
                continue  # TF's beta=None means 0.0
            config = dict(_config(cls), **{name: bad})
            with pytest.raises(TypeError, match=name):
                cls(_params(), **config)


@pytest.mark.parametrize("path", list(PATHS))
def test_wrong_type_set_in_a_group_is_refused_and_changes_nothing(path):
    params = _params()
    opt = gf.AdamOptimizer(params, lr=0.1, **PATHS[path])
    _grads(0, params)
    opt.step()
    before = _snapshot(opt)
    for key, bad in (("lr", "0.1"), ("betas", (0.9, "0.99")), ("betas", 0.9)):
        saved = opt.param_groups[0][key]
        opt.param_groups[0][key] = bad
        with pytest.raises(TypeError, match="beta|learning_rate"):
            opt.step()
        opt.param_groups[0][key] = saved
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt)))


def test_numpy_and_tensor_hyperparameters_are_numbers():
    opt = gf.AdamOptimizer(_params(), lr=np.float32(0.1), betas=(np.float64(0.9), 0.99))
    opt = gf.MomentumOptimizer(_params(), lr=torch.tensor(0.1), momentum=np.int64(0))
    assert opt.param_groups[0]["momentum"] == 0


def test_a_parameter_listed_twice_is_refused():
    w, b = _params()
    with pytest.raises(ValueError, match=r"shape \(5, 3\) is listed twice in one param group"):
        gf.AdamOptimizer([w, b, w])
    with pytest.raises(ValueError, match=r"shape \(4,\) is listed in two param groups"):
        gf.AdamOptimizer([{"params": [w, b]}, {"params": [b]}])
    model = torch.nn.Linear(2, 2)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="'weight' of shape"):
        gf.MomentumOptimizer(named + named[:1], lr=0.1, momentum=0.9)
    opt = gf.AdamOptimizer([w])
    with pytest.raises(ValueError, match="two param groups"):
        opt.add_param_group({"params": iter([b, w])})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------------- learning rate 0


def _steps(opt, params, lrs, start=0):
    for i, lr in enumerate(lrs):
        opt.param_groups[0]["lr"] = lr
        _grads(start + i, params)
        opt.step()


# Slot maths independent of lr: a step at lr 0 updates the slots exactly as at lr 0.1.
_LR_FREE_SLOTS = [
    c for c in CONCRETE if c not in (gf.FtrlOptimizer, gf.RMSPropOptimizer, gf.AdagradDAOptimizer)
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("cls", _LR_FREE_SLOTS, ids=lambda c: c.__name__)
def test_step_at_lr_zero_moves_slots_not_weights(cls, path):
    runs = []
    for last_lr in (0.0, 0.1):
        params = _params()
        opt = cls(params, **_config(cls), **PATHS[path])
        _steps(opt, params, [0.1, 0.05])
        before = [p.detach().clone() for p in params]
        _steps(opt, params, [last_lr], start=2)
        runs.append(opt)
        if last_lr == 0.0:
            assert all(torch.equal(p.detach(), x) for p, x in zip(params, before))
    zero, full = runs
    for p0, p1 in zip(*(o._all_params() for o in runs)):
        for name in zero.state[p0]:
            assert torch.equal(zero.state[p0][name], full.state[p1][name]), name
    for g0, g1 in zip(zero.param_groups, full.param_groups):
        for k in g0["non_slot"]:
            assert torch.equal(g0["non_slot"][k], g1["non_slot"][k]), k


def test_rmsprop_at_lr_zero_keeps_moving_by_its_momentum():
    # lr sits inside TF's momentum buffer: mom = mom * momentum + 0; w -= mom.
    params = _params(dtype=torch.float64)
    opt = gf.RMSPropOptimizer(params, lr=0.1, momentum=0.5, decay=0.9)
    _steps(opt, params, [0.1, 0.1])
    w = [p.detach().clone() for p in params]
    mom = [opt.state[p]["momentum"].clone() for p in params]
    ms = [opt.state[p]["rms"].clone() for p in params]
    _steps(opt, params, [0.0], start=2)
    decay = _f32(0.9)
    for p, w0, m0, s0 in zip(params, w, mom, ms):
        g = p.grad
        torch.testing.assert_close(opt.state[p]["momentum"], m0 * _f32(0.5), rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), w0 - m0 * _f32(0.5), rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["rms"], s0 + (g * g - s0) * (1 - decay))


def test_adagrad_da_at_lr_zero_sets_touched_weights_to_its_closed_form_zero():
    params = _params(dtype=torch.float64)
    opt = gf.AdagradDAOptimizer(params, lr=0.1, l2_regularization_strength=0.01)
    _steps(opt, params, [0.1, 0.0])
    for p in params:  # w = lr * (...) / (l2 * T * lr + sqrt(gg)) = 0 at lr 0
        assert torch.equal(p.detach().abs(), torch.zeros_like(p))


@pytest.mark.parametrize("path", list(PATHS))
def test_ftrl_at_lr_zero_names_the_schedule_and_changes_nothing(path):
    params = _params()
    opt = gf.FtrlOptimizer(params, lr=0.1, **PATHS[path])
    _steps(opt, params, [0.1])
    before = _snapshot(opt)
    # transformers' get_linear_schedule_with_warmup is this LambdaLR: lr 0 at step 0.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 10))
    assert opt.param_groups[0]["lr"] == 0.0
    _grads(1, params)
    with pytest.raises(ValueError, match="schedule that starts at 0.*small positive"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt)))
    with pytest.raises(ValueError, match="small positive"):
        gf.FtrlOptimizer(_params(), lr=0.0)
    with pytest.raises(ValueError) as negative:
        gf.FtrlOptimizer(_params(), lr=-1.0)
    assert "schedule" not in str(negative.value)
    del sched
