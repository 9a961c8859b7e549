"""RETURNN's ``CustomGradientDescentOptimizer``: plain SGD written on ``BaseCustomOptimizer``.

Update rule: ``w -= lr * g``.  Sparse: ``scatter_sub(w, idx, lr * g)`` once per occurrence,
so duplicate rows add up (no de-duplication, spec 13.2).
"""

from __future__ import annotations

from gradfleet.optimizers.base_custom import BaseCustomOptimizer


class CustomGradientDescentOptimizer(BaseCustomOptimizer):
    """RETURNN's ``CustomGradientDescentOptimizer(learning_rate, use_locking=False,
    name=None)``: ``CustomGradientDescentOptimizer(params, learning_rate, use_locking=False,
    name=None, **options)``; ``name=None`` means the class name.  No slots.
    """

    def _apply_var(self, grad, var, indices=None):
        self._assign_sub(var, self._hp["lr"] * grad, indices)
