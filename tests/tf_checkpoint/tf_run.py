"""A tiny TF1 graph-mode training run (the live reference) and its torch twin.

The model: ``dense/kernel`` [3, 2] and ``dense/bias`` [2] with dense gradients, ``emb``
[5, 3] with row-sparse gradients (``IndexedSlices`` with a duplicate row).  The torch twin
is ``nn.Linear(3, 2)`` + ``nn.Embedding(5, 3)``; the kernel is the Linear weight transposed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gradfleet.tf_checkpoint import TRANSPOSE

SHAPES = {"dense/kernel": (3, 2), "dense/bias": (2,), "emb": (5, 3)}
NAME_MAP = {
    "dense.weight": ("dense/kernel", TRANSPOSE),
    "dense.bias": "dense/bias",
    "emb.weight": "emb",
}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(3, 2)
        self.emb = torch.nn.Embedding(5, 3, sparse=True)


def eager() -> Any:
    """A context in TF2's default (eager) mode: importing RETURNN's TF backend switches eager
    execution off for the whole process (``returnn.tf.compat``), and the tests share one."""
    from tensorflow.python.eager import context

    return context.eager_mode()


def gradients(rng: np.random.Generator, steps: int) -> list[dict[str, Any]]:
    """Per step: dense arrays for the dense variables, (indices, rows) for ``emb``."""
    out = []
    for _ in range(steps):
        idx = rng.choice(5, size=3, replace=False)
        idx = np.append(idx, idx[0])  # one duplicate row
        out.append(
            {
                "dense/kernel": rng.standard_normal((3, 2)).astype(np.float32),
                "dense/bias": rng.standard_normal(2).astype(np.float32),
                "emb": (idx.astype(np.int64), rng.standard_normal((4, 3)).astype(np.float32)),
            }
        )
    return out


def torch_step(model: Model, opt: torch.optim.Optimizer, grads: dict[str, Any]) -> None:
    set_gradients(model, grads)
    opt.step()


def set_gradients(model: Model, grads: dict[str, Any]) -> None:
    model.dense.weight.grad = torch.from_numpy(grads["dense/kernel"].T.copy())
    model.dense.bias.grad = torch.from_numpy(grads["dense/bias"].copy())
    idx, rows = grads["emb"]
    model.emb.weight.grad = torch.sparse_coo_tensor(
        torch.from_numpy(idx).reshape(1, -1), torch.from_numpy(rows.copy()), (5, 3)
    )


class TFRun:
    """``make_optimizer(train, variables)`` builds the TF optimizer; ``apply_gradients`` gets
    the graph's ``global_step`` (so checkpoints carry it).  ``use_resource=False`` for
    RETURNN's own optimizers (see tests/conformance/references.py)."""

    def __init__(
        self,
        make_optimizer: Callable[[Any, list], Any],
        init: dict[str, np.ndarray],
        use_resource: bool = True,
        pass_global_step: bool = True,
    ) -> None:
        import tensorflow as tf

        v1 = tf.compat.v1
        self.tf, self.v1 = tf, v1
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.global_step = v1.Variable(0, dtype=tf.int64, name="global_step", trainable=False)
            self.vars = {n: v1.Variable(init[n], name=n, use_resource=use_resource) for n in SHAPES}
            self.opt = make_optimizer(v1.train, list(self.vars.values()))
            self.feeds, pairs = {}, []
            for n, var in self.vars.items():
                if n == "emb":
                    idx = v1.placeholder(tf.int64, [None])
                    rows = v1.placeholder(tf.float32, [None, 3])
                    self.feeds[n] = (idx, rows)
                    pairs.append((tf.IndexedSlices(rows, idx, tf.constant([5, 3], tf.int64)), var))
                else:
                    ph = v1.placeholder(tf.float32, SHAPES[n])
                    self.feeds[n] = ph
                    pairs.append((ph, var))
            if pass_global_step:
                self.train = self.opt.apply_gradients(pairs, global_step=self.global_step)
            else:  # RETURNN's AMSGrad takes none: advance it as RETURNN does, after the update
                with tf.control_dependencies([self.opt.apply_gradients(pairs)]):
                    self.train = v1.assign_add(self.global_step, 1)
            self.saver = v1.train.Saver()
            self.sess = v1.Session(graph=self.graph)
            self.sess.run(v1.global_variables_initializer())

    def step(self, grads: dict[str, Any]) -> None:
        feed = {}
        for n, ph in self.feeds.items():
            if n == "emb":
                feed[ph[0]], feed[ph[1]] = grads[n]
            else:
                feed[ph] = grads[n]
        self.sess.run(self.train, feed)

    def save(self, prefix: str) -> str:
        with self.graph.as_default():  # Saver takes its eager path outside its graph
            return self.saver.save(self.sess, prefix)

    def restore(self, prefix: str) -> None:
        with self.graph.as_default():
            self.saver.restore(self.sess, prefix)

    def values(self) -> dict[str, np.ndarray]:
        """Every global variable by name (parameters, slots, non-slot, global_step)."""
        with self.graph.as_default():
            variables = self.v1.global_variables()
        return dict(zip([v.op.name for v in variables], self.sess.run(variables)))

    def close(self) -> None:
        self.sess.close()
