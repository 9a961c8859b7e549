"""How ``SyncReplicasOptimizer`` sees its parameters shard by shard (a mixin, like
:mod:`.queries`): the pieces of ``shard_assignment="split"`` / ``"backward_order"``, and each
shard's values and gradients as views of the worker's own tensors.

A shard is a list of piece numbers (``_parts[k]``); a piece is a whole parameter or a block of
its rows (:mod:`.pieces`).  Views, not copies: a shard's values are received in place into the
parameters, and its gradients are views of ``.grad``, read when the push is packed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..transport import copy_received
from .pieces import Piece, check_dense, check_elementwise, plan, view
from .shards import SPLITTING

__all__ = ["ShardViews"]

log = logging.getLogger(__name__)

_OWNER = "SyncReplicasOptimizer"
Grads = list[torch.Tensor | None]


class ShardViews:
    """Pieces, and each shard's values and gradients as views (module docstring)."""

    optimizer: torch.optim.Optimizer
    params: Callable[[], list[torch.Tensor]]
    _pieces: list[Piece]
    _parts: list[list[int]]
    _split: list[Piece] | None

    def _plan_split(self, how: str, ema: Any, num_shards: int) -> list[Piece] | None:
        """``shard_assignment="split"`` or ``"backward_order"`` over several shards: the
        pieces (:mod:`.pieces`); None for whole parameters."""
        if how not in SPLITTING:
            return None
        if num_shards == 1:
            log.info("%s: shard_assignment=%r with one server: nothing to split", _OWNER, how)
            return None
        check_elementwise(self.optimizer)
        if ema is not None:
            raise ValueError(
                f"{_OWNER}: shard_assignment={how!r} does not support variable_averages (the "
                "moving averages are kept per whole variable); use shard_assignment='bytes'"
            )
        return plan(self.params(), num_shards)

    def _piece_views(self, tensors: Sequence[torch.Tensor | None]) -> Grads:
        """Each piece's view of ``tensors`` (per parameter: values or gradients)."""
        return [
            None if tensors[pc.index] is None else view(tensors[pc.index], pc)
            for pc in self._pieces
        ]

    def _shard_params(self, k: int) -> list[torch.Tensor]:
        """Shard ``k``'s variables on this worker: parameters, or views of them (split)."""
        params = self.params()
        return [view(params[self._pieces[j].index], self._pieces[j]) for j in self._parts[k]]

    def _load_shard(self, k: int, values: Sequence[torch.Tensor]) -> None:
        """Copy shard ``k``'s new values into the parameters (those the transport received
        in place already are skipped)."""
        with torch.no_grad():
            for p, v in zip(self._shard_params(k), values, strict=True):
                copy_received(p, v)

    def _grad_parts(self, grads: Grads) -> list[Grads]:
        """Each shard's gradients (all checked before the caller pushes any)."""
        return [self._shard_grads(k, grads) for k in range(len(self._parts))]

    def _shard_grads(self, k: int, grads: Grads) -> Grads:
        """Shard ``k``'s gradients: views of its pieces when split (sparse ones refused)."""
        pieces = [self._pieces[j] for j in self._parts[k]]
        if self._split is not None:
            check_dense(grads, pieces)
        return [None if grads[pc.index] is None else view(grads[pc.index], pc) for pc in pieces]
