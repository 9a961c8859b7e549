"""Conformance rows for RETURNN's own optimizers, checked against float64 numpy rules
written from ../shared/reference/optimizer-semantics.md section 13.

Each rule updates one parameter in place from ``("dense", g)`` or ``("sparse", idx, vals)``.
Sparse updates follow RETURNN's ``BaseCustomOptimizer`` helpers literally, with NO summing of
duplicate indices: ``scatter_add``/``scatter_sub`` apply once per occurrence, in order, and
``scatter_update`` keeps the value of the LAST occurrence.  Hyperparameters are rounded
through float32 (``f32``) as TF's ``convert_to_tensor`` does (spec 1.4, 13.1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

import gradfleet as gf
from gradfleet import _hyper
from tests.conformance.references import NumpyReference, ReturnnTFReference, f32
from tests.conformance.specs import Spec

# ---------------------------------------------------------------- BaseCustom helpers (13.1)


def _parts(grad):
    """(values, indices or None) of a reference gradient."""
    return (grad[1], None) if grad[0] == "dense" else (grad[2], grad[1])


def _gather(x, idx):
    return x if idx is None else x[idx]


def _assign(x, value, idx):
    if idx is None:
        x[...] = value
        return
    for k, i in enumerate(idx):  # scatter_update: a later occurrence overwrites an earlier one
        x[i] = value[k]


def _assign_add(x, value, idx):
    if idx is None:
        x += value
        return
    for k, i in enumerate(idx):  # scatter_add: once per occurrence
        x[i] += value[k]


def _assign_sub(x, value, idx):
    _assign_add(x, -value, idx)


def _zeros(*names):
    return lambda w, config: {n: np.zeros_like(w) for n in names}


def _numpy(rule, init_slots, init_state=None, finish=None):
    def build(config, init, modes):
        return NumpyReference(rule, config, init, init_slots, init_state, finish)

    return build


# ---------------------------------------------------------------- rules


def _custom_gd(w, slots, grad, c, state):
    g, idx = _parts(grad)
    _assign_sub(w, f32(c["learning_rate"]) * g, idx)


def _normalized_sgd(w, slots, grad, c, state):
    g, idx = _parts(grad)
    g_hat = g / np.sqrt(max(float(np.sum(g * g)), 1e-12))  # norm over the values as given
    _assign_sub(w, f32(c["learning_rate"]) * g_hat, idx)


def _neural_optimizer1(w, slots, grad, c, state):
    g, idx = _parts(grad)
    lr, b1 = f32(c["learning_rate"]), f32(c.get("beta1", 0.9))
    df = c.get("decrease_factor", 0.1)  # a Python float in RETURNN's op: not float32-rounded
    m = slots["m"]
    m *= b1  # all rows
    _assign_add(m, g * (1 - b1), idx)
    factor = np.where(np.sign(_gather(m, idx)) == np.sign(g), 1.0, df)
    _assign_sub(w, lr * g * factor, idx)


def _grad_variance_scaled(w, slots, grad, c, state):
    g, idx = _parts(grad)
    lr, b1 = f32(c["learning_rate"]), f32(c.get("beta1", 0.9))
    b2, eps = f32(c.get("beta2", 0.999)), f32(c.get("epsilon", 1e-8))
    m, v = slots["m"], slots["v"]
    m *= b1
    _assign_add(m, g * (1 - b1), idx)
    var_g = (g - _gather(m, idx)) ** 2
    v *= b2
    _assign_add(v, var_g * (1 - b2), idx)
    _assign_sub(w, lr * g * np.minimum(_gather(v, idx) / (var_g + eps), 1.0), idx)


def _adam_powers(c):
    b1, b2 = c.get("beta1", 0.9), c.get("beta2", 0.999)
    return {"b1p": np.float32(f32(b1)), "b2p": np.float32(f32(b2))}


def _adam_finish(state, c):  # float32 multiplication, after all parameters
    state["b1p"] = np.float32(state["b1p"] * np.float32(f32(c.get("beta1", 0.9))))
    state["b2p"] = np.float32(state["b2p"] * np.float32(f32(c.get("beta2", 0.999))))


def _custom_adam(w, slots, grad, c, state):
    g, idx = _parts(grad)
    lr, b1 = f32(c["learning_rate"]), f32(c.get("beta1", 0.9))
    b2, eps = f32(c.get("beta2", 0.999)), f32(c.get("epsilon", 1e-8))
    b1p, b2p = float(state["b1p"]), float(state["b2p"])
    lr_t = lr * np.sqrt(1 - b2p) / (1 - b1p)
    m, v = slots["m"], slots["v"]
    _assign(m, b1 * _gather(m, idx) + (1 - b1) * g, idx)  # both read the OLD rows
    _assign(v, b2 * _gather(v, idx) + (1 - b2) * g * g, idx)
    _assign_sub(w, lr_t * _gather(m, idx) / (np.sqrt(_gather(v, idx)) + eps), idx)


def _amsgrad_state(c):
    return {"t": 1.0}  # the value step 1 sees: RETURNN increments t before any update


def _amsgrad_finish(state, c):
    state["t"] += 1.0


def _amsgrad(w, slots, grad, c, state):
    assert grad[0] == "dense"
    g, t = grad[1], state["t"]
    b1, b2 = c.get("beta1", 0.9), c.get("beta2", 0.99)
    lr, eps = f32(c.get("learning_rate", 0.001)), f32(c.get("epsilon", 0.0))
    if c.get("decay", False):
        lr = lr / np.sqrt(t)
    m, v, v_hat = slots["m"], slots["v"], slots["v_hat"]
    m[...] = f32(b1) * m + f32(1 - b1) * g  # RETURNN: 1 - beta in Python double, then f32
    v[...] = f32(b2) * v + f32(1 - b2) * g * g
    np.maximum(v_hat, v, out=v_hat)
    w += -lr * m / (eps + np.sqrt(v_hat))


# ---------------------------------------------------------------- rows


def _uniform(rng, lo, hi):
    return float(rng.uniform(lo, hi))


def _lr(rng, lo=0.01, hi=0.5):
    return _uniform(rng, lo, hi)


def _eps(rng):
    return float(10 ** rng.uniform(-10, -3))


SPECS: list[Spec] = [
    Spec(
        gf.CustomGradientDescentOptimizer,
        _numpy(_custom_gd, _zeros()),
        configs=[{"learning_rate": 0.1}],
        slots={},
        random_config=lambda r: {"learning_rate": _lr(r, 0.01, 1.0)},
    ),
    Spec(
        gf.NormalizedSGD,
        _numpy(_normalized_sgd, _zeros()),
        configs=[{"learning_rate": 0.1}],
        slots={},
        random_config=lambda r: {"learning_rate": _lr(r, 0.01, 1.0)},
    ),
    Spec(
        gf.NeuralOptimizer1,
        _numpy(_neural_optimizer1, _zeros("m")),
        configs=[
            {"learning_rate": 0.1},
            {"learning_rate": 0.05, "beta1": 0.5, "decrease_factor": 0.3},
        ],
        slots={"m": "m"},
        random_config=lambda r: {
            "learning_rate": _lr(r),
            "beta1": _uniform(r, 0.0, 0.99),
            "decrease_factor": _uniform(r, 0.0, 1.0),
        },
    ),
    Spec(
        gf.GradVarianceScaledOptimizer,
        _numpy(_grad_variance_scaled, _zeros("m", "v")),
        configs=[
            {"learning_rate": 0.1},
            {"learning_rate": 0.05, "beta1": 0.8, "beta2": 0.9, "epsilon": 1e-16},
        ],
        slots={"m": "m", "v": "v"},
        random_config=lambda r: {
            "learning_rate": _lr(r),
            "beta1": _uniform(r, 0.0, 0.99),
            "beta2": _uniform(r, 0.5, 0.9999),
            "epsilon": _eps(r),
        },
    ),
    Spec(
        gf.CustomAdamOptimizer,
        _numpy(_custom_adam, _zeros("m", "v"), _adam_powers, _adam_finish),
        configs=[
            {"learning_rate": 0.001},
            {"learning_rate": 0.1, "beta1": 0.8, "beta2": 0.9, "epsilon": 1e-16},
        ],
        slots={"m": "m", "v": "v"},
        random_config=lambda r: {
            "learning_rate": _lr(r, 0.001, 0.3),
            "beta1": _uniform(r, 0.0, 0.99),
            "beta2": _uniform(r, 0.5, 0.9999),
            "epsilon": _eps(r),
        },
    ),
    Spec(
        gf.AMSGradOptimizer,
        _numpy(_amsgrad, _zeros("m", "v", "v_hat"), _amsgrad_state, _amsgrad_finish),
        configs=[
            {},
            {"learning_rate": 0.1, "decay": True, "epsilon": 1e-16},
            {"learning_rate": 0.05, "beta1": 0.5, "beta2": 0.9, "epsilon": 1e-8},
        ],
        slots={"m": "m", "v": "v", "v_hat": "v_hat"},
        random_config=lambda r: {
            "learning_rate": _lr(r, 0.001, 0.3),
            "decay": bool(r.integers(2)),
            "beta1": _uniform(r, 0.0, 0.99),
            "beta2": _uniform(r, 0.5, 0.9999),
            "epsilon": _eps(r),
        },
        modes=("dense",),
    ),
]


# ---------------------------------------------------------------- RETURNN's TF code, live


def _returnn_tf(class_name: str | Callable[[], type], slot_names: list[str]):
    """A ``reference`` running ``returnn.tf.updater.<class_name>`` (or the class a callable
    returns) as RETURNN's TF backend builds it: TF-named options, ``learning_rate``."""

    def make(config, variables):
        import returnn.tf.updater as updater

        cls = getattr(updater, class_name) if isinstance(class_name, str) else class_name()
        if cls is updater.AMSGradOptimizer:
            return cls(var_list=variables, **config)
        return cls(**config)

    def build(config, init, modes):
        return ReturnnTFReference(make, config, init, modes, slot_names)

    return build


