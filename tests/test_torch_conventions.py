"""torch conventions RETURNN's torch engine (and torch.optim code) relies on:

* ``lr=`` as an alias of ``learning_rate`` in every optimizer (and in param groups);
* a 0-dim tensor ``lr`` in a param group, updated in place, on every path, without
  recompiling the fused kernel;
* ``init_state()``: the slots of the parameters with a gradient, created without a step, so
  that the next step equals a step without it (every optimizer of the catalog, every path);
* copies: ``copy.deepcopy``, ``pickle`` and ``torch.save(opt)`` keep every setting, and the
  copy steps as the original;
* a hyperparameter without a default (TF1's ``learning_rate``, Momentum's ``momentum``) may
  come from every param group instead of the constructor, as torch's required ones may;
* no empty state entries: a slot-free optimizer keeps none, as torch's SGD without momentum;
* torch-only settings in a param group are refused unless "off", as in the constructor.

tests/test_torch_optim_conformance.py runs torch's own generic optimizer tests.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch

import gradfleet as gf
from gradfleet.distributed import TowerOptimizer
from gradfleet.kernels import fused
from tests.conformance.specs import SPECS
from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS
from tests.kernels.test_fast_paths import _snapshot

_SPECS = {spec.cls: spec for spec in SPECS + RETURNN_SPECS}
CONCRETE = [cls for cls in gf.optimizers.ALL if cls is not gf.BaseCustomOptimizer]
PATHS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _config(cls) -> dict:
    """The first conformance config of ``cls``, with a learning rate."""
    spec = _SPECS.get(cls)
    config = dict(spec.configs[0]) if spec else {}
    config.pop("_global_step", None)
    config.setdefault("learning_rate", 0.1)
    return config


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(5, 3), (4,), (6, 2)]]


# ---------------------------------------------------------------- lr alias


@pytest.mark.parametrize("cls", gf.optimizers.ALL, ids=lambda c: c.__name__)
def test_lr_is_an_alias_of_learning_rate(cls):
    config = _config(cls)
    by_tf = cls(_params(), **config)
    config["lr"] = config.pop("learning_rate")
    by_torch = cls(_params(), **config)
    assert by_torch.param_groups[0]["lr"] == by_tf.param_groups[0]["lr"] == config["lr"]


@pytest.mark.parametrize("cls", gf.optimizers.ALL, ids=lambda c: c.__name__)
def test_lr_and_learning_rate_together_are_refused(cls):
    config = _config(cls)
    with pytest.raises(TypeError, match="both lr and learning_rate"):
        cls(_params(), lr=0.1, **config)
    lr = config.pop("learning_rate")
    with pytest.raises(TypeError, match="both lr and learning_rate"):
        cls(_params(), lr, lr=lr, **config)  # learning_rate given by position


@pytest.mark.parametrize(
    "cls,rest",
    [
        (gf.MomentumOptimizer, {"momentum": 0.9}),
        (gf.RMSPropOptimizer, {}),
        (gf.GradientDescentOptimizer, {}),
        (gf.CustomAdamOptimizer, {}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_required_learning_rate_stays_required(cls, rest):
    with pytest.raises(TypeError, match="missing learning_rate"):
        cls(_params(), **rest)
    assert cls(_params(), lr=0.25, **rest).param_groups[0]["lr"] == 0.25


def test_optional_learning_rate_keeps_its_default():
    assert gf.AdamOptimizer(_params()).param_groups[0]["lr"] == 0.001
    assert gf.AMSGradOptimizer(_params()).param_groups[0]["lr"] == 0.001


def test_lr_alias_in_subclasses_and_param_groups():
    class Sgd(gf.BaseCustomOptimizer):  # a user's extension gets the alias too
        def __init__(self, params, learning_rate, **kwargs):
            super().__init__(params, learning_rate, **kwargs)

        def _apply_var(self, grad, var, indices=None):
            self._assign_sub(var, self._hp["lr"] * grad, indices)

    (w,) = _params()[:1]
    opt = Sgd([w], lr=0.5)
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    opt.step()
    torch.testing.assert_close(w.detach(), before - 0.5)
    with pytest.raises(ValueError, match="both lr and learning_rate"):
        opt.add_param_group({"params": _params()[1:2], "lr": 0.1, "learning_rate": 0.2})


def test_registry_accepts_lr():
    opt = gf.registry.create_optimizer(_params(), {"class": "momentum", "lr": 0.2, "momentum": 0.5})
    assert opt.param_groups[0]["lr"] == 0.2


# ---------------------------------------------------------------- tensor lr


def _lr_schedule_run(path: str, as_tensor: bool) -> tuple[list[torch.Tensor], int]:
    """Adam through a changing lr schedule; returns final params and kernels compiled after
    the first step."""
    params = _params(1)
    opt = gf.AdamOptimizer(params, lr=0.1, epsilon=1e-16, **PATHS[path])
    gen = torch.Generator().manual_seed(2)
    compiled = 0
    for step, lr in enumerate([0.1, 0.05, 0.3, 0.3, 0.01]):
        if as_tensor and step == 1:  # RETURNN's use_device_lr_tensors, after training began
            opt.param_groups[0]["lr"] = torch.tensor(0.1, dtype=torch.float32)
        if isinstance(opt.param_groups[0]["lr"], torch.Tensor):
            opt.param_groups[0]["lr"].fill_(lr)  # RETURNN updates it in place
        else:
            opt.param_groups[0]["lr"] = lr
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        before = fused.compiled_signatures
        opt.step()
        if step > 0:
            compiled += fused.compiled_signatures - before
    return [p.detach().clone() for p in params], compiled


@pytest.mark.parametrize("path", list(PATHS))
def test_tensor_lr_in_param_group_on_every_path(path):
    """A 0-dim tensor lr updated in place gives the Python-float schedule's result; the
    fused kernel takes it as an input: switching to it and changing it compiles nothing."""
    floats, _ = _lr_schedule_run("loop", as_tensor=False)
    tensors, compiled = _lr_schedule_run(path, as_tensor=True)
    assert compiled == 0
    for a, b in zip(floats, tensors):
        if path == "fused":  # the kernels' last-bit freedom (see test_fast_paths.py)
            torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)
        else:
            assert torch.equal(a, b)


# ---------------------------------------------------------------- init_state


def _set_grads(cls, params, seed):
    gen = torch.Generator().manual_seed(seed)
    dense, other, embedding, unused = params
    dense.grad = torch.randn(dense.shape, generator=gen)
    other.grad = torch.randn(other.shape, generator=gen)
    unused.grad = None
    if cls.sparse is None:
        embedding.grad = torch.randn(embedding.shape, generator=gen)
    else:  # a row-sparse gradient with a duplicate row
        idx = torch.tensor([[4, 1, 4]])
        embedding.grad = torch.sparse_coo_tensor(idx, torch.randn(3, 2, generator=gen), (6, 2))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_init_state_then_step_equals_step(cls, path):
    params = _params(3) + [torch.nn.Parameter(torch.ones(3))]
    start = [p.detach().clone() for p in params]
    opt = cls(params, **_config(cls), **PATHS[path])
    fresh = copy.deepcopy(opt.state_dict())
    _set_grads(cls, params, seed=4)

    opt.init_state()
    for p, x in zip(params, start):
        assert torch.equal(p.detach(), x), "init_state changed a parameter"
    slot_names = set(opt._slot_fills(opt.param_groups[0]))
    for p in params[:3]:
        assert set(opt.state[p]) == slot_names
    assert params[3] not in opt.state  # no gradient: no slots (as a step)
    opt.step()
    after_init = _snapshot(opt)

    # The same step without init_state, from the same start (same optimizer: same kernel).
    opt.load_state_dict(fresh)
    assert not opt.state
    with torch.no_grad():
        for p, x in zip(params, start):
            p.copy_(x)
    _set_grads(cls, params, seed=4)
    opt.step()
    plain = _snapshot(opt)
    assert len(plain) == len(after_init)
    for a, b in zip(plain, after_init):
        assert torch.equal(a, b)


def test_init_state_keeps_existing_slots():
    params = _params(5)
    opt = gf.AdamOptimizer(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    m = opt.state[params[0]]["m"]
    saved = m.clone()
    opt.init_state()
    assert opt.state[params[0]]["m"] is m and torch.equal(m, saved)


def test_wrapper_forwards_init_state_and_tensor_lr():
    params = _params(6)
    inner = gf.MomentumOptimizer(params, lr=0.1, momentum=0.9)
    opt = TowerOptimizer(inner)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.init_state()
    assert all(torch.equal(inner.state[p]["momentum"], torch.zeros_like(p)) for p in params)
    opt.param_groups[0]["lr"] = torch.tensor(0.5)
    before = [p.detach().clone() for p in params]
    opt.step()
    for p, x in zip(params, before):
        torch.testing.assert_close(p.detach(), x - 0.5)
    plain = TowerOptimizer(torch.optim.SGD(_params(), lr=0.1))
    with pytest.raises(NotImplementedError, match="has no init_state"):
        plain.init_state()


# ---------------------------------------------------------------- copies and pickles


def _copies(opt) -> dict:
    """The optimizer through ``copy.deepcopy``, ``pickle`` and ``torch.save``/``torch.load``
    (each copy holds copies of the parameters)."""
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return {
        "deepcopy": copy.deepcopy(opt),
        "pickle": pickle.loads(pickle.dumps(opt)),
        "torch.save": torch.load(buf, weights_only=False),
    }


def _continue(opt, steps: range) -> list[torch.Tensor]:
    params = [p for group in opt.param_groups for p in group["params"]]
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params] + [
        opt.state[p][name].clone() for p in params for name in sorted(opt.state.get(p, {}))
    ]


@pytest.mark.parametrize("path", ["loop", "foreach"])
@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_copies_and_pickles_keep_settings_and_step_as_the_original(cls, path):
    options = {"check_finite": True}
    if cls is not gf.AMSGradOptimizer:  # RETURNN's AMSGrad takes no use_locking
        options["use_locking"] = True
    opt = cls(_params(7), **_config(cls), **PATHS[path], **options)
    _continue(opt, range(2))
    copies = _copies(opt)
    want = _continue(opt, range(2, 4))
    for how, twin in copies.items():
        assert type(twin) is type(opt)
        public = {k: v for k, v in vars(opt).items() if not k.startswith("_")}
        assert public.keys() == {k for k in vars(twin) if not k.startswith("_")}, how
        assert twin.check_finite is True and twin.get_name() == opt.get_name(), how
        assert twin.defaults == opt.defaults, how
        got = _continue(twin, range(2, 4))
        assert len(got) == len(want), how
        for a, b in zip(got, want):
            assert torch.equal(a, b), how


def test_copy_of_a_fused_optimizer_compiles_its_own_step():
    """The fused path's step plan (compiled kernels, the original's tensors) is not copied:
    the copy records its own on its first step, and steps as the original does."""
    opt = gf.AdamOptimizer(_params(8), lr=0.1, fused=True)
    _continue(opt, range(3))  # the second and third steps replay the plan
    twin = copy.deepcopy(opt)
    assert "_step_plan" not in vars(twin)
    want = _continue(opt, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(_continue(twin, range(3, 5)), want))


# ---------------------------------------------------------------- required hyperparameters


def _required_args(cls) -> dict:
    """The hyperparameters ``cls`` has no default for, with values, in torch's names."""
    values = {"learning_rate": ("lr", 0.1), "momentum": ("momentum", 0.9)}
    required = [
        name
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is p.empty and name in values
    ]
    return dict(values[name] for name in required)


