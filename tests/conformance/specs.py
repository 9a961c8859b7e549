"""The conformance table: one row per gradfleet optimizer (in the spirit of torch's
OptimizerInfo).  ``test_conformance.py`` drives every row through every config, dtype and
gradient mode, and compares parameters and slots after every step with the row's reference.

Rows whose algorithm TensorFlow ships use TensorFlow itself (``tf_reference``); RETURNN's
own optimizers use float64 numpy rules written from the spec (``specs_returnn.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import gradfleet as gf
from tests.conformance.references import TFReference

MODES = ("dense", "sparse_unique", "sparse_duplicates", "sparse_empty")


@dataclass
class Spec:
    """How to build, configure and check one optimizer.

    ``reference(config, init, modes)`` returns a reference object (see references.py);
    ``configs`` are fixed TF-named argument dicts, ``random_config(rng)`` draws more;
    ``slots`` maps gradfleet slot names to the reference's slot names.
    """

    cls: type
    reference: Callable
    configs: list[dict]
    slots: dict[str, str]
    random_config: Callable[[np.random.Generator], dict] | None = None
    modes: tuple[str, ...] = MODES
    dtypes: tuple[str, ...] = ("float32", "float64")
    make: Callable | None = None  # (params, config) -> optimizer; default cls(params, **config)
    # Relative/absolute tolerance per dtype; see test_conformance.TOLERANCE for the default.
    tolerance: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.cls.__name__

    def build(self, params, config):
        return self.make(params, config) if self.make else self.cls(params, **config)


def tf_reference(factory: Callable, slot_names: list[str], pass_global_step: bool = False):
    """A ``reference`` for a ``tf.compat.v1.train`` optimizer built by ``factory(train,
    config, global_step)``."""

    def build(config, init, modes):
        import tensorflow as tf

        return TFReference(
            lambda cfg, gs: factory(tf.compat.v1.train, cfg, gs),
            config,
            init,
            modes,
            slot_names,
            pass_global_step,
        )

    return build


def _uniform(rng, lo, hi):
    return float(rng.uniform(lo, hi))


SPECS: list[Spec] = [
    Spec(
        gf.GradientDescentOptimizer,
        tf_reference(lambda t, c, gs: t.GradientDescentOptimizer(**c), []),
        configs=[{"learning_rate": 0.1}],
        slots={},
        random_config=lambda r: {"learning_rate": _uniform(r, 0.01, 1.0)},
    ),
    Spec(
        gf.MomentumOptimizer,
        tf_reference(lambda t, c, gs: t.MomentumOptimizer(**c), ["momentum"]),
        configs=[
            {"learning_rate": 0.1, "momentum": 0.9},
            {"learning_rate": 0.05, "momentum": 0.5, "use_nesterov": True},
        ],
        slots={"momentum": "momentum"},
        random_config=lambda r: {
            "learning_rate": _uniform(r, 0.01, 0.5),
            "momentum": _uniform(r, 0.0, 0.99),
            "use_nesterov": bool(r.integers(2)),
        },
    ),
    Spec(
        gf.AdamOptimizer,
        tf_reference(lambda t, c, gs: t.AdamOptimizer(**c), ["m", "v"]),
        configs=[
            {},
            {"learning_rate": 0.1, "beta1": 0.8, "beta2": 0.9, "epsilon": 1e-16},
        ],
        slots={"m": "m", "v": "v"},
        random_config=lambda r: {
            "learning_rate": _uniform(r, 0.001, 0.3),
            "beta1": _uniform(r, 0.0, 0.99),
            "beta2": _uniform(r, 0.5, 0.9999),
            "epsilon": float(10 ** r.uniform(-10, -3)),
        },
    ),
]
