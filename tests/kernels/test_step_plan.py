"""The fused path's replayed steps (``gradfleet.kernels.plan``) against full steps.

A replay runs the kernels the last full step recorded, after checking in bulk that nothing
they depend on changed.  Checked here: replayed steps give the full path's bits (same
kernels, same inputs) and the reference loop's values within the fused tolerance, replays
really happen, and every change a replay must notice (gradients missing or back, a gradient
of another shape, layout, dtype or kind, a replaced slot or parameter tensor, a param group
added, new options) takes the full path, which raises its usual errors and changes nothing.
"""

from __future__ import annotations

import pytest
import torch

import gradfleet as gf
from gradfleet.kernels import plan as plan_module

pytestmark = pytest.mark.compile  # each test's fused steps compile their kernels
FUSED_TOL = {"rtol": 2e-6, "atol": 2e-7}  # tests/kernels/test_fast_paths.py: a few ulps


@pytest.fixture
def replays(monkeypatch):
    """Counts replays that ran (True) and were refused (False)."""
    seen: list[bool] = []
    replay = plan_module.StepPlan.replay

    def spy(self, opt):
        done = replay(self, opt)
        seen.append(done)
        return done

    monkeypatch.setattr(plan_module.StepPlan, "replay", spy)
    return seen


def _params(seed=0, shapes=((5, 3), (7,), (70, 64), (0,))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _state(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        out.extend(v.clone() for _, v in sorted(opt.state.get(p, {}).items()))
    for group in opt.param_groups:
        out.extend(v.clone() for _, v in sorted(group["non_slot"].items()))
    return out


def _schedule(make, options, steps, edit=None):
    """Run ``steps`` steps; ``edit(step, params, opt)`` may change things before a step."""
    params = _params()
    opt = make(params, **options)
    snapshots = []
    for step in range(steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        if edit is not None:
            edit(step, params, opt)
        opt.step()
        snapshots.append(_state(opt, params))
    return snapshots


def _adam(params, **options):
    return gf.AdamOptimizer(params, learning_rate=0.05, **options)


def _check(make, steps, edit=None, monkeypatch=None):
    """Replayed fused steps == full fused steps (bitwise), and == the loop (fused tolerance)."""
    loop = _schedule(make, {"foreach": False}, steps, edit)
    replayed = _schedule(make, {"fused": True}, steps, edit)
    monkeypatch.setattr(plan_module, "build", lambda opt, record: None)  # full steps only
    full = _schedule(make, {"fused": True}, steps, edit)
    for step, (a, b, c) in enumerate(zip(loop, replayed, full)):
        for i, (x, y, z) in enumerate(zip(a, b, c)):
            assert torch.equal(y, z), f"step {step + 1}, tensor {i}: replay != full path"
            torch.testing.assert_close(y, x, **FUSED_TOL, msg=f"step {step + 1}, tensor {i}")


def test_replayed_steps_match_full_steps_and_the_loop(replays, monkeypatch):
    _check(_adam, 5, monkeypatch=monkeypatch)
    assert replays.count(True) == 4  # every step after the first, in the replayed run


def test_new_learning_rate_is_read_by_the_replay(replays, monkeypatch):
    def edit(step, params, opt):
        opt.param_groups[0]["lr"] = 0.05 / (step + 1)

    _check(_adam, 4, edit, monkeypatch)
    assert replays.count(True) == 3


def test_missing_and_returning_gradients_take_the_full_path(replays, monkeypatch):
    def edit(step, params, opt):
        if step in (2, 3):
            params[1].grad = None

    _check(_adam, 6, edit, monkeypatch)
    # steps 3 and 5 change which gradients exist (full path, new plan); 2, 4 and 6 replay
    assert replays == [True, False, True, False, True]


def test_gradient_layout_change_takes_the_full_path(replays, monkeypatch):
    def edit(step, params, opt):
        if step == 2:  # same values, column-major: another kernel
            params[2].grad = params[2].grad.t().contiguous().t()

    _check(_adam, 4, edit, monkeypatch)
    assert replays == [True, False, False]


def test_replaced_slot_takes_the_full_path(replays, monkeypatch):
    def edit(step, params, opt):
        if step == 2:
            state = opt.state.get(params[2])
            if state:  # the loop run has the slot too; same values, another layout
                state["m"] = state["m"].t().contiguous().t()

    _check(_adam, 4, edit, monkeypatch)
    assert replays == [True, False, True]


def test_replaced_parameter_data_takes_the_full_path(replays, monkeypatch):
    def edit(step, params, opt):
        if step == 2:  # what Module.to() does: same Parameter, new tensor behind it
            params[2].data = params[2].data.t().contiguous().t()

    _check(_adam, 4, edit, monkeypatch)
    assert replays == [True, False, True]


def test_wrong_gradient_after_replays_raises_and_changes_nothing(replays):
    params = _params()
    opt = _adam(params, fused=True)
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    before = _state(opt, params)
    bad = [
        (torch.zeros(6, 3), ValueError, "gradient of shape"),
        (torch.zeros(5, 3, dtype=torch.float64), TypeError, "must match its parameter"),
    ]
    for grad, error, message in bad:
        # torch's .grad setter refuses these; the tensor behind a gradient can still change
        params[0].grad.data = grad
        with pytest.raises(error, match=message):
            opt.step()
        for a, b in zip(before, _state(opt, params)):
            assert torch.equal(a, b)
    assert replays == [True, True, False]  # the refused step dropped the plan


def test_invalid_hyperparameter_in_a_replay_changes_nothing(replays):
    params = _params()
    opt = _adam(params, fused=True)
    for step in range(2):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    before = _state(opt, params)
    with pytest.raises(ValueError, match="learning_rate"):
        opt.param_groups[0]["lr"] = -1.0
        opt.step()
    for a, b in zip(before, _state(opt, params)):
        assert torch.equal(a, b)


def test_sparse_gradient_takes_the_reference_path(replays):
    """A sparse gradient where the plan saw a dense one: the full path, _apply_sparse."""
    w = torch.nn.Parameter(torch.randn(6, 2))
    ref = torch.nn.Parameter(w.detach().clone())
    opts = [
        gf.MomentumOptimizer([x], 0.1, momentum=0.9, **o)
        for x, o in ((w, {"fused": True}), (ref, {"foreach": False}))
    ]
    for step in range(4):
        for x, opt in zip((w, ref), opts):
            if step == 2:
                x.grad = torch.sparse_coo_tensor([[1, 4]], torch.ones(2, 2), (6, 2))
            else:
                x.grad = torch.full((6, 2), 0.5)
            opt.step()
    torch.testing.assert_close(w.detach(), ref.detach(), **FUSED_TOL)
    assert replays == [True, False]  # the sparse step records no plan: step 4 is full


def test_added_param_group_and_changed_options_take_the_full_path(replays):
    params = _params()
    opt = _adam(params[:2], fused=True)
    for step in range(2):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    opt.add_param_group({"params": params[2:]})
    opt.step()
    opt.step()
    opt.param_groups[1]["fused"] = None  # the reference loop for that group from now on
    opt.step()
    opt.step()  # a group on the loop: never recorded, never replayed
    assert replays == [True, False, True, False]
    assert opt.__dict__.get("_step_plan") is None


def test_state_dict_load_replaces_the_plan(replays):
    params = _params()
    opt = _adam(params, fused=True)
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    opt.load_state_dict(opt.state_dict())  # new slot tensors: the plan is dropped
    assert opt.__dict__.get("_step_plan") is None
    opt.step()
    opt.step()
    assert replays == [True, True, True]  # the step after the load was a full one


def test_overhead_benchmark_reports_per_parameter_step_cost(tmp_path, capsys, monkeypatch, replays):
    """``--overhead N``: per-parameter figures are the step medians over N, beside torch's
    fused Adam timed on the same tensors, and the steps timed were replays."""
    import json

    from benchmarks.optimizers import optimizer_speed

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    argv = ["--overhead", "5", "--only", "GradientDescentOptimizer", "--out", str(tmp_path)]
    optimizer_speed.main([*argv, "--warmup", "1", "--reps", "3"])
    result = json.loads((tmp_path / "step_overhead.json").read_text())
    (row,) = result["rows"]
    assert row["optimizer"] == "GradientDescentOptimizer"
    assert row["wall_us_per_param"] == pytest.approx(row["wall_s"] / 5 * 1e6)
    assert row["partner_wall_us_per_param"] == pytest.approx(row["partner_wall_s"] / 5 * 1e6)
    assert 0 < row["cpu_s"] and 0 < row["partner_cpu_s"]
    assert "GradientDescentOptimizer" in capsys.readouterr().out
    assert replays == [True] * 4  # warm-up and timed steps after the compiling one
