"""RETURNN's ``CustomAdamOptimizer``: Adam on ``BaseCustomOptimizer``; sparse is LAZY Adam.

Update rule, with ``b1p = beta1^t`` and ``b2p = beta2^t`` accumulated as float32 by repeated
multiplication, shared by every parameter and advanced after all updates of a step::

    lr_t = lr * sqrt(1 - b2p) / (1 - b1p)
    m[idx] = beta1 * m[idx] + (1 - beta1) * g
    v[idx] = beta2 * v[idx] + (1 - beta2) * g * g
    w[idx] -= lr_t * m[idx] / (sqrt(v[idx]) + epsilon)

Dense (``idx`` = everything) equals TF's Adam.  Sparse (spec 13.6): rows not listed keep
their ``m``, ``v`` and ``w``, but the bias correction uses the global step count.  With
duplicate indices ``m``/``v`` keep the LAST occurrence's value (``scatter_update``) and ``w``
takes one step per occurrence, each with the final ``m``, ``v``.
"""

from __future__ import annotations

from typing import Any

import torch

from gradfleet import _hyper
from gradfleet.optimizers._beta_powers import (
    ADAM_HYPERPARAMETERS,
    ADAM_TORCH_NAMES,
    BetaPowers,
    bias_corrected_lr,
)
from gradfleet.optimizers.base_custom import BaseCustomOptimizer


class CustomAdamOptimizer(BetaPowers, BaseCustomOptimizer):
    """RETURNN's ``CustomAdamOptimizer(beta1=0.9, beta2=0.999, epsilon=1e-8, **kwargs)``
    (RETURNN's config injects epsilon 1e-16): ``CustomAdamOptimizer(params, learning_rate,
    beta1=0.9, beta2=0.999, epsilon=1e-8, use_locking=False, name=None, **options)``.
    Slots ``m``, ``v``; non-slot float32 ``beta1_power``, ``beta2_power``.  Unlike RETURNN
    (dtype error) float64 parameters work: the powers are cast to the parameter dtype.
    """

    hyperparameters = ADAM_HYPERPARAMETERS
    torch_names = ADAM_TORCH_NAMES
    slots = {"m": 0.0, "v": 0.0}

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        beta1: _hyper.Hyper = 0.9,
        beta2: _hyper.Hyper = 0.999,
        epsilon: _hyper.Hyper = 1e-8,
        use_locking: bool = False,
        name: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(
            params,
            learning_rate,
            use_locking,
            name,
            betas=(beta1, beta2),
            epsilon=epsilon,
            **options,
        )

    def _apply_var(self, grad, var, indices=None):
        hp = self._hp
        b1, b2 = hp["beta1"], hp["beta2"]
        lr_t = bias_corrected_lr(hp, self._shared, var.dtype)
        m, v = self._get_slot(var, "m"), self._get_slot(var, "v")
        self._assign(m, b1 * self._gather(m, indices) + (1 - b1) * grad, indices)
        self._assign(v, b2 * self._gather(v, indices) + (1 - b2) * (grad * grad), indices)
        m_g, v_g = self._gather(m, indices), self._gather(v, indices)
        self._assign_sub(var, lr_t * m_g / (torch.sqrt(v_g) + hp["epsilon"]), indices)