# RETURNN's CustomAdam and AMSGrad keep float32 state (beta powers, AMSGrad's tf.zeros slots)
# that their maths mixes with the variable's dtype: float64 variables fail in RETURNN itself.
_FLOAT32_ONLY = {"CustomAdamOptimizer", "AMSGradOptimizer"}

# The same rows again, checked against RETURNN's TF code (graph mode, reference variables)
# instead of the numpy rules.
SPECS += [
    replace(
        spec,
        reference=_returnn_tf(spec.cls.__name__, list(spec.slots.values())),
        variant="returnn_tf",
        dtypes=("float32",) if spec.cls.__name__ in _FLOAT32_ONLY else spec.dtypes,
        random_config=None,  # the numpy rows cover random configs; these are a live session each
    )
    for spec in list(SPECS)
]


# ---------------------------------------------------------------- BaseCustom as extension point
# The same user-written optimizer subclassed from each framework's BaseCustomOptimizer, using
# every helper: gather, assign (scatter_update: the last duplicate wins), assign_add and
# assign_sub (once per occurrence), reading slots right after their update.


class ExtensionProbe(gf.BaseCustomOptimizer):
    """a = beta * a + (1 - beta) * |g|;  s += g;  w -= lr * g * a   (a, s: slots)."""

    hyperparameters = {"lr": _hyper.NON_NEGATIVE, "beta": _hyper.UNIT_OPEN_RIGHT}
    slots = {"a": 0.0, "s": 0.0}

    def __init__(self, params, learning_rate, beta=0.5, **kwargs):
        super().__init__(params, learning_rate, beta=beta, **kwargs)

    def _apply_var(self, grad, var, indices=None):
        a, s, beta = self._get_slot(var, "a"), self._get_slot(var, "s"), self._hp["beta"]
        self._assign(a, beta * self._gather(a, indices) + (1 - beta) * torch.abs(grad), indices)
        self._assign_add(s, grad, indices)
        self._assign_sub(var, self._hp["lr"] * grad * self._gather(a, indices), indices)


