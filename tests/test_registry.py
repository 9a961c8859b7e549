"""RETURNN-style name and config resolution."""

from __future__ import annotations

import pytest
import torch

import gradfleet as gf

CATALOG = [
    "AdadeltaOptimizer",
    "AdagradOptimizer",
    "AdagradDAOptimizer",
    "AdamOptimizer",
    "AMSGradOptimizer",
    "BaseCustomOptimizer",
    "CustomAdamOptimizer",
    "CustomGradientDescentOptimizer",
    "FtrlOptimizer",
    "GradientDescentOptimizer",
    "GradVarianceScaledOptimizer",
    "MomentumOptimizer",
    "NeuralOptimizer1",
    "NormalizedSGD",
    "ProximalAdagradOptimizer",
    "ProximalGradientDescentOptimizer",
    "RMSPropOptimizer",
]


@pytest.mark.parametrize("name", CATALOG)
def test_every_seed_class_resolves_by_its_names(name):
    cls = getattr(gf, name)
    assert issubclass(cls, torch.optim.Optimizer)
    short = name[: -len("Optimizer")] if name.endswith("Optimizer") else name
    for alias in (name, name.lower(), name.upper(), short.lower()):
        assert gf.get_optimizer_class(alias) is cls


def test_torch_fallback_and_unknown_names():
    assert gf.get_optimizer_class("sgd") is torch.optim.SGD
    assert gf.get_optimizer_class("AdamW") is torch.optim.AdamW
    assert gf.get_optimizer_class("adam") is gf.AdamOptimizer  # TF's Adam, as in RETURNN
    assert gf.get_optimizer_class(torch.optim.SGD) is torch.optim.SGD
    with pytest.raises(ValueError, match="valid names: .*adam"):
        gf.get_optimizer_class("adamm")
    with pytest.raises(ValueError):
        gf.get_optimizer_class(dict)


def test_create_optimizer_from_configs():
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = gf.create_optimizer(p, {"class": "adam", "epsilon": 1e-16}, learning_rate=0.01)
    assert isinstance(opt, gf.AdamOptimizer)
    assert opt.param_groups[0]["epsilon"] == 1e-16 and opt.param_groups[0]["lr"] == 0.01
    opt = gf.create_optimizer(p, "adam", returnn_defaults=True)
    assert opt.param_groups[0]["epsilon"] == 1e-16
    # torch's name for the same setting: RETURNN's default does not collide with it
    opt = gf.create_optimizer(p, {"class": "adam", "eps": 1e-3}, returnn_defaults=True)
    assert opt.param_groups[0]["epsilon"] == 1e-3
    opt = gf.create_optimizer(p, {"class": "momentum", "momentum": 0.9, "learning_rate": 0.1})
    assert opt.param_groups[0]["momentum"] == 0.9
    opt = gf.create_optimizer(p, {"class": "ftrl", "learning_rate": 0.1, "fused": False})
    assert opt.param_groups[0]["fused"] is False
    opt = gf.create_optimizer(p, {"class": "adamw", "epsilon": 1e-6}, learning_rate=0.1)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["eps"] == 1e-6 and opt.param_groups[0]["lr"] == 0.1


def test_create_optimizer_errors():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="'class'"):
        gf.create_optimizer(p, {"epsilon": 1e-3})
    with pytest.raises(ValueError, match="both"):
        gf.create_optimizer(p, {"class": "adam", "learning_rate": 0.1}, learning_rate=0.2)
    with pytest.raises(ValueError, match="does not take \\['rho'\\]"):
        gf.create_optimizer(p, {"class": "adam", "rho": 0.9})
    with pytest.raises(ValueError, match="beta1"):
        gf.create_optimizer(p, {"class": "adam", "beta1": 1.5})
