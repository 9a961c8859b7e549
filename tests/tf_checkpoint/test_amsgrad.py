"""RETURNN's AMSGrad in its TF backend: the names come from the checkpoint of a run of
RETURNN's own TF ``Updater``.

RETURNN's ``AMSGradOptimizer`` keeps unnamed ``tf.Variable``s, created when it is built:
its counter ``t``, then ``m``, ``v``, ``v_hat`` of each variable of its ``var_list``.  The
``Updater`` builds optimizers without a ``var_list``, so ``optimizer = {"class": "amsgrad"}``
fails at its first update (``KeyError``); a RETURNN-TF run uses AMSGrad through a config class
that passes the trainable variables, as here.  The run: RETURNN's ``Updater`` on an objective
whose gradients are the fed arrays, K steps, a ``Saver`` over all global variables; gradfleet
loads it (every value bit for bit), both continue N steps and agree; then gradfleet's
checkpoint goes back into the TF graph, which continues and is loaded again.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradfleet as gf
from gradfleet.tf_checkpoint import TRANSPOSE, load_tf_checkpoint, save_tf_checkpoint, tf_tensors
from gradfleet.tf_checkpoint.returnn import RETURNN_TF_EXTRAS
from gradfleet.tf_checkpoint.slot_names import amsgrad_names
from tests.conformance.test_conformance import TOLERANCE

pytest.importorskip("returnn.tf.updater")

K, N, LR = 3, 3, 0.1
RTOL, ATOL = TOLERANCE["float32"]
SHAPES = {"dense/kernel": (3, 2), "dense/bias": (2,)}
NAME_MAP = {"dense.weight": ("dense/kernel", TRANSPOSE), "dense.bias": "dense/bias"}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(3, 2)


class ReturnnTF:
    """RETURNN's TF ``Updater`` with AMSGrad over ``dense/kernel`` and ``dense/bias``."""

    def __init__(self, init: dict[str, np.ndarray]) -> None:
        import tensorflow as tf
        from returnn.config import Config
        from returnn.tf.updater import AMSGradOptimizer, Updater

        v1 = tf.compat.v1

        class AMSGradOverTrainables(AMSGradOptimizer):
            def __init__(self, **kwargs):
                super().__init__(var_list=v1.trainable_variables(), **kwargs)

        self.v1, self.graph = v1, tf.Graph()
        with self.graph.as_default():
            step = v1.Variable(0, dtype=tf.int64, name="global_step", trainable=False)
            self.vars = {n: v1.Variable(init[n], name=n, use_resource=False) for n in SHAPES}
            self.feeds = {n: v1.placeholder(tf.float32, s) for n, s in SHAPES.items()}
            # gradient of sum(var * fed) is the fed array
            objective = tf.add_n([tf.reduce_sum(v * self.feeds[n]) for n, v in self.vars.items()])
            config = Config({"optimizer": {"class": AMSGradOverTrainables}})
            self.updater = Updater(config, objective=objective, global_train_step_var=step)
            self.updater.set_trainable_vars(list(self.vars.values()))
            self.train = self.updater.get_optim_op()  # counts global_step too
            self.opt = self.updater.get_default_optimizer()
            self.saver = v1.train.Saver()  # every global variable
            restorable = [v for v in v1.global_variables() if v.op.name not in RETURNN_TF_EXTRAS]
            self.restorer = v1.train.Saver(var_list=restorable)
            self.sess = v1.Session(graph=self.graph)
            self.sess.run(v1.global_variables_initializer())
            self.updater.set_learning_rate(LR, self.sess)

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.sess.run(self.train, {self.feeds[n]: g for n, g in grads.items()})

    def save(self, prefix: str) -> str:
        with self.graph.as_default():
            return self.saver.save(self.sess, prefix)

    def restore(self, prefix: str) -> None:
        with self.graph.as_default():
            self.restorer.restore(self.sess, prefix)

    def values(self) -> dict[str, np.ndarray]:
        with self.graph.as_default():
            variables = [v for v in self.v1.global_variables() if v.op.name != "learning_rate"]
        return dict(zip([v.op.name for v in variables], self.sess.run(variables)))


def _gradients(rng, steps):
    return [
        {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
        for _ in range(steps)
    ]


def _torch_step(model: Net, opt, grads) -> None:
    model.dense.weight.grad = torch.from_numpy(grads["dense/kernel"].T.copy())
    model.dense.bias.grad = torch.from_numpy(grads["dense/bias"].copy())
    opt.step()


def _fresh():
    torch.manual_seed(0)
    model = Net()
    return model, gf.AMSGradOptimizer(model.parameters(), LR, epsilon=1e-16)  # RETURNN's eps


def _assert_same(got: dict, expected: dict, rtol: float, atol: float, where: str) -> None:
    assert sorted(got) == sorted(expected), where
    for name, value in expected.items():
        np.testing.assert_allclose(
            got[name], value, rtol=rtol, atol=atol, err_msg=f"{where}: {name}"
        )


def test_returnn_tf_amsgrad_checkpoint(tmp_path):
    rng = np.random.default_rng(17)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = _gradients(rng, K + N)
    run = ReturnnTF(init)
    try:
        # The names RETURNN's variables got, in gradfleet's parameter order (kernel, bias).
        assert run.opt.t.op.name == "Variable"
        for i, var in enumerate(run.vars.values()):
            tf_names = {s: getattr(run.opt, s)[var].op.name for s in ("m", "v", "v_hat")}
            assert tf_names == amsgrad_names(i)
        for g in grads[:K]:
            run.step(g)
        at_k = run.values()
        a = run.save(str(tmp_path / "a" / "model.ckpt"))

        model, opt = _fresh()
        loaded = load_tf_checkpoint(a, model, opt, NAME_MAP, ignore=RETURNN_TF_EXTRAS)
        assert loaded.global_step == K
        assert sorted(loaded.used) == sorted(at_k)  # every variable but learning_rate
        _assert_same(tf_tensors(model, opt, NAME_MAP, global_step=K), at_k, 0, 0, "loaded")
        b = save_tf_checkpoint(tmp_path / "b" / "model.ckpt", model, opt, NAME_MAP, global_step=K)
        for g in grads[K:]:
            run.step(g)
            _torch_step(model, opt, g)
        mine = tf_tensors(model, opt, NAME_MAP, global_step=K + N)
        _assert_same(mine, run.values(), RTOL, ATOL, "continued")

        run.restore(b)  # gradfleet -> RETURNN-TF -> gradfleet
        _assert_same(run.values(), at_k, 0, 0, "TF restored gradfleet's checkpoint")
        for g in grads[K:]:
            run.step(g)
        c = run.save(str(tmp_path / "c" / "model.ckpt"))
        model_c, opt_c = _fresh()
        load_tf_checkpoint(c, model_c, opt_c, NAME_MAP, ignore=RETURNN_TF_EXTRAS)
        back = tf_tensors(model_c, opt_c, NAME_MAP, global_step=K + N)
        _assert_same(back, mine, RTOL, ATOL, "back in gradfleet")
    finally:
        run.sess.close()
