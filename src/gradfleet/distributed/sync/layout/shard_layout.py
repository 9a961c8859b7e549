"""How a SyncReplicas worker sees its parameters shard by shard: the pieces of
``shard_assignment="split"`` / ``"backward_order"``, which shard holds which, and each shard's
values and gradients as views of the worker's own tensors.

A shard is a list of piece numbers (``_parts[k]``); a piece is a whole parameter or a block of
its rows (:mod:`.pieces`).  Views, not copies: a shard's values are received in place into the
parameters, and its gradients are views of ``.grad``, read when the push is packed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ...common.flat import copy_received
from .assignment import SPLITTING, Placement, assign
from .pieces import Piece, check_dense, check_elementwise, plan, view, whole

__all__ = ["ShardLayout", "choose_layout", "shards_holding"]

log = logging.getLogger(__name__)

_OWNER = "SyncReplicasOptimizer"
Grads = list[torch.Tensor | None]


SHARDS_PER_RANK = 4  # measured best on the emulated cluster (docs/cluster.md)
MIN_SHARD_BYTES = 2 << 20  # smaller shards only add round trips


def choose_layout(
    optimizer: torch.optim.Optimizer,
    ranks: Sequence[int],
    model: torch.nn.Module | None,
    ema: Any,
) -> tuple[str, list[int]]:
    """``shard_assignment`` and server ranks where the user left the assignment out.

    Given the model and server ranks each named once: the parameters cut into runs in
    backward's order (``"backward_order"``, the numbers of ``"bytes"``), up to
    :data:`SHARDS_PER_RANK` shards per rank of at least :data:`MIN_SHARD_BYTES` each, so that
    the first layers' values travel back while later gradients still go out, and each
    module's forward waits only for its own shards.  One server rank is cut too (its link
    then carries values out while gradients still come in); a model too small for two
    shards stays one.  Not where the cut would be refused: an optimizer not known to update
    elementwise, ``variable_averages``, or a module of the model with sparse gradients.
    Otherwise whole parameters balanced by bytes on the ranks as named."""
    ranks = list(ranks)
    if model is None or ema is not None or len(set(ranks)) < len(ranks):
        return "bytes", ranks
    try:
        check_elementwise(optimizer)
    except ValueError:
        return "bytes", ranks
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in model.modules():
        sparse = getattr(module, "sparse", False) is True
        if sparse and any(id(p) in mine for p in module.parameters(recurse=False)):
            return "bytes", ranks
    total = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
    per_rank = max(1, min(SHARDS_PER_RANK, total // (len(ranks) * MIN_SHARD_BYTES)))
    if len(ranks) * per_rank == 1:
        return "bytes", ranks
    return "backward_order", ranks * per_rank


def shards_holding(owners: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Parameter index -> the shards holding a piece of it, from ``owners`` (the parameter
    indices of each shard's pieces; a cut parameter is in several shards)."""
    out: dict[int, list[int]] = {}
    for k, idx in enumerate(owners):
        for i in sorted(set(idx)):
            out.setdefault(i, []).append(k)
    return out


class ShardLayout:
    """Which pieces of which parameters each shard holds, and each shard's values and
    gradients as views of the worker's own tensors (module docstring): the one map of the
    parameters to the shards, which every other part of the worker reads.

    ``pieces``: every piece (the whole parameters unless split); ``parts[k]``: the piece
    numbers of shard ``k``; ``split``: the pieces when parameters were cut, else None;
    ``owners[k]``: the parameter indices shard ``k`` holds a piece of; ``shards_of[i]``: the
    shards holding a piece of parameter ``i``; ``placement``: what the servers are told."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        how: str,
        ema: Any,
        ranks: Sequence[int],
    ) -> None:
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.split = self._plan_split(optimizer, how, ema, len(ranks))
        self.pieces = self.split or whole(len(self.params))
        self.parts = assign(self.views(self.params), len(ranks), how, ranks)
        self.owners = [[self.pieces[j].index for j in idx] for idx in self.parts]
        self.shards_of = shards_holding(self.owners)
        self.placement = Placement(list(ranks), self.parts, self.split)

    def _plan_split(
        self, optimizer: torch.optim.Optimizer, how: str, ema: Any, num_shards: int
    ) -> list[Piece] | None:
        """``shard_assignment="split"`` or ``"backward_order"`` over several shards: the
        pieces (:mod:`.pieces`); None for whole parameters."""
        if how not in SPLITTING:
            return None
        if num_shards == 1:
            log.info("%s: shard_assignment=%r with one server: nothing to split", _OWNER, how)
            return None
        check_elementwise(optimizer)
        if ema is not None:
            raise ValueError(
                f"{_OWNER}: shard_assignment={how!r} does not support variable_averages (the "
                "moving averages are kept per whole variable); use shard_assignment='bytes'"
            )
        return plan(self.params, num_shards)

    def __len__(self) -> int:
        return len(self.parts)

    def views(self, tensors: Sequence[torch.Tensor | None]) -> Grads:
        """Each piece's view of ``tensors`` (per parameter: values or gradients)."""
        return [
            None if tensors[pc.index] is None else view(tensors[pc.index], pc) for pc in self.pieces
        ]

    def shard_params(self, k: int) -> list[torch.Tensor]:
        """Shard ``k``'s variables on this worker: parameters, or views of them (split)."""
        return [view(self.params[self.pieces[j].index], self.pieces[j]) for j in self.parts[k]]

    def load_shard(self, k: int, values: Sequence[torch.Tensor]) -> None:
        """Copy shard ``k``'s new values into the parameters (those the transport received
        in place already are skipped)."""
        with torch.no_grad():
            for p, v in zip(self.shard_params(k), values, strict=True):
                copy_received(p, v)

    def grad_parts(self, grads: Grads) -> list[Grads]:
        """Each shard's gradients (all checked before the caller pushes any)."""
        return [self.shard_grads(k, grads) for k in range(len(self.parts))]

    def shard_grads(self, k: int, grads: Grads) -> Grads:
        """Shard ``k``'s gradients: views of its pieces when split (sparse ones refused)."""
        pieces = [self.pieces[j] for j in self.parts[k]]
        if self.split is not None:
            check_dense(grads, pieces)
        return [None if grads[pc.index] is None else view(grads[pc.index], pc) for pc in pieces]
