"""``shard_assignment="split"``: large parameters cut into pieces spread over the shards.

Whole-parameter sharding (:func:`~.shards.by_bytes`) cannot balance a model whose bytes sit
in a few large matrices: the shards holding them carry all the traffic.  As BytePS partitions
large tensors over its servers, :func:`plan` cuts every dense parameter of more than
``P / (2 S)`` bytes (``P``: all parameters' bytes, ``S``: shards) into about equal pieces of
at most that size, and the pieces (whole small parameters included) are then balanced by
bytes over the shards, so every shard carries about ``P / S`` bytes.

A piece is a *contiguous* view of its parameter, so a worker pushes ``grad[a:b]`` and
receives the new values in place into ``param[a:b]``:

* a block of rows ``[a, b)`` along dim 0 of a contiguous parameter of at least as many rows
  as pieces;
* otherwise, for a contiguous parameter: the flat elements ``[a, b)`` of ``param.view(-1)``;
* a non-contiguous parameter stays whole.

Exactness: a piece's update equals the slice of the whole parameter's update only when the
wrapped optimizer's rule is elementwise (every output element depends on the same element of
the parameter, its gradient and its slots, plus per-group scalars such as Adam's beta powers
or a step count, which every shard's copy keeps).  :func:`check_elementwise` states the rule:
the optimizer's class must be one of the classes known to be elementwise
(:data:`ELEMENTWISE_TORCH` and gradfleet's own optimizers but the ones with whole-tensor
reductions, such as ``NormalizedSGD``'s per-tensor norm); any other class, a subclass of a
known one included (it may override the maths), is refused.  Sparse gradients of a split
parameter are refused at push time (their rows cannot be cut without a gather).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "ELEMENTWISE_TORCH",
    "Piece",
    "check_elementwise",
    "check_dense",
    "in_backward_order",
    "plan",
    "rank_places",
    "split_optimizer",
    "view",
    "whole",
]

log = logging.getLogger(__name__)

#: torch.optim classes whose update is elementwise (per-parameter scalars only: step counts).
ELEMENTWISE_TORCH = (
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SGD",
)


class Piece(NamedTuple):
    """Parameter ``index``'s elements: rows ``[start, stop)`` (``flat``: flat elements of
    ``view(-1)``); ``stop is None``: the whole parameter."""

    index: int
    start: int = 0
    stop: int | None = None
    flat: bool = False


def whole(num_params: int) -> list[Piece]:
    """Every parameter as one piece (the other assignments)."""
    return [Piece(i) for i in range(num_params)]


def view(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``piece`` of ``t`` (a parameter, its gradient or a slot of its shape)."""
    if piece.stop is None:
        return t
    if piece.flat:
        return t.reshape(-1)[piece.start : piece.stop]
    return t[piece.start : piece.stop]


