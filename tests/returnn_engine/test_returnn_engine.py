"""RETURNN's PyTorch engine training with gradfleet's optimizers (in this process).

* Optimizers given by dotted name with options in TF names train (dense and row-sparse
  gradients), and the optimizer RETURNN built carries those options and RETURNN's per-step
  learning rate.
* Independent reference: gradfleet's MomentumOptimizer / GradientDescentOptimizer under the
  engine follow the same trajectory as torch's SGD (the same maths) under the engine.
* Continuing from a RETURNN checkpoint (model + ``.opt.pt``) gives bit-identical parameters
  and optimizer state to an uninterrupted run.
* RETURNN's device-tensor learning rate (``use_device_lr_tensors``) and its
  ``init_optimizer_state`` (which calls ``init_state()``) change nothing.
* docs/returnn.md's RETURNN config snippet is the config of one of these runs.
"""

from __future__ import annotations

import pytest
import torch

import gradfleet as gf
from tests.returnn_engine import harness

pytestmark = pytest.mark.slow  # RETURNN's engine: about 1 s of set-up per training run

pytest.importorskip("returnn.torch.engine", reason="the test extra installs returnn")

# (dotted name, options in TF names); each option must reach the optimizer's param group.
OPTIMIZERS = [
    ("gradfleet.AdamOptimizer", {"epsilon": 1e-16, "beta1": 0.8, "beta2": 0.99}),
    ("gradfleet.RMSPropOptimizer", {"decay": 0.8, "momentum": 0.5, "epsilon": 1e-10}),
    ("gradfleet.MomentumOptimizer", {"momentum": 0.9, "use_nesterov": True}),
    (
        "gradfleet.FtrlOptimizer",
        {"l1_regularization_strength": 0.001, "l2_regularization_strength": 0.01},
    ),
    ("gradfleet.CustomAdamOptimizer", {"epsilon": 1e-16}),
    ("gradfleet.NeuralOptimizer1", {"beta1": 0.8, "decrease_factor": 0.2}),
]
IDS = [name.split(".")[1] for name, _ in OPTIMIZERS]


def _optimizer_state(opt) -> list[torch.Tensor]:
    out = [t for p in opt.state for t in opt.state[p].values() if torch.is_tensor(t)]
    out += [t for group in opt.param_groups for t in group["non_slot"].values()]
    return [t.detach().clone() for t in out]


@pytest.mark.parametrize("name,options", OPTIMIZERS, ids=IDS)
def test_trains_by_dotted_name_with_tf_options(tmp_path, name, options):
    model = harness.get_model(epoch=1, step=0)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    params, opt = harness.train(
        tmp_path,
        1,
        {"class": name, **options},
        dynamic_learning_rate=harness.decaying_learning_rate,
    )
    assert type(opt).__name__ == name.split(".")[1] and isinstance(opt, gf.Optimizer)
    group = opt.param_groups[0]
    values = {**group, **opt._values(group)}  # TF names (the group keeps torch's ``betas``)
    for key, value in options.items():
        assert values[key] == value, key
    # The engine sets the group's lr from the schedule at every step; after the epoch's 4
    # steps it holds the value for global step 4.
    assert group["lr"] == pytest.approx(0.01 * 0.9**4)
    assert all(torch.isfinite(p).all() for p in params.values())
    assert any(not torch.equal(params[k], start[k]) for k in start)
    slots = set(opt._slot_fills(group))
    assert all(set(opt.state[p]) == slots for p in group["params"])
    # The embedding's gradients reached the optimizer row-sparse (its sparse rule ran).
    (embedding,) = [p for p in group["params"] if p.shape == (5, 3)]
    assert embedding.grad is not None and embedding.grad.is_sparse
    assert not torch.equal(params["embed.weight"], start["embed.weight"])


@pytest.mark.parametrize(
    "ours,options",
    [
        ("gradfleet.MomentumOptimizer", {"momentum": 0.9}),
        ("gradfleet.GradientDescentOptimizer", {}),
    ],
    ids=["Momentum", "GradientDescent"],
)
def test_same_trajectory_as_torch_sgd_under_the_engine(tmp_path, ours, options):
    """TF's Momentum (a = mu*a + g; w -= lr*a) is torch's SGD with dampening 0: the engine
    must give both the same learning rate at every step, over two epochs."""
    schedule = {"dynamic_learning_rate": harness.decaying_learning_rate}
    got, _ = harness.train(tmp_path / "ours", 2, {"class": ours, **options}, **schedule)
    ref, _ = harness.train(tmp_path / "torch", 2, {"class": "sgd", **options}, **schedule)
    # 8 steps of float32 updates whose only difference is the rounding order of lr * a.
    eps = torch.finfo(torch.float32).eps
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=8 * 4 * eps, atol=8 * 4 * eps)


CONTINUED = [OPTIMIZERS[0], OPTIMIZERS[1], OPTIMIZERS[3], OPTIMIZERS[4]]


@pytest.mark.parametrize("name,options", CONTINUED, ids=[n.split(".")[1] for n, _ in CONTINUED])
def test_continuing_from_a_checkpoint_is_exact(tmp_path, name, options):
    opt_config = {"class": name, **options}
    schedule = {"dynamic_learning_rate": harness.decaying_learning_rate}
    full, full_opt = harness.train(tmp_path / "full", 2, opt_config, **schedule)
    harness.train(tmp_path / "split", 1, opt_config, **schedule)
    assert (tmp_path / "split" / "model.001.opt.pt").exists()
    resumed, resumed_opt = harness.train(tmp_path / "split", 2, opt_config, **schedule)
    for k in full:
        assert torch.equal(resumed[k], full[k]), k
    a, b = _optimizer_state(full_opt), _optimizer_state(resumed_opt)
    assert len(a) == len(b) > 0
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_device_lr_tensor_changes_nothing(tmp_path):
    """RETURNN's ``use_device_lr_tensors`` (for its CUDA-graph capture): each group's lr
    becomes a 0-dim tensor that the schedule fills in place."""
    opt_config = {"class": "gradfleet.AdamOptimizer", "epsilon": 1e-16}
    schedule = {"dynamic_learning_rate": harness.decaying_learning_rate}
    floats, _ = harness.train(tmp_path / "float", 1, opt_config, **schedule)
    tensors, opt = harness.train(tmp_path / "tensor", 1, opt_config, device_lr=True, **schedule)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    for k in floats:
        assert torch.equal(tensors[k], floats[k]), k


@pytest.mark.parametrize("cls", [gf.AdamOptimizer, gf.FtrlOptimizer, gf.CustomAdamOptimizer])
def test_returnn_init_optimizer_state_then_step_equals_step(cls):
    from returnn.torch.updater import init_optimizer_state

    results = []
    for init_first in (True, False):
        model = harness.get_model(epoch=1, step=0)
        opt = cls(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        if init_first:
            init_optimizer_state(opt)
            assert all(set(opt.state[p]) == set(cls.slots) for p in model.parameters())
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_page_config_snippet_trains(tmp_path):
    config = harness.page_config()
    assert config.pop("backend") == "torch"
    params, opt = harness.train(tmp_path, 1, **config)
    options = dict(config["optimizer"])
    assert type(opt).__name__ == options.pop("class").split(".")[1]
    values = {**opt.param_groups[0], **opt._values(opt.param_groups[0])}  # TF names
    assert all(values[name] == value for name, value in options.items())
    assert all(torch.isfinite(p).all() for p in params.values())
