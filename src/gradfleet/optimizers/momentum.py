"""Momentum as in TF1's ``MomentumOptimizer`` (the accumulator is learning-rate free).

Update rule::

    a = a * momentum + g
    w -= a * lr                                  (use_nesterov=False)
    w -= g * lr + a * momentum * lr              (use_nesterov=True, with the new a)

Sparse (duplicates summed first): the same on the listed rows only; other rows' ``a`` does
not decay and their ``w`` does not move.
"""

from __future__ import annotations

from typing import Any

from gradfleet import _hyper
from gradfleet.optimizer import RowwiseOptimizer


class MomentumOptimizer(RowwiseOptimizer):
    """TF1 Momentum.  ``MomentumOptimizer(params, learning_rate, momentum, use_locking=False,
    name="Momentum", use_nesterov=False)``; ``learning_rate`` and ``momentum`` may be
    callables.  Slot ``momentum``.
    """

    hyperparameters = {"lr": _hyper.NON_NEGATIVE, "momentum": _hyper.NON_NEGATIVE}
    torch_names = {"nesterov": "use_nesterov"}
    slots = {"momentum": 0.0}
    flags = ("use_nesterov",)

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        momentum: _hyper.Hyper,
        use_locking: bool = False,
        name: str = "Momentum",
        use_nesterov: bool = False,
        **options: Any,
    ) -> None:
        defaults = dict(lr=learning_rate, momentum=momentum, use_nesterov=use_nesterov)
        super().__init__(params, defaults, name, use_locking, **options)

    def _rule(self, w, slots, g, hp, shared, sparse):
        lr, mu = hp["lr"], hp["momentum"]
        a = slots["momentum"] * mu + g
        if hp["use_nesterov"]:
            return w - (g * lr + a * mu * lr), {"momentum": a}
        return w - a * lr, {"momentum": a}
