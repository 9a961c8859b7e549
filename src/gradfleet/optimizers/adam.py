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

from gradfleet import _hyper
from gradfleet.optimizer import Optimizer
from gradfleet.optimizers._beta_powers import (
    ADAM_HYPERPARAMETERS,
    ADAM_TORCH_NAMES,
    BetaPowers,
    bias_corrected_lr,
)


class AdamOptimizer(BetaPowers, Optimizer):
    """TF1 Adam.  ``AdamOptimizer(params, learning_rate=0.001, beta1=0.9, beta2=0.999,
    epsilon=1e-08, use_locking=False, name="Adam")``; every float may be a no-argument
    callable.  Slots ``m`` and ``v``; non-slot ``beta1_power``, ``beta2_power`` (float32).
    torch's names: ``lr``, ``betas=(beta1, beta2)`` (the param groups hold ``betas``), ``eps``;
    ``amsgrad=True`` and ``weight_decay`` are refused (see ``gradfleet._torch_names``).
    A ``beta1`` changed between steps (``OneCycleLR``) enters the next step and multiplies
    into ``beta1_power``, as TF's ``_finish`` does with the current ``beta1``.
    """

    hyperparameters = ADAM_HYPERPARAMETERS
    torch_names = ADAM_TORCH_NAMES
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
        defaults = dict(lr=learning_rate, betas=(beta1, beta2), epsilon=epsilon)
        super().__init__(params, defaults, name, use_locking, **options)

    def _apply_dense(self, p, g, slots, hp, shared):
        m, v = slots["m"], slots["v"]
        alpha = bias_corrected_lr(hp, shared, p.dtype).to(p.device)
        m.add_((g - m) * (1 - hp["beta1"]))
        v.add_((g * g - v) * (1 - hp["beta2"]))
        p.sub_((m * alpha) / (v.sqrt() + hp["epsilon"]))

    def _apply_sparse(self, p, idx, values, slots, hp, shared):
        m, v = slots["m"], slots["v"]
        lr_t = bias_corrected_lr(hp, shared, p.dtype).to(p.device)
        m.mul_(hp["beta1"]).index_add_(0, idx, values * (1 - hp["beta1"]))
        v.mul_(hp["beta2"]).index_add_(0, idx, (values * values) * (1 - hp["beta2"]))
        p.sub_(lr_t * m / (v.sqrt() + hp["epsilon"]))
