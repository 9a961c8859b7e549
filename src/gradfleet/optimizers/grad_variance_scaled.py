"""RETURNN's ``GradVarianceScaledOptimizer``: SGD whose step is scaled down where the
gradient's deviation from its running mean is large compared with its running variance.

Update rule, in order::

    m = m * beta1;  m += g * (1 - beta1);  m_g = m[idx]          # decay on ALL rows
    var_g = (g - m_g)^2                                           # with the NEW m
    v = v * beta2;  v += var_g * (1 - beta2);  v_g = v[idx]       # decay on ALL rows
    w -= lr * g * min(v_g / (var_g + epsilon), 1)

Sparse: ``m`` and ``v`` decay everywhere, the additions and ``w`` touch only the listed rows,
once per occurrence (duplicates are not summed; spec 13.5).
"""

from __future__ import annotations

from typing import Any

import torch

from gradfleet import _hyper
from gradfleet.optimizers._beta_powers import ADAM_HYPERPARAMETERS, ADAM_TORCH_NAMES
from gradfleet.optimizers.base_custom import BaseCustomOptimizer


class GradVarianceScaledOptimizer(BaseCustomOptimizer):
    """RETURNN's ``GradVarianceScaledOptimizer(beta1=0.9, beta2=0.999, epsilon=1e-8,
    **kwargs)`` (RETURNN's config injects epsilon 1e-16):
    ``GradVarianceScaledOptimizer(params, learning_rate, beta1=0.9, beta2=0.999,
    epsilon=1e-8, use_locking=False, name=None, **options)``.  Slots ``m`` and ``v``.
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
        m, v = self._get_slot(var, "m"), self._get_slot(var, "v")
        m.mul_(hp["beta1"])
        self._assign_add(m, grad * (1 - hp["beta1"]), indices)
        diff = grad - self._gather(m, indices)
        grad_var = diff * diff
        v.mul_(hp["beta2"])
        self._assign_add(v, grad_var * (1 - hp["beta2"]), indices)
        factor = self._gather(v, indices) / (grad_var + hp["epsilon"])
        scale = torch.clamp_max(factor, 1.0)
        self._assign_sub(var, hp["lr"] * grad * scale, indices)
