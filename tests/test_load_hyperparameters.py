"""``load_state_dict``: the saved param groups' hyperparameters win (torch's rule), and each
one that differs from the optimizer's own is named in a warning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import gradfleet as gf


def _saved(cls, **kwargs):
    p = torch.nn.Parameter(torch.ones(3))
    opt = cls([p], **kwargs)
    p.grad = torch.full((3,), 0.5)
    opt.step()
    return opt.state_dict()


def _fresh(cls, **kwargs):
    return cls([torch.nn.Parameter(torch.ones(3))], **kwargs)


def test_differing_values_are_named_and_the_saved_ones_win():
    state = _saved(gf.AdamOptimizer, learning_rate=0.01, beta1=0.8)
    opt = _fresh(gf.AdamOptimizer)  # TF's defaults: learning_rate 0.001, beta1 0.9
    with pytest.warns(gf.HyperparametersReplacedWarning) as record:
        opt.load_state_dict(state)
    (message,) = [str(r.message) for r in record]
    assert message.startswith("AdamOptimizer.load_state_dict: the saved param groups'")
    assert "group 0: learning_rate 0.01 replaces 0.001" in message
    assert "group 0: beta1 0.8 replaces 0.9" in message
    assert "beta2" not in message and "epsilon" not in message  # equal: not named
    group = opt.param_groups[0]
    assert group["lr"] == 0.01 and group["betas"] == (0.8, 0.999)  # torch's rule


def test_flags_are_compared():
    state = _saved(gf.MomentumOptimizer, learning_rate=0.1, momentum=0.9, use_nesterov=True)
    opt = _fresh(gf.MomentumOptimizer, learning_rate=0.1, momentum=0.9)
    with pytest.warns(gf.HyperparametersReplacedWarning, match="use_nesterov True replaces False"):
        opt.load_state_dict(state)
    assert opt.param_groups[0]["use_nesterov"] is True


def test_the_same_maths_loads_quietly():
    # 0.009999999776482582 is float32(0.01): TF's kernels and gradfleet's see the same value
    state = _saved(gf.AdamOptimizer, learning_rate=float(np.float32(0.01)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fresh(gf.AdamOptimizer, learning_rate=0.01).load_state_dict(state)


def test_a_resumed_schedule_is_not_reported():
    p = torch.nn.Parameter(torch.ones(3))
    opt = gf.AdamOptimizer([p], learning_rate=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
        schedule.step()
    state = opt.state_dict()
    assert state["param_groups"][0]["lr"] == pytest.approx(0.00125)

    resumed = _fresh(gf.AdamOptimizer, learning_rate=0.01)
    torch.optim.lr_scheduler.StepLR(resumed, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state)
    assert resumed.param_groups[0]["lr"] == pytest.approx(0.00125)

    other_start = _fresh(gf.AdamOptimizer, learning_rate=0.1)
    torch.optim.lr_scheduler.StepLR(other_start, step_size=1, gamma=0.5)
    with pytest.warns(gf.HyperparametersReplacedWarning, match="learning_rate 0.01 replaces 0.1"):
        other_start.load_state_dict(state)
