"""Adam's non-slot state, shared by AdamOptimizer and RETURNN's CustomAdamOptimizer.

TF keeps one float32 ``beta1_power``/``beta2_power`` pair per optimizer, created with the
values ``beta1``/``beta2`` and multiplied by them once per step after every variable was
updated (``_finish``).  gradfleet keeps the pair per param group (identical to TF's single
pair when the groups share betas) and advances every group whenever any parameter had a
gradient, as TF does.
"""

from __future__ import annotations

import torch

from gradfleet import _hyper

ADAM_HYPERPARAMETERS = {
    "lr": _hyper.NON_NEGATIVE,
    "beta1": _hyper.UNIT_OPEN_RIGHT,
    "beta2": _hyper.UNIT_OPEN_RIGHT,
    "epsilon": _hyper.NON_NEGATIVE,
}
#: torch's names: Adam's ``betas`` (stored in the param groups as this tuple, which torch's
#: momentum-cycling schedulers edit) and ``eps``.
ADAM_TORCH_NAMES = {"betas": ("beta1", "beta2"), "eps": "epsilon"}


class BetaPowers:
    """Mixin for an Optimizer subclass: float32 beta powers in ``group["non_slot"]``."""

    def _init_shared(self, group):
        device = group["params"][0].device if group["params"] else None
        beta1, beta2 = group["betas"]
        return {
            "beta1_power": _hyper.scalar(beta1, torch.float32, device).clone(),
            "beta2_power": _hyper.scalar(beta2, torch.float32, device).clone(),
        }

    def _finish(self, group, shared, hp_for):
        hp = hp_for(torch.float32, shared["beta1_power"].device)
        shared["beta1_power"].mul_(hp["beta1"])
        shared["beta2_power"].mul_(hp["beta2"])


def bias_corrected_lr(hp, shared, dtype: torch.dtype) -> torch.Tensor:
    """``lr * sqrt(1 - beta2_power) / (1 - beta1_power)`` in ``dtype`` (TF's alpha / lr_t)."""
    b1p = shared["beta1_power"].to(dtype)
    b2p = shared["beta2_power"].to(dtype)
    return hp["lr"] * torch.sqrt(1 - b2p) / (1 - b1p)
