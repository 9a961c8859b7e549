"""Independent references the conformance suite compares gradfleet against.

A reference takes the initial parameter values and then, step by step, the same gradients
gradfleet gets; afterwards it reports every parameter and slot.  A gradient is either
``("dense", array)`` or ``("sparse", indices, values)`` (row-sparse, duplicates allowed).

* :class:`TFReference` drives TensorFlow itself (``tf.compat.v1.train`` in graph mode).
* :class:`ReturnnTFReference` drives RETURNN's own TF optimizers (``returnn.tf.updater``) the
  same way, on reference variables.
* :class:`NumpyReference` runs a float64 numpy rule written from the spec (for RETURNN's own
  optimizers, which TensorFlow does not ship).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Grad = tuple


class TFReference:
    """Runs a ``tf.compat.v1.train`` optimizer on resource variables (``use_resource=False``:
    classic reference variables), one session step per ``step`` call, feeding dense gradients
    or ``IndexedSlices`` through placeholders.  ``make_optimizer(config, global_step)`` builds
    the optimizer inside the graph, after the variables (``self.vars``)."""

    use_resource = True

    def __init__(
        self,
        make_optimizer: Callable[[dict, Any], Any],
        config: dict,
        init: list[np.ndarray],
        modes: list[str],
        slot_names: list[str],
        pass_global_step: bool = False,
    ) -> None:
        import tensorflow as tf

        self.tf = tf
        v1 = tf.compat.v1
        self.graph = tf.Graph()
        with self.graph.as_default():
            dtype = tf.as_dtype(init[0].dtype)
            self.vars = [
                v1.Variable(x, dtype=dtype, use_resource=self.use_resource, name=f"w{i}")
                for i, x in enumerate(init)
            ]
            self.global_step = v1.Variable(0, dtype=tf.int64, name="global_step")
            opt = make_optimizer(config, self.global_step)
            self.feeds, pairs = [], []
            for var, x, mode in zip(self.vars, init, modes):
                if mode == "dense":
                    ph = v1.placeholder(dtype, x.shape)
                    self.feeds.append((ph,))
                    pairs.append((ph, var))
                else:
                    idx = v1.placeholder(tf.int64, [None])
                    vals = v1.placeholder(dtype, [None, *x.shape[1:]])
                    self.feeds.append((idx, vals))
                    pairs.append((tf.IndexedSlices(vals, idx, tf.constant(x.shape, tf.int64)), var))
            gs = self.global_step if pass_global_step else None
            self.train = self._apply_gradients(opt, pairs, gs)
            self.slots = [
                {name: self._get_slot(opt, var, name) for name in slot_names} for var in self.vars
            ]
            self.optimizer = opt
            self.sess = v1.Session(graph=self.graph)
            self.sess.run(v1.global_variables_initializer())

    def _apply_gradients(self, opt: Any, pairs: list, global_step: Any) -> Any:
        return opt.apply_gradients(pairs, global_step=global_step)

    def _get_slot(self, opt: Any, var: Any, name: str) -> Any:
        return opt.get_slot(var, name)

    def step(self, grads: list[Grad]) -> None:
        feed = {}
        for phs, grad in zip(self.feeds, grads):
            if grad[0] == "dense":
                feed[phs[0]] = grad[1]
            else:
                feed[phs[0]] = grad[1].astype(np.int64)
                feed[phs[1]] = grad[2]
        self.sess.run(self.train, feed)

    def params(self) -> list[np.ndarray]:
        return self.sess.run(self.vars)

    def slot(self, i: int, name: str) -> np.ndarray:
        return self.sess.run(self.slots[i][name])

    def close(self) -> None:
        self.sess.close()


class ReturnnTFReference(TFReference):
    """``returnn.tf.updater``'s own optimizers (RETURNN's TF backend code, run live) on
    classic reference variables: there their sparse path reads each slot after its scatter
    update, the intended maths.  On resource variables (RETURNN's default under TF2) the
    ``tf.gather`` after a ``scatter_*`` has no control dependency on it, so sparse
    NeuralOptimizer1 / GradVarianceScaled / CustomAdam read stale slots (docs/optimizers.md).

    ``make_optimizer(config, variables)`` gets the variables too (RETURNN's AMSGrad creates
    its slots at construction from ``var_list`` and takes no ``global_step``)."""

    use_resource = False

    def __init__(self, make_optimizer, config, init, modes, slot_names) -> None:
        # Importing returnn.tf switches TF to graph mode for the whole process (returnn.tf.
        # compat); every TF reference here builds its own graph and session, so none cares.
        import returnn.tf.updater  # noqa: F401

        super().__init__(
            lambda cfg, gs: make_optimizer(cfg, self.vars), config, init, modes, slot_names
        )

    def _apply_gradients(self, opt: Any, pairs: list, global_step: Any) -> Any:
        # RETURNN never passes global_step (spec 2.4); AMSGrad's apply_gradients has none.
        return opt.apply_gradients(pairs)

    def _get_slot(self, opt: Any, var: Any, name: str) -> Any:
        import returnn.tf.updater as updater

        if isinstance(opt, updater.AMSGradOptimizer):  # plain dicts keyed by variable
            return getattr(opt, name)[var]
        return opt.get_slot(var, name)


class NumpyReference:
    """A float64 numpy rule: ``rule(w, slots, grad, config, state) -> None`` updates ``w`` and
    the ``slots`` dict in place for one parameter; ``finish(state, config)`` runs once per
    step after all parameters (shared state such as beta powers lives in ``state``)."""

    def __init__(
        self,
        rule: Callable,
        config: dict,
        init: list[np.ndarray],
        init_slots: Callable[[np.ndarray, dict], dict],
        init_state: Callable[[dict], dict] | None = None,
        finish: Callable[[dict, dict], None] | None = None,
    ) -> None:
        self.rule, self.config, self.finish_fn = rule, config, finish
        self.w = [x.astype(np.float64) for x in init]
        self.slots = [init_slots(w, config) for w in self.w]
        self.state = init_state(config) if init_state else {}

    def step(self, grads: list[Grad]) -> None:
        for w, slots, grad in zip(self.w, self.slots, grads):
            self.rule(w, slots, grad, self.config, self.state)
        if self.finish_fn:
            self.finish_fn(self.state, self.config)

    def params(self) -> list[np.ndarray]:
        return self.w

    def slot(self, i: int, name: str) -> np.ndarray:
        return self.slots[i][name]

    def close(self) -> None:
        pass


def f32(x: float) -> float:
    """A Python float rounded through float32, as TF rounds Python-float hyperparameters."""
    return float(np.float32(x))
