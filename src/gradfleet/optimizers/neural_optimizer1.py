"""RETURNN's ``NeuralOptimizer1``: the ``g * exp(sign(g) * sign(m))`` family of Bello et al.
(2017), as SGD whose step shrinks by ``decrease_factor`` where ``g`` disagrees with ``m``.

Update rule, in order::

    m = m * beta1                          # ALL rows, also when sparse
    m += g * (1 - beta1)                   # listed rows when sparse, once per occurrence
    m_g = m[idx]                           # the NEW m
    w -= lr * g * where(sign(m_g) == sign(g), 1, decrease_factor)

Sparse: ``m`` decays everywhere, ``w`` moves only on listed rows; duplicates are not summed
(spec 13.4).  ``decrease_factor`` is not rounded through float32 (RETURNN uses it as a Python
float); ``lr`` and ``beta1`` are, as RETURNN converts them to tensors first.
"""

from __future__ import annotations

from typing import Any

import torch

from gradfleet import _hyper
from gradfleet.optimizers.base_custom import BaseCustomOptimizer


class NeuralOptimizer1(BaseCustomOptimizer):
    """RETURNN's ``NeuralOptimizer1(beta1=0.9, decrease_factor=0.1, **kwargs)`` with
    ``kwargs`` = BaseCustom's ``learning_rate, use_locking, name``:
    ``NeuralOptimizer1(params, learning_rate, beta1=0.9, decrease_factor=0.1,
    use_locking=False, name=None, **options)``.  Slot ``m``.
    """

    hyperparameters = {
        "lr": _hyper.NON_NEGATIVE,
        "beta1": _hyper.UNIT_OPEN_RIGHT,
        "decrease_factor": _hyper.NON_NEGATIVE,
    }
    slots = {"m": 0.0}
    # A one-element ``betas``: torch's momentum-cycling schedulers edit betas[0].
    torch_names = {"betas": ("beta1",)}
    # RETURNN multiplies the Python float into a tensor of the variable's dtype
    # (``ones * decrease_factor``): float64 variables see the double, not float32(df).
    unrounded = ("decrease_factor",)

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        beta1: _hyper.Hyper = 0.9,
        decrease_factor: _hyper.Hyper = 0.1,
        use_locking: bool = False,
        name: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(
            params,
            learning_rate,
            use_locking,
            name,
            betas=(beta1,),
            decrease_factor=decrease_factor,
            **options,
        )

    def _apply_var(self, grad, var, indices=None):
        hp = self._hp
        m = self._get_slot(var, "m")
        m.mul_(hp["beta1"])
        self._assign_add(m, grad * (1 - hp["beta1"]), indices)
        agree = torch.sign(self._gather(m, indices)) == torch.sign(grad)
        factor = torch.where(agree, torch.ones_like(grad), hp["decrease_factor"])
        self._assign_sub(var, hp["lr"] * grad * factor, indices)
