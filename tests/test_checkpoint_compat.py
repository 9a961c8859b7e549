"""State dicts saved by the previous release still load and continue as that release did.

``tests/data/previous_release_checkpoints.pt`` was written by
``tests/data/make_previous_release_checkpoints.py`` with the release before torch's names
(``betas`` stored as a tuple in the param groups): per optimizer, a state dict after 3 steps
with two param groups, and the parameters and state that release computed over 3 more steps.
The oracle is that release's own arithmetic: the continuation must match bit for bit.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.data.make_previous_release_checkpoints import CASES, build, params

FIXTURE = pathlib.Path(__file__).parent / "data" / "previous_release_checkpoints.pt"
SAVED = torch.load(FIXTURE, weights_only=True)["cases"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_previous_release_state_dict_loads_and_continues_identically(name):
    saved = SAVED[name]
    ps = params(seed=7)  # other values: everything must come from the checkpoint
    with torch.no_grad():
        for p, value in zip(ps, saved["params"]):
            p.copy_(value)
    opt = build(name, ps)
    opt.load_state_dict(saved["state_dict"])
    for gs in saved["grads_after"]:
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
    for p, expected in zip(ps, saved["params_after"]):
        assert torch.equal(p.detach(), expected)
    now = opt.state_dict()
    assert now["state"].keys() == saved["state_after"].keys()
    for key, slots in saved["state_after"].items():
        for slot, expected in slots.items():
            assert torch.equal(now["state"][key][slot], expected), (key, slot)
    for group, expected in zip(now["param_groups"], saved["non_slot_after"]):
        for k, v in expected.items():
            assert torch.equal(group["non_slot"][k], v), k


def test_previous_release_betas_become_torch_tuple():
    # The old groups held beta1/beta2; loaded, they hold torch's betas (what OneCycleLR edits).
    saved = SAVED["AdamOptimizer"]["state_dict"]
    assert "beta1" in saved["param_groups"][1] and "betas" not in saved["param_groups"][1]
    opt = build("AdamOptimizer", params())
    opt.load_state_dict(saved)
    assert opt.param_groups[1]["betas"] == (0.7, 0.99)
    assert "beta1" not in opt.param_groups[1]
