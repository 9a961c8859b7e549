"""``ExponentialMovingAverage``: TF's ``tf.train.ExponentialMovingAverage`` for the
``variable_averages`` argument of :class:`~gradfleet.distributed.SyncReplicasOptimizer`.

``shadow := decay' * shadow + (1 - decay') * var`` with ``decay' = min(decay, (1 + n) / (10 + n))``
when ``use_num_updates`` (TF passes ``global_step`` as ``num_updates``; here the step after the
update).  Shadows start at the variable's value when first applied.  The chief (or each shard)
applies it after every update; read the shadows with ``averaged_variables()``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ExponentialMovingAverage"]


class ExponentialMovingAverage:
    """TF's ``ExponentialMovingAverage(decay, num_updates)`` (module docstring).

    Args:
        decay: in ``[0, 1]``.
        use_num_updates: TF's ``num_updates`` argument given (``global_step``): the decay is
            capped by ``(1 + n) / (10 + n)`` so early averages follow the variables closely.
    """

    def __init__(self, decay: float, use_num_updates: bool = False) -> None:
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"ExponentialMovingAverage: decay must be in [0, 1], got {decay!r}")
        self.decay, self.use_num_updates = float(decay), bool(use_num_updates)
        self.shadows: dict[int, torch.Tensor] = {}

    def apply(self, variables: dict[int, torch.Tensor], num_updates: int | None = None) -> None:
        """Move the shadow of every ``{index: variable}`` towards the variable."""
        decay = self.decay
        if self.use_num_updates and num_updates is not None:
            decay = min(decay, (1.0 + num_updates) / (10.0 + num_updates))
        with torch.no_grad():
            for i, v in variables.items():
                if i not in self.shadows:
                    self.shadows[i] = v.detach().clone()
                self.shadows[i].mul_(decay).add_(v.detach(), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, Any]:
        return {"shadows": {int(i): s.clone() for i, s in self.shadows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadows = {int(i): s.clone() for i, s in state["shadows"].items()}
