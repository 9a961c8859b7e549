"""Apply gradients with any optimizer: the one place that knows both kinds.

gradfleet optimizers take ``apply_gradients(pairs)`` (TF's call, no ``.grad`` involved); a plain
``torch.optim`` optimizer only reads ``.grad`` in ``step()``.  :func:`apply_gradients` picks the
right call, so the wrappers, the SyncReplicas chief and shards and the lock-step all-reduce path
apply averaged gradients the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GradsAndVars", "apply_gradients", "apply_with_step"]

GradsAndVars = list[tuple[torch.Tensor | None, torch.Tensor]]


def apply_gradients(
    opt: torch.optim.Optimizer,
    pairs: Sequence[tuple[Any, torch.Tensor]],
    global_step: torch.Tensor | None = None,
) -> None:
    """One update of ``opt`` with ``pairs`` (``[(gradient or None, parameter)]``): its own
    ``apply_gradients`` when it has one (gradfleet optimizers), else :func:`apply_with_step`.
    ``global_step`` (a 0-dim int tensor) advances by one, as TF's ``apply_gradients`` does."""
    own = getattr(opt, "apply_gradients", None)
    if own is not None:
        if global_step is None:
            own(list(pairs))
        else:
            own(list(pairs), global_step=global_step)
        return
    apply_with_step(opt, list(pairs))
    if global_step is not None:
        with torch.no_grad():
            global_step.add_(1)


def apply_with_step(opt: torch.optim.Optimizer, pairs: GradsAndVars) -> None:
    """Apply ``pairs`` with a plain torch optimizer: install them as ``.grad`` (others None),
    ``opt.step()``, then restore every ``.grad`` as it was."""
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [p.grad for p in params]
    given = {id(v): g for g, v in pairs}
    known = {id(p) for p in params}
    for _, v in pairs:
        if id(v) not in known:
            raise ValueError(
                f"apply_gradients: a variable of shape {tuple(v.shape)} is not managed by the "
                "wrapped optimizer"
            )
    try:
        for p in params:
            g = given.get(id(p))
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)
        opt.step()
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
