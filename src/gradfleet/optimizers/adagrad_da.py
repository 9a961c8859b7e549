"""AdagradDA (Adagrad dual averaging) as in TF1's ``tf.compat.v1.train.AdagradDAOptimizer``.

The parameter is recomputed from the accumulators each step (its previous value is
ignored), with ``T = global_step + 1`` read at apply time::

    ga += g;  gg += g * g
    w = lr * -1 * sign(ga) * max(|ga| - T*l1, 0) / (l2 * (T*lr) + sqrt(gg))    (l1 > 0)
    w = lr * -1 * ga / (l2 * (T*lr) + sqrt(gg))                                (l1 = 0)

Sparse (duplicates summed first; listed rows only, so untouched rows keep their old ``w``
until touched again): TF's rescaled form ``w = -sign(ga) * max(|ga|/T - l1, 0) / (l2 +
sqrt(gg)/(T*lr))`` (or ``-(ga/T) / (...)``); a rank-1 parameter uses the dense form computed
in float64, as TF's scalar kernel does.

``global_step``: TF requires the user's int64 step variable.  Here it is optional: without
it the optimizer counts its own applied steps (non-slot ``step`` per group, advanced after
every step in which any parameter had a gradient), which is what TF sees when the same
``global_step`` is passed to ``apply_gradients``.
"""

from __future__ import annotations

from typing import Any

import torch

from gradfleet import _hyper
from gradfleet.optimizer import RowwiseOptimizer, _check_global_step

_INIT = "initial_gradient_squared_accumulator_value"
_L1, _L2 = "l1_regularization_strength", "l2_regularization_strength"


class AdagradDAOptimizer(RowwiseOptimizer):
    """TF1 AdagradDA.  ``AdagradDAOptimizer(params, learning_rate, global_step=None,
    initial_gradient_squared_accumulator_value=0.1, l1_regularization_strength=0.0,
    l2_regularization_strength=0.0, use_locking=False, name="AdagradDA")``.  Slots
    ``gradient_accumulator`` and ``gradient_squared_accumulator``.  ``global_step``, if
    given, is a 0-dim int64 tensor that the caller advances (e.g. through
    ``apply_gradients(..., global_step=global_step)``).
    """

    hyperparameters = {
        "lr": _hyper.NON_NEGATIVE,
        _INIT: _hyper.POSITIVE,
        _L1: _hyper.NON_NEGATIVE,
        _L2: _hyper.NON_NEGATIVE,
    }
    slots = {"gradient_accumulator": 0.0, "gradient_squared_accumulator": 0.1}

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        global_step: torch.Tensor | None = None,
        initial_gradient_squared_accumulator_value: float = 0.1,
        l1_regularization_strength: _hyper.Hyper = 0.0,
        l2_regularization_strength: _hyper.Hyper = 0.0,
        use_locking: bool = False,
        name: str = "AdagradDA",
        **options: Any,
    ) -> None:
        _hyper.check_type(type(self).__name__, _INIT, initial_gradient_squared_accumulator_value)
        if initial_gradient_squared_accumulator_value <= 0.0:
            raise ValueError(
                f"{_INIT} must be positive: {initial_gradient_squared_accumulator_value}"
            )
        _check_global_step(global_step)
        self._global_step = global_step
        defaults = {
            "lr": learning_rate,
            _INIT: initial_gradient_squared_accumulator_value,
            _L1: l1_regularization_strength,
            _L2: l2_regularization_strength,
        }
        super().__init__(params, defaults, name, use_locking, **options)

    def _slot_fills(self, group):
        initial = _hyper.as_float(group[_INIT])
        return {"gradient_accumulator": 0.0, "gradient_squared_accumulator": initial}

    def _init_shared(self, group):
        if self._global_step is not None:
            return {}
        device = group["params"][0].device if group["params"] else None
        return {"step": torch.zeros((), dtype=torch.int64, device=device)}

    def _shared_state(self, group):
        if self._global_step is None:
            return group["non_slot"]
        return {"global_step": self._global_step}  # an input of the fused kernel, not baked in

    def _finish(self, group, shared, hp_for):
        shared["step"] += 1

    @staticmethod
    def _t(shared, like: torch.Tensor) -> torch.Tensor:
        """T = step + 1 as a 0-dim tensor like ``like`` (no host sync; traceable)."""
        step = shared["global_step"] if "global_step" in shared else shared["step"]
        return (step + 1).to(device=like.device, dtype=like.dtype)

    # TF branches on l1 > 0; with l1 = 0 the shrinking forms below give the same bits
    # (sign(x) * max(|x| - 0, 0) == x), so one branch-free form serves both.
    def _rule(self, w, slots, g, hp, shared, sparse):
        ga = slots["gradient_accumulator"] + g
        gg = slots["gradient_squared_accumulator"] + g * g
        new = {"gradient_accumulator": ga, "gradient_squared_accumulator": gg}
        lr, l1, l2 = hp["lr"], hp[_L1], hp[_L2]
        t = self._t(shared, lr)
        if sparse and w.dim() == 1:  # TF's scalar kernel computes in double
            args = (t, lr, l1, l2)
            w_new = _closed_form(ga.double(), gg.double(), *(x.double() for x in args))
            return w_new.to(w.dtype), new
        if sparse:
            denom = l2 + gg.sqrt() / (t * lr)
            return -ga.sign() * (ga.abs() / t - l1).clamp_min(0) / denom, new
        return _closed_form(ga, gg, t, lr, l1, l2), new


def _closed_form(ga, gg, t, lr, l1, l2):
    """TF's dense form of the dual-averaging solution for step ``t``."""
    denom = l2 * (t * lr) + gg.sqrt()
    return lr * -1 * ga.sign() * (ga.abs() - t * l1).clamp_min(0) / denom