REQUIRED = [cls for cls in CONCRETE if _required_args(cls)]


@pytest.mark.parametrize("cls", REQUIRED, ids=lambda c: c.__name__)
def test_required_hyperparameters_may_come_from_every_param_group(cls):
    required = _required_args(cls)
    config = {k: v for k, v in _config(cls).items() if k not in ("learning_rate", "momentum")}
    by_constructor = cls(_params(9), **required, **config)
    params = _params(9)
    by_groups = cls(
        [{"params": params[:2], **required}, {"params": params[2:], **required}], **config
    )
    want = _continue(by_constructor, range(3))
    got = _continue(by_groups, range(3))  # parameters and slots, as one group computes them
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    # a group without it: refused at construction, naming the value and the group
    names = "learning_rate \\(or torch's lr\\)" if "lr" in required else "momentum"
    with pytest.raises(TypeError, match=f"missing {names}.*param group 1"):
        cls([{"params": _params()[:1], **required}, {"params": _params()[1:]}], **config)
    # and in add_param_group, also on a copy (the requirement is kept in its defaults)
    for opt in (by_groups, copy.deepcopy(by_groups), pickle.loads(pickle.dumps(by_groups))):
        with pytest.raises(TypeError, match="missing"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        assert len(opt.param_groups) == 2
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], **required})


