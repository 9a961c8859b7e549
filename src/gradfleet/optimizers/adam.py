"""Adam as in TF1's ``tf.compat.v1.train.AdamOptimizer`` (Kingma & Ba, with "epsilon hat").

Update rule (dense, TF's CPU kernel form), with ``b1p = beta1^t`` and ``b2p = beta2^t``
accumulated as float32 by repeated multiplication and shared by every parameter::

    alpha = lr * sqrt(1 - b2p) / (1 - b1p)
    m += (g - m) * (1 - beta1)
    v += (g*g - v) * (1 - beta2)
    w -= (m * alpha) / (sqrt(v) + epsilon)

Sparse (duplicates summed first): ``m`` and ``v`` decay on ALL rows, the gradient rows are
added, and ``w`` moves on ALL rows, exactly like dense Adam with zero-gradient rows.
"""

from __future__ import annotations

from typing import Any

import torch

from gradfleet import _hyper
from gradfleet.optimizer import Optimizer


class AdamOptimizer(Optimizer):
    """TF1 Adam.  ``AdamOptimizer(params, learning_rate=0.001, beta1=0.9, beta2=0.999,
    epsilon=1e-08, use_locking=False, name="Adam")``; every float may be a no-argument
    callable.  Slots ``m`` and ``v``; non-slot ``beta1_power``, ``beta2_power`` (float32).
    """

    hyperparameters = {
        "lr": _hyper.NON_NEGATIVE,
        "beta1": _hyper.UNIT_OPEN_RIGHT,
        "beta2": _hyper.UNIT_OPEN_RIGHT,
        "epsilon": _hyper.NON_NEGATIVE,
    }
    slots = {"m": 0.0, "v": 0.0}

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper = 0.001,
        beta1: _hyper.Hyper = 0.9,
        beta2: _hyper.Hyper = 0.999,
        epsilon: _hyper.Hyper = 1e-8,
        use_locking: bool = False,
        name: str = "Adam",
        **options: Any,
    ) -> None:
        defaults = dict(lr=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon)
        super().__init__(params, defaults, name, use_locking, **options)

    def _init_shared(self, group):
        device = group["params"][0].device if group["params"] else None
        return {
            "beta1_power": _hyper.scalar(group["beta1"], torch.float32, device).clone(),
            "beta2_power": _hyper.scalar(group["beta2"], torch.float32, device).clone(),
        }

    def _finish(self, group, shared, hp_for):
        hp = hp_for(torch.float32, shared["beta1_power"].device)
        shared["beta1_power"].mul_(hp["beta1"])
        shared["beta2_power"].mul_(hp["beta2"])

    @staticmethod
    def _alpha(hp, shared, dtype):
        b1p = shared["beta1_power"].to(dtype)
        b2p = shared["beta2_power"].to(dtype)
        return hp["lr"] * torch.sqrt(1 - b2p) / (1 - b1p)

    def _apply_dense(self, p, g, slots, hp, shared):
        m, v = slots["m"], slots["v"]
        alpha = self._alpha(hp, shared, p.dtype).to(p.device)
        m.add_((g - m) * (1 - hp["beta1"]))
        v.add_((g * g - v) * (1 - hp["beta2"]))
        p.sub_((m * alpha) / (v.sqrt() + hp["epsilon"]))

    def _apply_sparse(self, p, idx, values, slots, hp, shared):
        m, v = slots["m"], slots["v"]
        lr_t = self._alpha(hp, shared, p.dtype).to(p.device)
        m.mul_(hp["beta1"]).index_add_(0, idx, values * (1 - hp["beta1"]))
        v.mul_(hp["beta2"]).index_add_(0, idx, (values * values) * (1 - hp["beta2"]))
        p.sub_(lr_t * m / (v.sqrt() + hp["epsilon"]))