def _returnn_extension_probe() -> type:
    import returnn.tf.updater as updater
    import tensorflow as tf

    class TFExtensionProbe(updater.BaseCustomOptimizer):
        def __init__(self, beta=0.5, **kwargs):
            super().__init__(**kwargs)
            self._beta = beta

        def _prepare(self):
            super()._prepare()
            self._beta_t = tf.convert_to_tensor(self._beta, name="beta")

        def _create_slots(self, var_list):
            for v in var_list:
                self._zeros_slot(v, "a", self._name)
                self._zeros_slot(v, "s", self._name)

        def _apply(self, grad, var, indices=None):
            lr = tf.cast(self._learning_rate_tensor, var.dtype.base_dtype)
            beta = tf.cast(self._beta_t, var.dtype.base_dtype)
            a, s = self.get_slot(var, "a"), self.get_slot(var, "s")
            new_a = beta * self._gather(a, indices) + (1 - beta) * tf.abs(grad)
            a = self._assign(a, new_a, indices)
            s = self._assign_add(s, grad, indices)
            update = self._assign_sub(var, lr * grad * self._gather(a, indices), indices)
            return tf.group(update, a, s)

    return TFExtensionProbe


SPECS.append(
    Spec(
        ExtensionProbe,
        _returnn_tf(_returnn_extension_probe, ["a", "s"]),
        configs=[{"learning_rate": 0.1}, {"learning_rate": 0.3, "beta": 0.8}],
        slots={"a": "a", "s": "s"},
        variant="returnn_tf",
    )
)
