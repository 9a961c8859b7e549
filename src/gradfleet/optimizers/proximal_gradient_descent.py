"""ProximalGradientDescent (FOBOS) as in TF1's ``ProximalGradientDescentOptimizer``.

Update rule (dense, and on the listed rows of a sparse gradient)::

    prox = w - g * lr
    w = sign(prox) * max(|prox| - lr * l1, 0) / (1 + l2 * lr)     (l1 > 0)
    w = prox / (1 + l2 * lr)                   (l1 = 0; the same bits as the line above)

Sparse: duplicates summed first (the shrinkage is not linear); rows not listed are
unchanged.  TF rejects float64 variables here; gradfleet accepts them with the same
float32-rounded hyperparameters every other optimizer uses.
"""

from __future__ import annotations

from typing import Any

from gradfleet import _hyper
from gradfleet.optimizer import RowwiseOptimizer
from gradfleet.optimizers.proximal_adagrad import proximal_step

_L1, _L2 = "l1_regularization_strength", "l2_regularization_strength"


class ProximalGradientDescentOptimizer(RowwiseOptimizer):
    """TF1 ProximalGradientDescent.  ``ProximalGradientDescentOptimizer(params,
    learning_rate, l1_regularization_strength=0.0, l2_regularization_strength=0.0,
    use_locking=False, name="ProximalGradientDescent")``.  No slots.  l1, l2 >= 0 are
    checked (TF accepts negative values silently).
    """

    hyperparameters = {
        "lr": _hyper.NON_NEGATIVE,
        _L1: _hyper.NON_NEGATIVE,
        _L2: _hyper.NON_NEGATIVE,
    }

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        l1_regularization_strength: _hyper.Hyper = 0.0,
        l2_regularization_strength: _hyper.Hyper = 0.0,
        use_locking: bool = False,
        name: str = "ProximalGradientDescent",
        **options: Any,
    ) -> None:
        defaults = {
            "lr": learning_rate,
            _L1: l1_regularization_strength,
            _L2: l2_regularization_strength,
        }
        super().__init__(params, defaults, name, use_locking, **options)

    def _rule(self, w, slots, g, hp, shared, sparse):
        return proximal_step(w, g, hp["lr"], hp[_L1], hp[_L2]), {}
