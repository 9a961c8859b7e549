"""Adagrad as in TF1's ``tf.compat.v1.train.AdagradOptimizer`` (no epsilon, unlike torch's).

Update rule (dense, TF's CPU kernel form)::

    acc += g * g
    w -= g * lr * rsqrt(acc)

Sparse (duplicates summed first): the same on the listed rows only; a rank-1 parameter
takes TF's scalar form ``w -= lr * g / sqrt(acc)``.  ``acc`` starts at
``initial_accumulator_value``, created directly in the parameter's dtype.
"""

from __future__ import annotations

from typing import Any

from gradfleet import _hyper
from gradfleet.optimizer import RowwiseOptimizer
from gradfleet.optimizers._rounding import rsqrt


class AdagradOptimizer(RowwiseOptimizer):
    """TF1 Adagrad.  ``AdagradOptimizer(params, learning_rate, initial_accumulator_value=0.1,
    use_locking=False, name="Adagrad")``; ``learning_rate`` may be a callable.
    Slot ``accumulator``.
    """

    hyperparameters = {"lr": _hyper.NON_NEGATIVE, "initial_accumulator_value": _hyper.POSITIVE}
    slots = {"accumulator": 0.1}

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        initial_accumulator_value: float = 0.1,
        use_locking: bool = False,
        name: str = "Adagrad",
        **options: Any,
    ) -> None:
        _hyper.check_type(
            type(self).__name__, "initial_accumulator_value", initial_accumulator_value
        )
        if initial_accumulator_value <= 0.0:
            raise ValueError(
                f"initial_accumulator_value must be positive: {initial_accumulator_value}"
            )
        defaults = dict(lr=learning_rate, initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, defaults, name, use_locking, **options)

    def _slot_fills(self, group):
        return {"accumulator": _hyper.as_float(group["initial_accumulator_value"])}

    def _rule(self, w, slots, g, hp, shared, sparse):
        acc = slots["accumulator"] + g * g
        if sparse and w.dim() == 1:
            return w - hp["lr"] * g / acc.sqrt(), {"accumulator": acc}
        return w - g * hp["lr"] * rsqrt(acc), {"accumulator": acc}
