"""Plain gradient descent as in TF1's ``GradientDescentOptimizer``.

Update rule: ``w -= g * lr``.  Sparse: ``w[idx] -= values * lr`` per occurrence; duplicate
rows add up (TF's ``scatter_sub`` without de-duplication, which equals summing them).
"""

from __future__ import annotations

from typing import Any

from gradfleet import _hyper
from gradfleet.optimizer import Optimizer


class GradientDescentOptimizer(Optimizer):
    """TF1 GradientDescent.  ``GradientDescentOptimizer(params, learning_rate,
    use_locking=False, name="GradientDescent")``; ``learning_rate`` may be a callable.
    """

    sparse = "raw"

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        use_locking: bool = False,
        name: str = "GradientDescent",
        **options: Any,
    ) -> None:
        super().__init__(params, dict(lr=learning_rate), name, use_locking, **options)

    def _apply_dense(self, p, g, slots, hp, shared):
        p.sub_(g * hp["lr"])

    def _apply_sparse(self, p, idx, values, slots, hp, shared):
        p.index_add_(0, idx, values * hp["lr"], alpha=-1)
