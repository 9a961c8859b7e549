"""A TF1 run's hyperparameters, read from its graph (``PREFIX.meta``), checked against the
arguments TF's own optimizer was built with; what the graph does not hold is required."""

from __future__ import annotations

import inspect
import os
import warnings

import numpy as np
import pytest
import torch

import gradfleet as gf
from gradfleet.tf_checkpoint import load_tf_checkpoint
from gradfleet.tf_checkpoint.convert import GraphHyperparametersWarning
from gradfleet.tf_checkpoint.graph_hyperparameters import (
    GraphMismatch,
    hyperparameter_keywords,
    read_graph_hyperparameters,
)
from tests.tf_checkpoint import tf_run

pytest.importorskip("tensorflow")

L1, L2 = "l1_regularization_strength", "l2_regularization_strength"
SHRINK = "l2_shrinkage_regularization_strength"
#: TF constructor arguments that are not the optimizer's maths.
NOT_MATHS = {"self", "use_locking", "name", "global_step", "accum_name", "linear_name"}
NOT_MATHS.add("use_own_namescope_for_non_slot_vars")

# (TF class, its arguments, gradfleet class): every argument differs from TF's default.
CASES = [
    ("GradientDescentOptimizer", {"learning_rate": 0.05}, gf.GradientDescentOptimizer),
    (
        "MomentumOptimizer",
        {"learning_rate": 0.05, "momentum": 0.8, "use_nesterov": True},
        gf.MomentumOptimizer,
    ),
    (
        "AdamOptimizer",
        {"learning_rate": 0.02, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6},
        gf.AdamOptimizer,
    ),
    (
        "AdadeltaOptimizer",
        {"learning_rate": 0.5, "rho": 0.9, "epsilon": 1e-6},
        gf.AdadeltaOptimizer,
    ),
    (
        "AdagradOptimizer",
        {"learning_rate": 0.1, "initial_accumulator_value": 0.3},
        gf.AdagradOptimizer,
    ),
    (
        "AdagradDAOptimizer",
        {
            "learning_rate": 0.1,
            "initial_gradient_squared_accumulator_value": 0.2,
            L1: 0.01,
            L2: 0.02,
        },
        gf.AdagradDAOptimizer,
    ),
    (
        "FtrlOptimizer",
        {
            "learning_rate": 0.5,
            "learning_rate_power": -0.6,
            "initial_accumulator_value": 0.2,
            L1: 0.01,
            L2: 0.1,
            "beta": 0.2,
        },
        gf.FtrlOptimizer,
    ),
    ("FtrlOptimizer", {"learning_rate": 0.5, SHRINK: 0.1}, gf.FtrlOptimizer),  # FtrlV2
    (
        "ProximalAdagradOptimizer",
        {"learning_rate": 0.1, "initial_accumulator_value": 0.2, L1: 0.01, L2: 0.02},
        gf.ProximalAdagradOptimizer,
    ),
    (
        "ProximalGradientDescentOptimizer",
        {"learning_rate": 0.1, L1: 0.01, L2: 0.1},
        gf.ProximalGradientDescentOptimizer,
    ),
    (
        "RMSPropOptimizer",
        {"learning_rate": 0.01, "decay": 0.8, "momentum": 0.5, "epsilon": 1e-6},
        gf.RMSPropOptimizer,
    ),
    (
        "RMSPropOptimizer",
        {"learning_rate": 0.01, "decay": 0.8, "momentum": 0.5, "centered": True},
        gf.RMSPropOptimizer,
    ),
]


def _tf_arguments(tf_class: str, given: dict) -> dict:
    """Every maths argument of TF's constructor: its default, or the value given."""
    import tensorflow as tf

    signature = inspect.signature(getattr(tf.compat.v1.train, tf_class).__init__)
    out = {
        k: p.default
        for k, p in signature.parameters.items()
        if k not in NOT_MATHS and p.default is not inspect.Parameter.empty
    }
    out.update(given)
    if tf_class == "FtrlOptimizer":
        # TF's _prepare feeds its kernels l2 + beta / (2 * max(lr, 1e-36)), in float32.
        f32 = np.float32
        beta = f32(out["beta"] or 0.0)
        out[L2] = f32(out[L2]) + beta / (f32(2) * max(f32(out["learning_rate"]), f32(1e-36)))
        out["beta"] = 0.0
    return out


def _run(tmp_path, make, steps=1, seed=0):
    rng = np.random.default_rng(seed)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}
    grads = tf_run.gradients(rng, steps)
    run = tf_run.TFRun(make, init)
    for g in grads:
        run.step(g)
    return run, run.save(str(tmp_path / "tf" / "model.ckpt")), grads


