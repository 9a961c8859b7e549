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
import torch

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
    # Tells apart two rows of one class whose slot sets differ (centered RMSProp's "mg").
    variant: str = ""

    @property
    def name(self) -> str:
        return f"{self.cls.__name__}-{self.variant}" if self.variant else self.cls.__name__

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


def _maybe(rng, value):
    """``value`` or 0.0, each half the time (to cover a regularizer's off branch)."""
    return value if rng.integers(2) else 0.0


# AdagradDA's step source, chosen by the config key "_global_step" (popped on both sides):
# absent: gradfleet counts its own steps, TF gets global_step through apply_gradients;
# "explicit": gradfleet gets a global_step tensor that a post-step hook advances (as
# apply_gradients(global_step=...) would); "frozen": nobody advances it, so T stays 1.
def _adagrad_da_make(params, config):
    source = config.pop("_global_step", None)
    if source is None:
        return gf.AdagradDAOptimizer(params, **config)
    global_step = torch.zeros((), dtype=torch.int64)
    opt = gf.AdagradDAOptimizer(params, global_step=global_step, **config)
    if source == "explicit":
        opt.register_step_post_hook(lambda *_: global_step.add_(1))
    return opt


def _adagrad_da_reference(config, init, modes):
    source = config.pop("_global_step", None)
    build = tf_reference(
        lambda t, c, gs: t.AdagradDAOptimizer(global_step=gs, **c),
        ["gradient_accumulator", "gradient_squared_accumulator"],
        pass_global_step=source != "frozen",
    )
    return build(config, init, modes)


def _ftrl_random(r):
    power = -0.5 if r.integers(2) else _uniform(r, -1.0, 0.0)
    return {
        "learning_rate": _uniform(r, 0.05, 2.0),
        "learning_rate_power": power,
        "initial_accumulator_value": _uniform(r, 0.0, 0.5),
        "l1_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.5)),
        "l2_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.5)),
        "l2_shrinkage_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.5)),
        "beta": _maybe(r, _uniform(r, 0.0, 1.0)),
    }


