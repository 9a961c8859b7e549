"""Writes ``previous_release_checkpoints.pt``: one state dict per optimizer, saved by the
release before the torch-named aliases and ``betas`` groups, with what that release computed
when it continued from it.  ``tests/test_checkpoint_compat.py`` loads each one with the current
code, continues with the same gradients and expects the same bits.

Run from the repository root with that release on ``PYTHONPATH``:
``python tests/data/make_previous_release_checkpoints.py``.  The file is committed; this
script documents how it was made.
"""

from __future__ import annotations

import copy
import pathlib

import torch

import gradfleet as gf

# TF-named constructor arguments; the second param group overrides the learning rate and,
# where the maths has one, its first decay coefficient.
CASES = {
    "AdadeltaOptimizer": ({"learning_rate": 0.5, "rho": 0.9}, {"rho": 0.8}),
    "AdagradOptimizer": ({"learning_rate": 0.2}, {}),
    "AdagradDAOptimizer": ({"learning_rate": 0.2, "l1_regularization_strength": 0.01}, {}),
    "AdamOptimizer": ({"learning_rate": 0.1, "beta1": 0.8, "beta2": 0.99}, {"beta1": 0.7}),
    "AMSGradOptimizer": ({"learning_rate": 0.1, "beta1": 0.8, "epsilon": 1e-8}, {"beta1": 0.7}),
    "CustomAdamOptimizer": ({"learning_rate": 0.1, "beta2": 0.99}, {"beta1": 0.7}),
    "CustomGradientDescentOptimizer": ({"learning_rate": 0.1}, {}),
    "FtrlOptimizer": ({"learning_rate": 0.3, "l1_regularization_strength": 0.01}, {}),
    "GradientDescentOptimizer": ({"learning_rate": 0.1}, {}),
    "GradVarianceScaledOptimizer": ({"learning_rate": 0.1}, {"beta1": 0.7}),
    "MomentumOptimizer": ({"learning_rate": 0.1, "momentum": 0.9}, {"momentum": 0.5}),
    "NeuralOptimizer1": ({"learning_rate": 0.1}, {"beta1": 0.7}),
    "NormalizedSGD": ({"learning_rate": 0.1}, {}),
    "ProximalAdagradOptimizer": ({"learning_rate": 0.2, "l2_regularization_strength": 0.01}, {}),
    "ProximalGradientDescentOptimizer": ({"learning_rate": 0.2}, {}),
    "RMSPropOptimizer": ({"learning_rate": 0.1, "momentum": 0.5, "centered": True}, {}),
}
STEPS_BEFORE, STEPS_AFTER = 3, 3


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(4, 3), (5,), (2, 2)]]


def grads(step: int, shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in shapes]


def build(name: str, ps):
    config, second = CASES[name]
    groups = [{"params": ps[:2]}, {"params": ps[2:], "learning_rate": 0.05, **second}]
    return getattr(gf, name)(groups, **config)


def run(opt, ps, steps: range) -> list[list[torch.Tensor]]:
    used = []
    for s in steps:
        gs = grads(s, [p.shape for p in ps])
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        used.append(gs)
    return used


def main() -> None:
    cases = {}
    for name in CASES:
        ps = params()
        opt = build(name, ps)
        run(opt, ps, range(STEPS_BEFORE))
        saved = {
            "state_dict": copy.deepcopy(opt.state_dict()),  # its tensors are live
            "params": [p.detach().clone() for p in ps],
        }
        used = run(opt, ps, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        after = opt.state_dict()
        saved["grads_after"] = used
        saved["params_after"] = [p.detach().clone() for p in ps]
        saved["state_after"] = after["state"]
        saved["non_slot_after"] = [g["non_slot"] for g in after["param_groups"]]
        cases[name] = saved
    out = pathlib.Path(__file__).with_name("previous_release_checkpoints.pt")
    torch.save({"torch": str(torch.__version__), "cases": cases}, out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
