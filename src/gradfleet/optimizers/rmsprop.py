"""RMSProp as in TF1's ``tf.compat.v1.train.RMSPropOptimizer``.

``ms`` (slot "rms") starts at ONE, epsilon sits inside the root and ``lr`` inside the
momentum buffer, which is always used (also for momentum 0).  Dense (TF's kernel form)::

    ms += (g*g - ms) * (1 - decay)
    mg += (g - mg) * (1 - decay)                                        (centered only)
    mom = mom * momentum + (g * lr) / sqrt(ms + eps)                    (not centered)
    mom = mom * momentum + (g * lr) / sqrt((ms - mg^2) + eps)           (centered)
    w -= mom

Sparse (duplicates summed first; listed rows only, other rows neither decay nor move)::

    ms = ms * decay + g^2 * (1 - decay);  mg = mg * decay + g * (1 - decay)
    denom = ms + eps  (or  ms + eps - mg^2  when centered)
    mom = mom * momentum + rsqrt(denom) * lr * g;  w -= mom
"""

from __future__ import annotations

from typing import Any

from gradfleet import _hyper
from gradfleet.optimizer import RowwiseOptimizer
from gradfleet.optimizers._rounding import rsqrt


class RMSPropOptimizer(RowwiseOptimizer):
    """TF1 RMSProp.  ``RMSPropOptimizer(params, learning_rate, decay=0.9, momentum=0.0,
    epsilon=1e-10, use_locking=False, centered=False, name="RMSProp")``; every float may be
    a callable.  Slots ``rms`` (ones), ``momentum`` and, for centered groups, ``mg``.
    """

    hyperparameters = {
        "lr": _hyper.NON_NEGATIVE,
        "decay": _hyper.UNIT,
        "momentum": _hyper.NON_NEGATIVE,
        "epsilon": _hyper.NON_NEGATIVE,
    }
    torch_names = {"alpha": "decay", "eps": "epsilon"}
    slots = {"rms": 1.0, "mg": 0.0, "momentum": 0.0}
    flags = ("centered",)

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        decay: _hyper.Hyper = 0.9,
        momentum: _hyper.Hyper = 0.0,
        epsilon: _hyper.Hyper = 1e-10,
        use_locking: bool = False,
        centered: bool = False,
        name: str = "RMSProp",
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=learning_rate,
            decay=decay,
            momentum=momentum,
            epsilon=epsilon,
            centered=centered,
        )
        super().__init__(params, defaults, name, use_locking, **options)

    def _slot_fills(self, group):
        if group["centered"]:
            return self.slots
        return {"rms": 1.0, "momentum": 0.0}

    def _rule(self, w, slots, g, hp, shared, sparse):
        decay, eps, centered = hp["decay"], hp["epsilon"], hp["centered"]
        new = {}
        if sparse:
            new["rms"] = ms = slots["rms"] * decay + g * g * (1 - decay)
            denom = ms + eps
            if centered:
                new["mg"] = mg = slots["mg"] * decay + g * (1 - decay)
                denom = denom - mg * mg
            step = rsqrt(denom) * hp["lr"] * g
        else:
            new["rms"] = ms = slots["rms"] + (g * g - slots["rms"]) * (1 - decay)
            if centered:
                new["mg"] = mg = slots["mg"] + (g - slots["mg"]) * (1 - decay)
                ms = ms - mg * mg
            step = (g * hp["lr"]) / (ms + eps).sqrt()
        new["momentum"] = mom = slots["momentum"] * hp["momentum"] + step
        return w - mom, new
