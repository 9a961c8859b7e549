"""The all-reduce: sums of tensors over a process group, and the mean of the ranks' gradients
with one rule for sparse rows.

Every all-reduce in gradfleet goes through this module: the wrappers' collectives
(:mod:`.collectives`: model averaging, EASGD), SyncReplicas without a server
(:mod:`.sync.worker.allreduce`, which lays the sums out in DDP's buckets and overlaps them with
backward) and the CLI's ``allreduce`` strategy (:func:`mean_gradients`).

**The mean of N ranks' gradients** (:class:`GradientMean`), parameter by parameter:

* dense: the sum over the ranks divided by N.  A rank without a gradient (None) counts as
  zeros, and a parameter that no rank has a gradient for stays None, so the optimizer leaves it
  alone.
* sparse (COO, rows on dim 0): each row's sum divided by **the number of ranks whose gradient
  holds the row**.  This is TF's ``SparseConditionalAccumulator``, the rule of SyncReplicas'
  server.  A row that one rank of N sent gets that rank's whole gradient, where torch's DDP and
  Horovod divide every row by N.  gradfleet keeps this one rule, so that ``gradfleet compare
  -s allreduce -s sync-replicas`` compares two strategies, not two averages.  For dense
  gradients the two rules agree, because every rank sends every row.
* dense on some ranks and sparse on others: ``ValueError``.

On the wire, a sparse gradient's rows are summed into a dense tensor of its parameter's shape,
which is all-reduced with the dense gradients.  One more all-reduce carries flags: which ranks
sent a dense or a sparse gradient for each parameter.  When some gradient is sparse, a third
counts the ranks that sent each row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..common.flat import flatten

__all__ = [
    "GradientMean",
    "by_device_and_dtype",
    "collective_device",
    "densify_",
    "mean_gradients",
    "summed",
]

Key = tuple[torch.device, torch.dtype]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's own small tensors (flags, counts) go: NCCL reduces CUDA tensors
    only (the current GPU's), while gloo and the combined backend reduce CPU tensors too."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> dict[Key, list[torch.Tensor]]:
    """The tensors grouped by device and dtype, in their order: one flat buffer each."""
    groups: dict[Key, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def summed(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> tuple[list[torch.Tensor], int]:
    """The sums of ``tensors`` over ``group``, with the bytes handed to the collectives.

    There is one all-reduce per device and dtype, of the tensors flattened into one buffer.
    Each sum is a view of its buffer, shaped like its tensor; the tensors are not changed."""
    sums: dict[int, torch.Tensor] = {}
    sent = 0
    for ts in by_device_and_dtype(tensors).values():
        flat = flatten(ts)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        sent += flat.numel() * flat.element_size()
        offset = 0
        for t in ts:
            sums[id(t)] = flat[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
    return [sums[id(t)] for t in tensors], sent


def densify_(out: torch.Tensor, g: torch.Tensor | None) -> None:
    """``out := g`` as a dense tensor: zeros for None, and for a sparse gradient its rows summed
    in (duplicate rows add up, as in TF's accumulator)."""
    with torch.no_grad():
        if g is None:
            out.zero_()
        elif g.is_sparse:
            g = g.coalesce()
            out.zero_()
            out.index_add_(0, g.indices()[0].to(out.device), g.values().to(out))
        else:
            out.copy_(g)


class GradientMean:
    """The mean of ``world`` ranks' gradients for the parameters ``params`` (module docstring).

    ``all_reduce`` sums one tensor over the ranks in place.  It is the caller's collective, so
    the caller's group and error handling apply.  ``device``: where the flags and row counts
    are reduced (:func:`collective_device`).  ``owner`` names the caller in errors."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        world: int,
        all_reduce: Callable[[torch.Tensor], Any],
        device: torch.device,
        owner: str,
    ) -> None:
        self.params, self.world = list(params), world
        self.all_reduce, self.device, self.owner = all_reduce, device, owner

    def flags(self, grads: Sequence[torch.Tensor | None], extra: int = 0) -> torch.Tensor:
        """This rank's senders' flags, to be summed over the ranks: entry ``i`` is 1 for a
        dense gradient of parameter ``i``, entry ``n + i`` is 1 for a sparse one.  After them
        come ``extra`` zeros for the caller's own flags, so that one all-reduce carries both."""
        n = len(self.params)
        flags = torch.zeros(2 * n + extra, dtype=torch.float64, device=self.device)
        for i, g in enumerate(grads):
            if g is not None:
                flags[n * g.is_sparse + i] = 1.0
        return flags

    def means(
        self,
        grads: Sequence[torch.Tensor | None],
        totals: Sequence[torch.Tensor],
        flags: torch.Tensor,
        in_place: bool = False,
    ) -> list[torch.Tensor | None]:
        """The mean gradients, from this rank's ``grads``, the ranks' summed gradients
        ``totals`` (dense, one per parameter, see :func:`densify_`) and the summed ``flags``
        (on the CPU).  It runs one more all-reduce, of the row counts, only when some rank's
        gradient is sparse.  ``in_place``: a dense mean is its total, divided where it lies
        (the same values; no new buffer per step, whose first touch costs as much as the
        division on the CPU)."""
        n = len(self.params)
        mixed = [i for i in range(n) if flags[i] > 0 and flags[n + i] > 0]
        if mixed:
            raise ValueError(
                f"{self.owner}: variables {mixed} got dense gradients on some ranks and sparse "
                "ones on others"
            )
        rows = self._row_counts(grads, [i for i in range(n) if flags[n + i] > 0])
        out: list[torch.Tensor | None] = []
        for i, p in enumerate(self.params):
            total = totals[i]
            if flags[i] == 0 and flags[n + i] == 0:
                out.append(None)
            elif i not in rows:  # None counts as zeros: divide by the N gradients
                out.append(total.div_(self.world) if in_place else total / self.world)
            else:
                idx = rows[i].nonzero().reshape(-1)
                div = rows[i][idx].to(p.dtype).reshape(-1, *[1] * (p.dim() - 1))
                values = total[idx] / div
                out.append(torch.sparse_coo_tensor(idx.unsqueeze(0), values, p.shape).coalesce())
        return out

    def _row_counts(
        self, grads: Sequence[torch.Tensor | None], sparse: list[int]
    ) -> dict[int, torch.Tensor]:
        """For the parameters that some rank sent a sparse gradient for: how many ranks sent
        each row.  One more all-reduce, of those parameters' rows only."""
        if not sparse:
            return {}
        rows = {
            i: torch.zeros(self.params[i].shape[0], dtype=torch.float64, device=self.device)
            for i in sparse
        }
        for i in sparse:
            g = grads[i]
            if g is not None and g.is_sparse:
                rows[i][g.coalesce().indices()[0].to(rows[i].device)] = 1.0
        flat = torch.cat(list(rows.values()))
        self.all_reduce(flat)
        offset = 0
        for i in sparse:
            n = rows[i].numel()
            rows[i] = flat[offset : offset + n].to(self.params[i].device)
            offset += n
        return rows


def mean_gradients(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None = None,
    owner: str = "mean_gradients",
) -> tuple[list[torch.Tensor | None], int]:
    """The mean over ``group``'s ranks of each parameter's gradient (the module docstring's
    rule), with the bytes of gradients handed to the collectives.  Every rank of the initialised
    process group calls it with the same parameters.  The gradients are not changed."""
    world = dist.get_world_size(group)
    mean = GradientMean(
        params, world, partial(dist.all_reduce, group=group), collective_device(group), owner
    )
    dense = []
    for p, g in zip(params, grads, strict=True):
        if g is not None and not g.is_sparse:
            dense.append(g.to(dtype=p.dtype, device=p.device))  # g itself when they match
        else:  # None or sparse: its rows summed into zeros of the parameter's shape
            dense.append(torch.empty(p.shape, dtype=p.dtype, device=p.device))
            densify_(dense[-1], g)
    totals, sent = summed(dense, group)
    flags = mean.flags(grads)
    dist.all_reduce(flags, group=group)
    return mean.means(grads, totals, flags.cpu()), sent