def _cuts(length: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous ranges of about equal size covering ``[0, length)``."""
    edges = [length * j // count for j in range(count + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def plan(params: Sequence[torch.Tensor], num_shards: int) -> list[Piece]:
    """The pieces of ``params`` (in parameter order) for ``num_shards`` shards; see the
    module docstring for the cut size and the kind of cut.  There are at least
    ``min(2 * num_shards, elements)`` pieces (each parameter of ``b`` bytes gives
    ``ceil(b / limit)`` of them unless it has fewer elements), so more shards than
    parameters can be served as long as there are as many elements."""
    sizes = [p.numel() * p.element_size() for p in params]
    limit = max(1, math.ceil(sum(sizes) / (2 * num_shards)))
    pieces: list[Piece] = []
    for i, (p, size) in enumerate(zip(params, sizes, strict=True)):
        count = min(math.ceil(size / limit), p.numel())
        if count <= 1 or p.layout != torch.strided:
            pieces.append(Piece(i))
        elif not p.is_contiguous():
            log.info("split: parameter %d %s is not contiguous, kept whole", i, tuple(p.shape))
            pieces.append(Piece(i))
        elif p.dim() >= 1 and p.shape[0] >= count:
            pieces += [Piece(i, a, b) for a, b in _cuts(p.shape[0], count)]
        else:
            pieces += [Piece(i, a, b, True) for a, b in _cuts(p.numel(), count)]
    cut = len(pieces) - len(params)
    log.info("split: %d parameters -> %d pieces (limit %d bytes)", len(params), len(pieces), limit)
    if cut == 0:
        log.info("split: no parameter above %d bytes, same as whole parameters", limit)
    return pieces


def rank_places(ranks: Sequence[int]) -> list[int]:
    """For each shard ``k`` (hosted by ``ranks[k]``): which of its rank's shards it is, 0 for
    the rank's first (``[4, 5, 4]`` -> ``[0, 0, 1]``)."""
    seen: dict[int, int] = {}
    places = []
    for r in ranks:
        seen[r] = seen.get(r, -1) + 1
        places.append(seen[r])
    return places


def in_backward_order(sizes: Sequence[int], ranks: Sequence[int]) -> list[list[int]]:
    """``shard_assignment="backward_order"``: piece indices of each shard (``sizes``: the
    pieces' bytes in parameter order; ``ranks[k]`` hosts shard ``k``).

    Backward produces gradients roughly in reverse parameter order (the order DDP assumes for
    its first buckets), so the pieces are taken last to first and cut into ``len(ranks)``
    contiguous runs of about ``P / S`` bytes: run 0 is complete first, the last run last.
    Runs go to the shards every server rank's first shard first, then every rank's second
    (``[4, 5, 6, 7] * 2``: shards 0-3, then 4-7), so the runs that complete at about the same
    time sit on different ranks and overlap's pushes of them load every server's link at
    once, as BytePS spreads each layer's partitions over all servers."""
    total, count = sum(sizes), len(sizes)
    num = len(ranks)
    if num > count:
        raise ValueError(f"SyncReplicasOptimizer: {num} shards for {count} pieces")
    places = rank_places(ranks)
    shard_of_run = sorted(range(num), key=lambda k: (places[k], k))
    parts: list[list[int]] = [[] for _ in range(num)]
    run, before = 0, 0
    for j, i in enumerate(reversed(range(count))):
        # the run whose byte range holds the piece's middle, but never backwards, at most one
        # run ahead (none left empty) and late enough for the pieces left to fill the rest
        wanted = int((before + sizes[i] / 2) * num / total) if total else run
        if parts[shard_of_run[run]]:
            run = min(max(run, wanted), run + 1)
        run = max(min(run, num - 1), num - (count - j))
        parts[shard_of_run[run]].append(i)
        before += sizes[i]
    return [sorted(p) for p in parts]


def check_elementwise(opt: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` unless ``opt``'s class is known to update elementwise."""
    from gradfleet import optimizers  # gradfleet's classes, imported only when splitting

    cls = type(opt)
    known = cls.__module__ == "torch.optim" or cls.__module__.startswith("torch.optim.")
    if known and cls.__name__ in ELEMENTWISE_TORCH:
        return
    reductions = getattr(cls, "_whole_tensor_statistics", None) is not None
    mine = [c for c in optimizers.ALL if c is not optimizers.BaseCustomOptimizer]
    if cls in mine and not reductions:
        return
    why = (
        "its update takes whole-tensor reductions (a per-tensor norm)"
        if reductions
        else "its class is not known to update elementwise"
    )
    raise ValueError(
        f"SyncReplicasOptimizer: shard_assignment='split' or 'backward_order' cuts parameters "
        f"into pieces and needs an elementwise optimizer, and "
        f"{cls.__module__}.{cls.__name__} is not one: {why}; use shard_assignment='bytes' "
        f"(whole parameters).  Known elementwise: gradfleet's optimizers but NormalizedSGD, "
        f"torch.optim's {', '.join(ELEMENTWISE_TORCH)}"
    )


def check_dense(grads: Sequence[torch.Tensor | None], pieces: Sequence[Piece]) -> None:
    """Sparse gradients cannot be cut: refuse one of a split parameter, before any push."""
    for piece in pieces:
        g = grads[piece.index]
        if piece.stop is not None and g is not None and g.layout != torch.strided:
            raise ValueError(
                f"SyncReplicasOptimizer: parameter {piece.index} of shape {tuple(g.shape)} got "
                f"a {g.layout} gradient, but shard_assignment='split'/'backward_order' cut it "
                "into pieces; "
                "sparse gradients need shard_assignment='bytes'"
            )


def split_optimizer(
    opt: torch.optim.Optimizer, pieces: Sequence[Piece]
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """A deep copy of ``opt`` over copies of the ``pieces`` (in order; each group holds the
    pieces of its parameters, and every group is kept, possibly empty, with its shared state
    such as beta powers), with each parameter's state sliced like it: a state tensor of the
    parameter's shape is cut as the parameter, anything else (step counts) copied."""
    originals = [p for g in opt.param_groups for p in g["params"]]
    values = [view(originals[pc.index], pc).detach().clone() for pc in pieces]
    memo: dict[int, Any] = {id(o): o for o in originals}  # not copied: replaced below
    clone = object.__new__(type(opt))
    # not the state (sliced below) nor a recorded fused-step plan (it holds the originals)
    skip = ("state", "_step_plan")
    clone.__dict__.update(
        {k: copy.deepcopy(v, memo) for k, v in opt.__dict__.items() if k not in skip}
    )
    group_of = {id(p): j for j, g in enumerate(opt.param_groups) for p in g["params"]}
    for group in clone.param_groups:
        group["params"] = []
    state = copy.copy(opt.state)  # torch's defaultdict(dict), emptied
    state.clear()
    for pc, value in zip(pieces, values, strict=True):
        original = originals[pc.index]
        clone.param_groups[group_of[id(original)]]["params"].append(value)
        if original in opt.state:
            state[value] = {
                k: _slice_state(v, original, pc) for k, v in opt.state[original].items()
            }
    clone.state = state
    return clone, values


def _slice_state(value: Any, param: torch.Tensor, piece: Piece) -> Any:
    if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
        return view(value, piece).detach().clone()
    return copy.deepcopy(value)
