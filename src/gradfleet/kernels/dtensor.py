"""DTensor parameters on the fused path: the kernel sees local shards, never a subclass.

``torch.distributed.tensor.DTensor`` (FSDP2's ``fully_shard``, tensor parallelism) is a
tensor subclass; inductor's compiled kernel reads raw memory, so a DTensor reaching it is
undefined behaviour (a crash).  Elementwise maths on a DTensor equals the same maths on its
local shard, so the fused path runs each DTensor parameter, gradient and slot through
``to_local()`` (an alias of the shard: the kernel's in-place stores update the DTensor).

Whole-tensor reductions are not elementwise: NormalizedSGD's ``sum(g * g)`` over a shard is
not the norm of the whole gradient.  An optimizer whose maths reduces over the whole tensor
declares ``_whole_tensor_statistics(grad) -> {name: 0-dim tensor}``; for a parameter that
is split across ranks (any placement other than ``Replicate``) those statistics are
computed on the DTensor itself (DTensor reduces per shard and all-reduces on the
parameter's mesh) and handed to the kernel as extra shared inputs, one kernel call per such
parameter, so its maths uses the global value instead of reducing its shard.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def all_plain(tensors) -> bool:
    """True when every tensor is a plain ``torch.Tensor``/``Parameter`` (a type test per
    tensor, cheap enough for every step)."""
    return all(type(t) in _PLAIN for t in tensors)


def is_dtensor(t: Any) -> bool:
    """True for a ``DTensor``; never imports torch.distributed.tensor itself (a DTensor
    can only exist once that module is loaded)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite; for a DTensor, over all of its shards (the
    same answer on every rank, so every rank takes the same branch)."""
    if not is_dtensor(t):
        return bool(torch.isfinite(t).all())
    return not bool(torch.isfinite(t).logical_not().sum().full_tensor())


def _split_across_ranks(p: Any) -> bool:
    from torch.distributed.tensor import Replicate

    return any(not isinstance(pl, Replicate) for pl in p.placements)


def _like_param(owner: str, what: str, t: Any, p: Any) -> Any:
    """``t`` as a DTensor laid out like parameter ``p`` (a gradient is redistributed, e.g.
    Partial -> Shard(0); state is updated in place, so it must share the layout)."""
    if not is_dtensor(t):
        raise TypeError(
            f"{owner}: {what} of DTensor parameter of shape {tuple(p.shape)} is a "
            f"{type(t).__name__}; it must be a DTensor on the parameter's mesh"
        )
    if t.device_mesh != p.device_mesh:
        raise ValueError(
            f"{owner}: {what} of DTensor parameter of shape {tuple(p.shape)} lives on "
            f"another device mesh ({t.device_mesh} vs {p.device_mesh})"
        )
    if tuple(t.placements) == tuple(p.placements):
        return t
    if what != "gradient":
        raise ValueError(
            f"{owner}: {what} of DTensor parameter of shape {tuple(p.shape)} has "
            f"placements {t.placements}, the parameter {p.placements}"
        )
    return t.redistribute(p.device_mesh, p.placements)


def local_work(opt, ps, gs, slots: dict[str, list], shared: dict[str, torch.Tensor]):
    """``[(params, grads, slots, shared), ...]`` of plain tensors for one bucket: all
    parameters in one entry, except those needing global statistics (one entry each)."""
    owner = type(opt).__name__
    statistics = getattr(opt, "_whole_tensor_statistics", None)
    together: tuple[list, list, dict[str, list], dict] = ([], [], {n: [] for n in slots}, shared)
    work = [together]
    for j, (p, g) in enumerate(zip(ps, gs)):
        entry = together
        ls = {n: ts[j] for n, ts in slots.items()}
        if is_dtensor(p):
            g = _like_param(owner, "gradient", g, p)
            ls = {n: _like_param(owner, f"slot {n!r}", s, p).to_local() for n, s in ls.items()}
            if statistics is not None and _split_across_ranks(p):
                # Computed on the DTensor (per-shard sums, all-reduced on its mesh); every
                # rank gets here for the same parameters in the same order.
                stats = {k: v.full_tensor() for k, v in statistics(g).items()}
                entry = ([], [], {n: [] for n in slots}, dict(shared, **stats))
                work.append(entry)
            p, g = p.to_local(), g.to_local()  # aliases of the shards (no autograd here)
        entry[0].append(p)
        entry[1].append(g)
        for n in slots:
            entry[2][n].append(ls[n])
    return [w for w in work if w[0]]


def check_plain(opt, params: list[torch.Tensor], grads: list[torch.Tensor], dtensors=False):
    """Refuse, with one clear error, a tensor subclass about to reach a compiled kernel
    (with ``dtensors``: any subclass but DTensor, which runs through its local shard).

    Parameters and gradients are checked (slots are made from, or loaded like, their
    parameter; hyperparameters and shared state are the optimizer's own plain tensors).
    """
    for p, g in zip(params, grads):
        for t in (p, g):
            if type(t) not in _PLAIN and not (dtensors and is_dtensor(t)):
                raise TypeError(
                    f"{type(opt).__name__}: fused=True compiles for plain dense tensors, got a "
                    f"{type(t).__name__} for the parameter of shape {tuple(p.shape)}; use "
                    f"foreach=True or foreach=False (the reference loop), which run the maths "
                    f"on the tensor subclass itself"
                )
