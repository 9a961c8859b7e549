"""TF -> gradfleet -> TF -> gradfleet, for every TF1 optimizer and RETURNN's own, measured.

For each optimizer, on dense (``dense/kernel``, ``dense/bias``) and row-sparse (``emb``,
with a duplicate row) variables:

1. TF trains K steps and its ``Saver`` saves checkpoint A;
2. gradfleet loads A (fresh model and optimizer): every value equals TF's bit for bit, and
   every name TF gave a variable, slot or non-slot variable is one gradfleet fills;
3. gradfleet writes checkpoint B; TF's ``Saver`` restores B, giving TF's own state again;
4. both continue N steps on the same gradients and agree within the conformance suite's
   bounds (parameters, slots, beta powers, global_step);
5. TF continues from B for the same N steps and saves C; gradfleet loads C and agrees with
   its own continuation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradfleet as gf
from gradfleet.tf_checkpoint import load_tf_checkpoint, save_tf_checkpoint, tf_tensors
from gradfleet.tf_checkpoint.slot_names import slot_suffixes
from tests.conformance.test_conformance import TOLERANCE
from tests.tf_checkpoint import tf_run

pytest.importorskip("tensorflow")

K, N = 3, 3
RTOL, ATOL = TOLERANCE["float32"]


def _tf1(name, **kw):
    return lambda train, variables: getattr(train, name)(**kw)


def _returnn(name, **kw):
    def make(train, variables):
        import returnn.tf.updater as updater

        return getattr(updater, name)(**kw)

    return make


def _adagrad_da(train, variables):
    import tensorflow as tf

    (gs,) = [v for v in tf.compat.v1.global_variables() if v.op.name == "global_step"]
    return train.AdagradDAOptimizer(0.1, gs, l1_regularization_strength=0.01)


# (id, TF factory, gradfleet factory, TF on resource variables, (rtol, atol))
CASES = [
    (
        "GradientDescent",
        _tf1("GradientDescentOptimizer", learning_rate=0.1),
        lambda p: gf.GradientDescentOptimizer(p, 0.1),
        True,
        None,
    ),
    (
        "Momentum",
        _tf1("MomentumOptimizer", learning_rate=0.1, momentum=0.9, use_nesterov=True),
        lambda p: gf.MomentumOptimizer(p, 0.1, 0.9, use_nesterov=True),
        True,
        None,
    ),
    (
        "Adam",
        _tf1("AdamOptimizer", learning_rate=0.1),
        lambda p: gf.AdamOptimizer(p, 0.1),
        True,
        None,
    ),
    (
        "Adadelta",
        _tf1("AdadeltaOptimizer", learning_rate=0.5, epsilon=1e-6),
        lambda p: gf.AdadeltaOptimizer(p, 0.5, epsilon=1e-6),
        True,
        None,
    ),
    (
        "Adagrad",
        _tf1("AdagradOptimizer", learning_rate=0.1),
        lambda p: gf.AdagradOptimizer(p, 0.1),
        True,
        None,
    ),
    (
        "AdagradDA",
        _adagrad_da,
        lambda p: gf.AdagradDAOptimizer(p, 0.1, l1_regularization_strength=0.01),
        True,
        None,
    ),
    # Ftrl: see tests/conformance/specs.py for the wider absolute bound.
    (
        "Ftrl",
        _tf1(
            "FtrlOptimizer",
            learning_rate=0.5,
            l1_regularization_strength=0.01,
            l2_shrinkage_regularization_strength=0.1,
        ),
        lambda p: gf.FtrlOptimizer(
            p, 0.5, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.1
        ),
        True,
        (2e-6, 1e-6),
    ),
    (
        "ProximalAdagrad",
        _tf1("ProximalAdagradOptimizer", learning_rate=0.1, l1_regularization_strength=0.01),
        lambda p: gf.ProximalAdagradOptimizer(p, 0.1, l1_regularization_strength=0.01),
        True,
        None,
    ),
    (
        "ProximalGradientDescent",
        _tf1("ProximalGradientDescentOptimizer", learning_rate=0.1, l2_regularization_strength=0.1),
        lambda p: gf.ProximalGradientDescentOptimizer(p, 0.1, l2_regularization_strength=0.1),
        True,
        None,
    ),
    (
        "RMSProp",
        _tf1("RMSPropOptimizer", learning_rate=0.01, momentum=0.5),
        lambda p: gf.RMSPropOptimizer(p, 0.01, momentum=0.5),
        True,
        None,
    ),
    (
        "RMSProp-centered",
        _tf1("RMSPropOptimizer", learning_rate=0.01, momentum=0.5, centered=True),
        lambda p: gf.RMSPropOptimizer(p, 0.01, momentum=0.5, centered=True),
        True,
        None,
    ),
    (
        "CustomGradientDescent",
        _returnn("CustomGradientDescentOptimizer", learning_rate=0.1),
        lambda p: gf.CustomGradientDescentOptimizer(p, 0.1),
        False,
        None,
    ),
    (
        "NormalizedSGD",
        _returnn("NormalizedSGD", learning_rate=0.1),
        lambda p: gf.NormalizedSGD(p, 0.1),
        False,
        None,
    ),
    (
        "NeuralOptimizer1",
        _returnn("NeuralOptimizer1", learning_rate=0.1),
        lambda p: gf.NeuralOptimizer1(p, 0.1),
        False,
        None,
    ),
    (
        "GradVarianceScaled",
        _returnn("GradVarianceScaledOptimizer", learning_rate=0.1),
        lambda p: gf.GradVarianceScaledOptimizer(p, 0.1),
        False,
        None,
    ),
    (
        "CustomAdam",
        _returnn("CustomAdamOptimizer", learning_rate=0.1, epsilon=1e-16),
        lambda p: gf.CustomAdamOptimizer(p, 0.1, epsilon=1e-16),
        False,
        None,
    ),
]


def _fresh(make):
    torch.manual_seed(0)  # any start: loading must overwrite all of it
    model = tf_run.Model()
    return model, make(list(model.parameters()))


def _assert_same_state(got: dict, expected: dict, rtol: float, atol: float, where: str):
    assert sorted(got) == sorted(expected), where
    for name, value in expected.items():
        np.testing.assert_allclose(
            got[name], value, rtol=rtol, atol=atol, err_msg=f"{where}: {name}"
        )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tf_to_gradfleet_and_back(tmp_path, case):
    _, make_tf, make_gf, use_resource, tolerance = case
    rtol, atol = tolerance or (RTOL, ATOL)
    rng = np.random.default_rng(sum(map(ord, case[0])))
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}
    grads = tf_run.gradients(rng, K + N)
    run = tf_run.TFRun(make_tf, init, use_resource=use_resource)
    try:
        for g in grads[:K]:
            run.step(g)
        at_k = run.values()
        a = run.save(str(tmp_path / "a" / "model.ckpt"))

        model, opt = _fresh(make_gf)
        # TF's own slot names are the ones gradfleet's table gives.
        suffixes = slot_suffixes(opt, opt.param_groups[0])
        for var in run.vars.values():
            for slot, suffix in suffixes.items():
                assert run.opt.get_slot(var, slot).op.name == f"{var.op.name}/{suffix}"
        loaded = load_tf_checkpoint(a, model, opt, tf_run.NAME_MAP)
        assert loaded.global_step == K
        mine = tf_tensors(model, opt, tf_run.NAME_MAP, global_step=K)
        _assert_same_state(mine, at_k, 0, 0, "loaded A")  # a copy: bit for bit
        np.testing.assert_array_equal(model.dense.weight.detach().numpy(), at_k["dense/kernel"].T)

        b = save_tf_checkpoint(
            tmp_path / "b" / "model.ckpt", model, opt, tf_run.NAME_MAP, global_step=K
        )
        for g in grads[K:]:
            run.step(g)
            tf_run.torch_step(model, opt, g)
        _assert_same_state(
            tf_tensors(model, opt, tf_run.NAME_MAP, global_step=K + N),
            run.values(),
            rtol,
            atol,
            "continued from A",
        )

        run.restore(b)
        _assert_same_state(run.values(), at_k, 0, 0, "TF restored B")
        for g in grads[K:]:
            run.step(g)
        c = run.save(str(tmp_path / "c" / "model.ckpt"))
        model_c, opt_c = _fresh(make_gf)
        assert load_tf_checkpoint(c, model_c, opt_c, tf_run.NAME_MAP).global_step == K + N
        _assert_same_state(
            tf_tensors(model_c, opt_c, tf_run.NAME_MAP, global_step=K + N),
            tf_tensors(model, opt, tf_run.NAME_MAP, global_step=K + N),
            rtol,
            atol,
            "gradfleet -> TF -> gradfleet",
        )
    finally:
        run.close()