def _make(tf_class, kwargs):
    def make(train, variables):
        import tensorflow as tf

        if tf_class == "AdagradDAOptimizer":
            (step,) = [v for v in tf.compat.v1.global_variables() if v.op.name == "global_step"]
            return train.AdagradDAOptimizer(global_step=step, **kwargs)
        return getattr(train, tf_class)(**kwargs)

    return make


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{sorted(c[1])[-1]}" for c in CASES])
def test_graph_holds_the_arguments_tf_was_built_with(tmp_path, case):
    tf_class, kwargs, gf_class = case
    run, prefix, grads = _run(tmp_path, _make(tf_class, kwargs))
    run.close()
    graph = read_graph_hyperparameters(prefix, gf_class, list(tf_run.SHAPES))
    expected = _tf_arguments(tf_class, kwargs)
    assert graph.missing == {}
    assert sorted(graph.values) == sorted(hyperparameter_keywords(gf_class))
    assert sorted(graph.values) == sorted(expected)
    for key, value in expected.items():
        if isinstance(value, bool):
            assert graph.values[key] is value, key
        else:  # TF's kernels take Python floats as float32 constants
            assert np.float32(graph.values[key]) == np.float32(value), key
    # The values read give gradfleet the update of the arguments TF was given.
    steps = []
    for arguments in (graph.values, kwargs):
        torch.manual_seed(0)
        model = tf_run.Model()
        opt = gf_class(model.parameters(), **arguments)
        tf_run.torch_step(model, opt, grads[0])
        steps.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*steps))


def test_schedule_is_not_in_the_graph(tmp_path):
    def make(train, variables):
        import tensorflow as tf

        (step,) = [v for v in tf.compat.v1.global_variables() if v.op.name == "global_step"]
        lr = train.exponential_decay(0.01, step, decay_steps=10, decay_rate=0.5)
        return train.AdamOptimizer(lr, beta1=0.8)

    run, prefix, _ = _run(tmp_path, make)
    run.close()
    graph = read_graph_hyperparameters(prefix, gf.AdamOptimizer)
    assert sorted(graph.missing) == ["learning_rate"]
    assert "global_step" in graph.missing["learning_rate"]
    assert graph.values == {"beta1": 0.8, "beta2": 0.999, "epsilon": 1e-08}


def test_placeholder_is_not_in_the_graph(tmp_path):
    def make(train, variables):
        import tensorflow as tf

        return train.MomentumOptimizer(0.1, tf.compat.v1.placeholder_with_default(0.9, []))

    run, prefix, _ = _run(tmp_path, make)
    run.close()
    graph = read_graph_hyperparameters(prefix, gf.MomentumOptimizer)
    assert sorted(graph.missing) == ["momentum"]
    assert "placeholder" in graph.missing["momentum"]
    assert graph.values == {"learning_rate": 0.1, "use_nesterov": False}


def test_another_optimizers_graph_is_refused(tmp_path):
    run, prefix, _ = _run(tmp_path, _make("GradientDescentOptimizer", {"learning_rate": 0.1}))
    run.close()
    with pytest.raises(GraphMismatch) as info:
        read_graph_hyperparameters(prefix, gf.FtrlOptimizer)
    message = str(info.value)
    assert "GradientDescentOptimizer (ResourceApplyGradientDescent)" in message
    assert "not with FtrlOptimizer" in message


def test_without_a_graph_every_value_is_missing(tmp_path):
    run, prefix, _ = _run(tmp_path, _make("AdamOptimizer", {"learning_rate": 0.01}))
    run.close()
    os.remove(prefix + ".meta")
    graph = read_graph_hyperparameters(prefix, gf.AdamOptimizer)
    assert graph.values == {}
    assert sorted(graph.missing) == ["beta1", "beta2", "epsilon", "learning_rate"]
    assert all("no TF graph" in why for why in graph.missing.values())


def test_load_names_hyperparameters_that_differ_from_the_graph(tmp_path):
    run, prefix, _ = _run(tmp_path, _make("AdamOptimizer", {"learning_rate": 0.01}))
    run.close()
    model = tf_run.Model()
    opt = gf.AdamOptimizer(model.parameters())  # TF's default lr 0.001, not the run's 0.01
    with pytest.warns(GraphHyperparametersWarning) as record:
        load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP)
    (message,) = [str(r.message) for r in record]
    assert "group 0: learning_rate 0.001, the TF graph's 0.01" in message
    assert "beta1" not in message  # equal: not named

    model = tf_run.Model()
    opt = gf.AdamOptimizer(model.parameters(), learning_rate=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP)