def _rmsprop_random(centered):
    def draw(r):
        return {
            "learning_rate": _uniform(r, 0.001, 0.1),
            "decay": _uniform(r, 0.5, 0.99),
            "momentum": _maybe(r, _uniform(r, 0.0, 0.95)),
            "epsilon": float(10 ** r.uniform(-10, -3)),
            "centered": centered,
        }

    return draw


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
    Spec(
        gf.AdadeltaOptimizer,
        tf_reference(lambda t, c, gs: t.AdadeltaOptimizer(**c), ["accum", "accum_update"]),
        configs=[{}, {"learning_rate": 0.5, "rho": 0.9, "epsilon": 1e-6}],
        slots={"accum": "accum", "accum_update": "accum_update"},
        random_config=lambda r: {
            "learning_rate": _uniform(r, 0.01, 1.0),
            "rho": _uniform(r, 0.5, 0.99),
            "epsilon": float(10 ** r.uniform(-10, -4)),
        },
    ),
    Spec(
        gf.AdagradOptimizer,
        tf_reference(lambda t, c, gs: t.AdagradOptimizer(**c), ["accumulator"]),
        configs=[
            {"learning_rate": 0.1},
            {"learning_rate": 0.5, "initial_accumulator_value": 0.01},
        ],
        slots={"accumulator": "accumulator"},
        random_config=lambda r: {
            "learning_rate": _uniform(r, 0.01, 1.0),
            "initial_accumulator_value": _uniform(r, 0.01, 1.0),
        },
    ),
    Spec(
        gf.AdagradDAOptimizer,
        _adagrad_da_reference,
        configs=[
            {"learning_rate": 0.1},
            {
                "learning_rate": 0.2,
                "l1_regularization_strength": 0.3,
                "l2_regularization_strength": 0.02,
            },
            {"learning_rate": 0.1, "l1_regularization_strength": 0.2, "_global_step": "explicit"},
            {"learning_rate": 0.3, "l2_regularization_strength": 0.1, "_global_step": "frozen"},
        ],
        slots={
            "gradient_accumulator": "gradient_accumulator",
            "gradient_squared_accumulator": "gradient_squared_accumulator",
        },
        random_config=lambda r: {
            "learning_rate": _uniform(r, 0.01, 1.0),
            "initial_gradient_squared_accumulator_value": _uniform(r, 0.01, 1.0),
            "l1_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.5)),
            "l2_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.5)),
        },
        make=_adagrad_da_make,
    ),
    Spec(
        gf.FtrlOptimizer,
        tf_reference(lambda t, c, gs: t.FtrlOptimizer(**c), ["accum", "linear"]),
        configs=[
            {"learning_rate": 0.1},
            {  # general (pow) path with beta folded into l2
                "learning_rate": 0.5,
                "learning_rate_power": -0.3,
                "initial_accumulator_value": 0.2,
                "l1_regularization_strength": 0.01,
                "l2_regularization_strength": 0.05,
                "beta": 0.7,
            },
            {  # V2 shrinkage on the sqrt path
                "learning_rate": 3.0,
                "l1_regularization_strength": 0.001,
                "l2_shrinkage_regularization_strength": 0.5,
            },
            {  # fixed-rate FTRL (n^0 = 1), V2, large l1 (many exact zeros)
                "learning_rate": 0.2,
                "learning_rate_power": 0.0,
                "l1_regularization_strength": 0.5,
                "l2_regularization_strength": 0.1,
                "l2_shrinkage_regularization_strength": 0.1,
                "beta": 0.1,
            },
            {  # accumulator starting at 0 (allowed by FTRL)
                "learning_rate": 0.3,
                "initial_accumulator_value": 0.0,
                "l1_regularization_strength": 0.2,
                "l2_regularization_strength": 0.3,
            },
        ],
        slots={"accum": "accum", "linear": "linear"},
        random_config=_ftrl_random,
        # Eigen's float32 pow (lr_power != -0.5) is not correctly rounded and torch's differs
        # by an ulp; "linear" cancels terms of ~10, so that ulp shows as ~4e-7 absolute.
        tolerance={"float32": (2e-6, 1e-6)},
    ),
    Spec(
        gf.ProximalAdagradOptimizer,
        tf_reference(lambda t, c, gs: t.ProximalAdagradOptimizer(**c), ["accumulator"]),
        configs=[
            {"learning_rate": 0.1},
            {
                "learning_rate": 0.5,
                "initial_accumulator_value": 0.05,
                "l1_regularization_strength": 0.05,
                "l2_regularization_strength": 0.1,
            },
        ],
        slots={"accumulator": "accumulator"},
        random_config=lambda r: {
            "learning_rate": _uniform(r, 0.01, 1.0),
            "initial_accumulator_value": _uniform(r, 0.01, 1.0),
            "l1_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.2)),
            "l2_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.5)),
        },
        dtypes=("float32",),  # TF refuses float64 vars here; tests/optimizers/test_tf_optimizers.py
    ),
    Spec(
        gf.ProximalGradientDescentOptimizer,
        tf_reference(lambda t, c, gs: t.ProximalGradientDescentOptimizer(**c), []),
        configs=[
            {"learning_rate": 0.1},
            {
                "learning_rate": 0.2,
                "l1_regularization_strength": 0.1,
                "l2_regularization_strength": 0.2,
            },
        ],
        slots={},
        random_config=lambda r: {
            "learning_rate": _uniform(r, 0.01, 1.0),
            "l1_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.5)),
            "l2_regularization_strength": _maybe(r, _uniform(r, 0.0, 0.5)),
        },
        dtypes=("float32",),  # TF refuses float64 vars here; tests/optimizers/test_tf_optimizers.py
    ),
    Spec(
        gf.RMSPropOptimizer,
        tf_reference(lambda t, c, gs: t.RMSPropOptimizer(**c), ["rms", "momentum"]),
        configs=[
            {"learning_rate": 0.01},
            {"learning_rate": 0.05, "decay": 0.8, "momentum": 0.5, "epsilon": 1e-6},
        ],
        slots={"rms": "rms", "momentum": "momentum"},
        random_config=_rmsprop_random(False),
    ),
    Spec(  # centered RMSProp has the extra "mg" slot, so it gets its own row
        gf.RMSPropOptimizer,
        tf_reference(lambda t, c, gs: t.RMSPropOptimizer(**c), ["rms", "mg", "momentum"]),
        configs=[
            {"learning_rate": 0.02, "centered": True},
            {
                "learning_rate": 0.1,
                "decay": 0.95,
                "momentum": 0.9,
                "epsilon": 1e-4,
                "centered": True,
            },
        ],
        slots={"rms": "rms", "mg": "mg", "momentum": "momentum"},
        random_config=_rmsprop_random(True),
        variant="centered",
    ),
]