def test_a_given_value_serves_groups_that_lack_it():
    """Given to the constructor, the value is every group's default (torch's rule): only the
    group that sets its own differs."""
    w, b = _params()[:2]
    opt = gf.MomentumOptimizer([{"params": [w]}, {"params": [b], "lr": 0.5}], 0.1, momentum=0.9)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.9]


# ---------------------------------------------------------------- state entries


@pytest.mark.parametrize("path", ["loop", "foreach"])
@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_no_empty_state_entries(cls, path):
    """After steps with dense and sparse gradients and ``init_state``, every state entry
    holds slots; a slot-free optimizer keeps none at all, as torch's SGD without momentum."""
    params = _params(3) + [torch.nn.Parameter(torch.ones(3))]
    opt = cls(params, **_config(cls), **PATHS[path])
    for seed in (4, 5):
        _set_grads(cls, params, seed)
        opt.init_state()
        opt.step()
    saved = opt.state_dict()["state"]
    if opt._slot_fills(opt.param_groups[0]):
        assert len(opt.state) == 3 and all(opt.state.values())
        assert len(saved) == 3 and all(saved.values())
    else:
        assert not opt.state and saved == {}


# ---------------------------------------------------------------- torch-only keys in groups


def test_torch_only_settings_in_a_param_group_are_refused_unless_off():
    w, b = _params()[:2]
    opt = gf.AdamOptimizer([{"params": [w], "weight_decay": 0.0, "maximize": False}], lr=0.1)
    assert "weight_decay" not in opt.param_groups[0] and "maximize" not in opt.param_groups[0]
    with pytest.raises(TypeError, match="param group got weight_decay=0.01: torch's"):
        opt.add_param_group({"params": [b], "weight_decay": 0.01})
    assert len(opt.param_groups) == 1
    # a torch name that is the class's own hyperparameter stays (Momentum's momentum)
    opt = gf.MomentumOptimizer([{"params": [b], "momentum": 0.5}], lr=0.1, momentum=0.9)
    assert opt.param_groups[0]["momentum"] == 0.5
