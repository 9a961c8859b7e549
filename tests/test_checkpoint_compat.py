"""State dicts saved by the previous release still load and continue as that release did.

``tests/data/previous_release_checkpoints.pt`` was written by
``tests/data/make_previous_release_checkpoints.py`` with the release before torch's names
(``beta1``/``beta2`` in the param groups, not torch's ``betas``): per optimizer, a state dict
after 3 steps with two param groups, and the parameters and state that release computed over
3 more steps.

Three checks per optimizer:

1. loading changes no tensor: every slot and non-slot value is the saved one, bit for bit;
2. the old format continues exactly as the current format does: the same tensors in a state
   dict the current code wrote give the same bits after 3 steps (same machine, same kernels);
3. the continuation is the old release's arithmetic: it matches what that release computed,
   within the rounding of 3 steps.  Not bit for bit, because the fixture was computed on another
   CPU and torch's vectorised CPU kernels round differently per instruction set (measured: up
   to 2 ulp after 3 steps between an AMD EPYC and an Intel Xeon, with the same torch).
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch

from tests.data.make_previous_release_checkpoints import CASES, STEPS_BEFORE, build, params, run

FIXTURE = pathlib.Path(__file__).parent / "data" / "previous_release_checkpoints.pt"
SAVED = torch.load(FIXTURE, weights_only=True)["cases"]
# Each step of any of these rules rounds at most 8 times (Adam: m, v, sqrt, +eps, /, *lr, -);
# a rounding is at most 1 ulp apart between two instruction sets, and a difference carried in
# the state is rounded again each step: 3 steps x 8 roundings x eps, relative to the tensor's
# size (an update's error scales with the largest values it mixes).
ROUNDINGS = 3 * 8 * torch.finfo(torch.float32).eps


def _continue(name: str, state_dict: dict, start: list[torch.Tensor]):
    ps = params(seed=7)  # other values: everything must come from the checkpoint
    with torch.no_grad():
        for p, value in zip(ps, start):
            p.copy_(value)
    opt = build(name, ps)
    opt.load_state_dict(copy.deepcopy(state_dict))  # as torch's, it keeps the given tensors
    loaded = copy.deepcopy(opt.state_dict())
    for gs in SAVED[name]["grads_after"]:
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in ps], opt.state_dict(), loaded


def _close(got: torch.Tensor, expected: torch.Tensor, what) -> None:
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        got, expected, rtol=ROUNDINGS, atol=ROUNDINGS * scale, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_previous_release_state_dict_loads_and_continues_identically(name):
    saved = SAVED[name]
    old_params, old_state, loaded = _continue(name, saved["state_dict"], saved["params"])

    # 1. loading changes no tensor (and brings back no empty entry the old release saved)
    assert all(loaded["state"].values())
    for key, slots in saved["state_dict"]["state"].items():
        if not slots:
            assert key not in loaded["state"]
        for slot, value in slots.items():
            assert torch.equal(loaded["state"][key][slot], value), (key, slot)
    for group, old in zip(loaded["param_groups"], saved["state_dict"]["param_groups"]):
        for k, v in old["non_slot"].items():
            assert torch.equal(group["non_slot"][k], v), k

    # 2. the same tensors in the current format continue to the same bits
    ps = params()
    fresh = build(name, ps)
    run(fresh, ps, range(STEPS_BEFORE))
    current = copy.deepcopy(fresh.state_dict())
    for key, slots in saved["state_dict"]["state"].items():
        current["state"][key] = {slot: value.clone() for slot, value in slots.items()}
    for group, old in zip(current["param_groups"], saved["state_dict"]["param_groups"]):
        group["non_slot"] = {k: v.clone() for k, v in old["non_slot"].items()}
    new_params, new_state, _ = _continue(name, current, saved["params"])
    for got, want in zip(old_params, new_params):
        assert torch.equal(got, want)
    for key, slots in new_state["state"].items():
        for slot, value in slots.items():
            assert torch.equal(old_state["state"][key][slot], value), (key, slot)

    # 3. what the previous release computed, within the rounding of 3 steps
    for i, (got, expected) in enumerate(zip(old_params, saved["params_after"])):
        _close(got, expected, f"parameter {i}")
    # That release saved an empty entry per parameter of a slot-free optimizer; none now.
    assert old_state["state"].keys() == {k for k, v in saved["state_after"].items() if v}
    for key, slots in saved["state_after"].items():
        for slot, expected in slots.items():
            _close(old_state["state"][key][slot], expected, (key, slot))
    for group, expected in zip(old_state["param_groups"], saved["non_slot_after"]):
        for k, v in expected.items():
            _close(group["non_slot"][k], v, k)


def test_previous_release_betas_become_torch_tuple():
    # The old groups held beta1/beta2; loaded, they hold torch's betas (what OneCycleLR edits).
    saved = SAVED["AdamOptimizer"]["state_dict"]
    assert "beta1" in saved["param_groups"][1] and "betas" not in saved["param_groups"][1]
    opt = build("AdamOptimizer", params())
    opt.load_state_dict(saved)
    assert opt.param_groups[1]["betas"] == (0.7, 0.99)
    assert "beta1" not in opt.param_groups[1]
