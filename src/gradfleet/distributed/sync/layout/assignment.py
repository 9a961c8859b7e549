"""Which shard holds which parameters, and on which ranks: the layout's decisions.

``server_ranks=[r0, r1, ...]`` (S shards): shard ``k`` is hosted by rank ``server_ranks[k]``
(a rank may host several shards; :func:`check_server_ranks`).  :func:`assign` gives each shard
whole parameters, balancing bytes (:func:`by_bytes`, default) or round-robin ``i % S``
(:func:`round_robin`, TF's ``replica_device_setter`` over ps tasks), or the pieces of
:data:`SPLITTING` assignments (:mod:`.pieces`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .pieces import Piece, in_backward_order

__all__ = [
    "ASSIGNMENTS",
    "SPLITTING",
    "Placement",
    "assign",
    "by_bytes",
    "check_server_ranks",
    "round_robin",
]


def check_server_ranks(
    ranks: Sequence[int],
    N: int,
    num_params: int,
    transport: str,
    address: Any,
    world_size: int | None = None,
) -> list[int]:
    """Validate ``server_ranks`` (and ``server_address`` against it); returns a list.

    Ranks ``0 .. N-1`` are the workers; a job of ``world_size > N`` processes has the dedicated
    server ranks ``N .. world_size-1``, and every one of them must host a shard.  A process
    outside the process group (``address`` given, no ``world_size``: a restarted worker) cannot
    know the job's size, so any rank from ``N`` on may be a dedicated server there."""
    owner = "SyncReplicasOptimizer"
    ranks = list(ranks)
    world = N if world_size is None else world_size
    if world_size is None and address is not None:
        world = max([N, *(r + 1 for r in ranks if isinstance(r, int))])
    if not ranks:
        raise ValueError(f"{owner}: server_ranks must name at least one rank")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            raise ValueError(
                f"{owner}: server rank {r!r} is neither a worker rank (total_num_replicas={N}: "
                f"ranks 0..{N - 1}) nor a dedicated server rank (world size {world}: ranks "
                f"{N}..{world - 1} only serve)"
            )
    idle = sorted(set(range(N, world)) - set(ranks))
    if idle:
        raise ValueError(
            f"{owner}: rank(s) {idle} of the {world} processes are neither workers "
            f"(total_num_replicas={N}) nor in server_ranks={ranks}; every rank from "
            f"{N} on must be a dedicated server"
        )
    dedicated = [r for r in ranks if r >= N]
    if dedicated and transport == "allreduce":
        raise ValueError(f"{owner}: dedicated server ranks {dedicated} need transport='server'")
    if len(ranks) > 1:
        if transport == "allreduce":
            raise ValueError(f"{owner}: server_ranks (sharding) needs transport='server'")
        if len(ranks) > num_params:
            raise ValueError(f"{owner}: {len(ranks)} server shards for {num_params} parameters")
        if isinstance(address, str) or (address is not None and len(address) != len(ranks)):
            raise ValueError(
                f"{owner}: with {len(ranks)} shards server_address must list one address per "
                "shard (the server_addresses property of a running optimizer)"
            )
    return ranks


def round_robin(num_params: int, num_shards: int) -> list[list[int]]:
    """Parameter indices of each shard: ``i`` goes to shard ``i % num_shards``."""
    return [list(range(k, num_params, num_shards)) for k in range(num_shards)]


def by_bytes(nbytes: Sequence[int], num_shards: int) -> list[list[int]]:
    """Parameter indices of each shard, balancing bytes: largest parameter first, each to the
    shard holding the fewest bytes so far (ties: lowest shard).  Whole parameters only, so
    per-tensor reductions of the wrapped optimizer (norms) stay exact."""
    load = [0] * num_shards
    parts: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        k = min(range(num_shards), key=lambda k: (load[k], len(parts[k]), k))
        parts[k].append(i)
        load[k] += nbytes[i]
    return [sorted(p) for p in parts]


ASSIGNMENTS = ("bytes", "round_robin", "split", "backward_order")
#: the assignments that cut large parameters into pieces (:mod:`.pieces`)
SPLITTING = ("split", "backward_order")


def assign(
    params: Sequence[torch.Tensor], num_shards: int, how: str, ranks: Sequence[int] = ()
) -> list[list[int]]:
    """Shard assignment ``how`` in :data:`ASSIGNMENTS` (one shard: every parameter).  The
    indices are of ``params``; for :data:`SPLITTING` pass the pieces' tensors
    (:func:`.pieces.plan`): ``"split"`` balances their bytes as whole parameters' are,
    ``"backward_order"`` cuts them into runs in backward's order over ``ranks`` (the shards'
    server ranks; :func:`.pieces.in_backward_order`)."""
    if how not in ASSIGNMENTS:
        raise ValueError(
            f"SyncReplicasOptimizer: shard_assignment must be one of {ASSIGNMENTS}, got {how!r}"
        )
    if how == "round_robin" or num_shards == 1:
        return round_robin(len(params), num_shards)
    sizes = [p.numel() * p.element_size() for p in params]
    if how == "backward_order":
        return in_backward_order(sizes, list(ranks) or list(range(num_shards)))
    return by_bytes(sizes, num_shards)


@dataclass(frozen=True)
class Placement:
    """What the servers are told of the layout: shard ``k`` on rank ``ranks[k]`` holds the
    pieces ``parts[k]`` -- of ``pieces`` when parameters were cut (``shard_assignment="split"``
    or ``"backward_order"``), else ``parts[k]`` are parameter indices and ``pieces`` is None."""

    ranks: list[int]
    parts: list[list[int]]
    pieces: list[Piece] | None = None
