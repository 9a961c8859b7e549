"""ProximalAdagrad (FOBOS with an Adagrad rate) as in TF1's ``ProximalAdagradOptimizer``.

Update rule (dense, and on the listed rows of a sparse gradient)::

    acc += g * g
    lr_t = lr * rsqrt(acc)                   (rank-1 sparse: lr / sqrt(acc))
    prox = w - g * lr_t
    w = sign(prox) * max(|prox| - lr_t * l1, 0) / (1 + l2 * lr_t)     (l1 > 0)
    w = prox / (1 + l2 * lr_t)                 (l1 = 0; the same bits as the line above)

Sparse: duplicates summed first; rows not listed are unchanged.  TF rejects float64
variables here (its dense op is not given cast hyperparameters); gradfleet accepts them with
the same float32-rounded hyperparameters every other optimizer uses.
"""

from __future__ import annotations

from typing import Any

from gradfleet import _hyper
from gradfleet.optimizer import RowwiseOptimizer
from gradfleet.optimizers._rounding import rsqrt

_L1, _L2 = "l1_regularization_strength", "l2_regularization_strength"


class ProximalAdagradOptimizer(RowwiseOptimizer):
    """TF1 ProximalAdagrad.  ``ProximalAdagradOptimizer(params, learning_rate,
    initial_accumulator_value=0.1, l1_regularization_strength=0.0,
    l2_regularization_strength=0.0, use_locking=False, name="ProximalAdagrad")``.  Slot
    ``accumulator``.  ``learning_rate`` >= 0 and l1, l2 >= 0 are checked at construction
    and each step.  TF's CPU kernels refuse ``learning_rate`` 0; the maths has a limit there
    (``lr_t = 0``: the proximal step is the identity and only the accumulator grows), which
    gradfleet computes, so a warmup from 0 works.
    """

    hyperparameters = {
        "lr": _hyper.NON_NEGATIVE,
        "initial_accumulator_value": _hyper.POSITIVE,
        _L1: _hyper.NON_NEGATIVE,
        _L2: _hyper.NON_NEGATIVE,
    }
    slots = {"accumulator": 0.1}

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: _hyper.Hyper = 0.0,
        l2_regularization_strength: _hyper.Hyper = 0.0,
        use_locking: bool = False,
        name: str = "ProximalAdagrad",
        **options: Any,
    ) -> None:
        _hyper.check_type(
            type(self).__name__, "initial_accumulator_value", initial_accumulator_value
        )
        if initial_accumulator_value <= 0.0:
            raise ValueError(
                f"initial_accumulator_value must be positive: {initial_accumulator_value}"
            )
        defaults = {
            "lr": learning_rate,
            "initial_accumulator_value": initial_accumulator_value,
            _L1: l1_regularization_strength,
            _L2: l2_regularization_strength,
        }
        super().__init__(params, defaults, name, use_locking, **options)

    def _slot_fills(self, group):
        return {"accumulator": _hyper.as_float(group["initial_accumulator_value"])}

    def _rule(self, w, slots, g, hp, shared, sparse):
        acc = slots["accumulator"] + g * g
        lr_t = hp["lr"] / acc.sqrt() if sparse and w.dim() == 1 else hp["lr"] * rsqrt(acc)
        return proximal_step(w, g, lr_t, hp[_L1], hp[_L2]), {"accumulator": acc}


def proximal_step(w, g, lr_t, l1, l2):
    """A gradient step of size ``lr_t`` followed by TF's l1/l2 proximal shrinkage.

    TF branches on ``l1 > 0``; with l1 = 0 the shrinking form gives the same bits
    (``sign(x) * max(|x| - 0, 0) == x``), so one branch-free form serves both and the rule
    stays traceable for the fused path.
    """
    prox = w - g * lr_t
    return prox.sign() * (prox.abs() - lr_t * l1).clamp_min(0) / (1 + l2 * lr_t)
