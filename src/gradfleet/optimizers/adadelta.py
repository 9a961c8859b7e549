"""Adadelta as in TF1's ``tf.compat.v1.train.AdadeltaOptimizer`` (Zeiler 2012).

Update rule (TF's kernel form, the same dense and on the listed rows of a sparse gradient),
with epsilon inside BOTH roots and the step size ``update`` stored without ``lr``::

    accum = accum * rho + g^2 * (1 - rho)
    update = sqrt(accum_update + epsilon) * rsqrt(accum + epsilon) * g
    w -= update * lr
    accum_update = accum_update * rho + update^2 * (1 - rho)

Sparse (duplicates summed first): rows not listed keep ``w`` and both slots unchanged.
"""

from __future__ import annotations

from typing import Any

from gradfleet import _hyper
from gradfleet.optimizer import RowwiseOptimizer
from gradfleet.optimizers._rounding import rsqrt


class AdadeltaOptimizer(RowwiseOptimizer):
    """TF1 Adadelta.  ``AdadeltaOptimizer(params, learning_rate=0.001, rho=0.95,
    epsilon=1e-08, use_locking=False, name="Adadelta")``; every float may be a no-argument
    callable.  Slots ``accum`` and ``accum_update``.
    """

    hyperparameters = {
        "lr": _hyper.NON_NEGATIVE,
        "rho": _hyper.UNIT,
        "epsilon": _hyper.NON_NEGATIVE,
    }
    torch_names = {"eps": "epsilon"}
    slots = {"accum": 0.0, "accum_update": 0.0}

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper = 0.001,
        rho: _hyper.Hyper = 0.95,
        epsilon: _hyper.Hyper = 1e-8,
        use_locking: bool = False,
        name: str = "Adadelta",
        **options: Any,
    ) -> None:
        defaults = dict(lr=learning_rate, rho=rho, epsilon=epsilon)
        super().__init__(params, defaults, name, use_locking, **options)

    def _rule(self, w, slots, g, hp, shared, sparse):
        rho, eps = hp["rho"], hp["epsilon"]
        accum = slots["accum"] * rho + g * g * (1 - rho)
        update = (slots["accum_update"] + eps).sqrt() * rsqrt(accum + eps) * g
        accum_update = slots["accum_update"] * rho + update * update * (1 - rho)
        return w - update * hp["lr"], {"accum": accum, "accum_update": accum_update}
