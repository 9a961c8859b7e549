"""torch conventions RETURNN's torch engine (and torch.optim code) relies on:

* ``lr=`` as an alias of ``learning_rate`` in every optimizer (and in param groups);
* a 0-dim tensor ``lr`` in a param group, updated in place, on every path, without
  recompiling the fused kernel;
* ``init_state()``: the slots of the parameters with a gradient, created without a step, so
  that the next step equals a step without it (every optimizer of the catalog, every path).
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradfleet as gf
from gradfleet.distributed import TowerOptimizer
from gradfleet.kernels import fused
from tests.conformance.specs import SPECS
from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS
from tests.test_fast_paths import _snapshot

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
