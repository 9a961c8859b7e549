"""Collective helpers over ``torch.distributed`` used by the wrappers.

Every wrapper talks to its peers through a :class:`Collective`: a thin object that knows the
process group, its rank and size, and offers in-place ``all_reduce_sum_`` / ``broadcast_`` over a
*list* of tensors. Lists are flattened into one buffer per (device, dtype) so a round costs one
collective per buffer instead of one per parameter; the sum is :func:`.all_reduce.summed`, the
all-reduce that every part of gradfleet uses. With ``num_worker == 1`` and no process group
the :class:`LocalCollective` makes every operation a no-op, so the wrappers work unchanged in a
plain single-process script.

DTensor parameters (FSDP2's ``fully_shard`` on one dimension of a device mesh, the HSDP /
local-SGD layout): the collectives run on each tensor's local shard.  That is the right
reduction when the wrapper's group runs across the mesh dimension the tensor is sharded on,
so that every rank of the group holds the same shard; any other layout is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradfleet.kernels.dtensor import is_dtensor

from ..common.flat import flatten, unflatten_
from .all_reduce import by_device_and_dtype, collective_device, summed

__all__ = ["Collective", "LocalCollective", "TorchCollective", "resolve_collective"]


class Collective:
    """Interface: in-place collectives on lists of tensors."""

    rank: int = 0
    world_size: int = 1

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        raise NotImplementedError

    def all_reduce_max_int(self, values: Sequence[int]) -> list[int]:
        raise NotImplementedError

    def all_reduce_mean_(self, tensors: Sequence[torch.Tensor]) -> None:
        """``t := (sum over ranks of t) / world_size`` for every tensor."""
        self.all_reduce_sum_(tensors)
        if self.world_size > 1:
            for t in tensors:
                t.div_(self.world_size)


class LocalCollective(Collective):
    """The world of one process: sums and broadcasts leave tensors unchanged."""

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        return None

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        return None

    def all_reduce_max_int(self, values: Sequence[int]) -> list[int]:
        return list(values)


def _local_shards(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Each DTensor's local shard (an alias: writes land in the DTensor), checked to be the
    same shard on every rank of ``group``; other tensors as they are."""
    out = []
    for t in tensors:
        if not is_dtensor(t):
            out.append(t)
            continue
        from torch.distributed.tensor import Replicate

        holders = set(t.device_mesh.mesh.flatten().tolist())
        peers = set(dist.get_process_group_ranks(group or dist.group.WORLD))
        if peers & holders != {dist.get_rank()} and any(
            not isinstance(pl, Replicate) for pl in t.placements
        ):
            raise ValueError(
                f"DTensor of shape {tuple(t.shape)} is split ({t.placements}) across ranks "
                f"{sorted(peers & holders)} of the averaging group: the group must run across "
                f"replicas that hold the same shard (e.g. mesh['replicate'].get_group() of an "
                f"HSDP mesh), not across the shards of one replica"
            )
        with torch.no_grad():
            out.append(t.to_local())
    return out


class TorchCollective(Collective):
    """Collectives on a ``torch.distributed`` process group (``None`` = the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        local = _local_shards(tensors, self.group)
        sums, _ = summed(local, self.group)
        with torch.no_grad():
            for t, s in zip(local, sums, strict=True):
                t.copy_(s)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        for ts in by_device_and_dtype(_local_shards(tensors, self.group)).values():
            flat = flatten(ts)
            dist.broadcast(flat, src=self._global_rank(src), group=self.group)
            unflatten_(flat, ts)

    def all_reduce_max_int(self, values: Sequence[int]) -> list[int]:
        device = collective_device(self.group)
        buf = torch.tensor(list(values), dtype=torch.int64, device=device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in buf.tolist()]


def resolve_collective(
    num_worker: int, process_group: dist.ProcessGroup | None, owner: str
) -> Collective:
    """Return the collective for ``num_worker`` workers, checking it matches the group size.

    ``num_worker == 1`` without an initialised process group gives a :class:`LocalCollective`.
    """
    if not dist.is_available() or not dist.is_initialized():
        if num_worker == 1 and process_group is None:
            return LocalCollective()
        raise RuntimeError(
            f"{owner}: num_worker={num_worker} needs torch.distributed; call "
            "gradfleet.distributed.init() (or torch.distributed.init_process_group) first"
        )
    coll = TorchCollective(process_group)
    if coll.world_size != num_worker:
        raise ValueError(
            f"{owner}: num_worker={num_worker} must equal the process group's world size "
            f"({coll.world_size})"
        )
    return coll
