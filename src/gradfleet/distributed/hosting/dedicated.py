"""The workers' side of dedicated server ranks (ranks that only serve; see :mod:`.serving`).

During a wrapper's construction, rank 0 tells the job's dedicated servers what to serve (the
*spec*: wrapper, arguments, variables' layout, the optimizer's parameter groups), every rank
learns whether each server can (:func:`check_statuses`: one error on every rank instead of a
hang), and rank 0 sends each server the initial values of its variables on the process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CENTRE",
    "SYNC",
    "HyperparameterPusher",
    "announce",
    "check_statuses",
    "group_hyperparameters",
    "receive_from_first",
    "sync_spec",
]

SYNC = "SyncReplicasOptimizer"
CENTRE = "AsyncCentre"
_PRIVATE = ("params", "non_slot")  # not hyperparameters: the variables, shared slot state


def check_statuses(mine: str | None) -> None:
    """Step 2: every rank's status; any error is raised on every rank alike."""
    statuses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, mine)
    bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if bad:
        text = "; ".join(f"dedicated server rank {r}: {s}" for r, s in bad)
        raise RuntimeError(f"the job's dedicated servers cannot start: {text}")


def announce(
    spec: dict[str, Any],
    params: Sequence[torch.Tensor],
    ranks: Sequence[int],
    parts: Sequence[Sequence[int]],
    workers: int,
) -> None:
    """Worker side of steps 1-3 (every worker calls it; rank 0's arguments count): the spec,
    the servers' statuses, then each dedicated rank (``ranks[k] >= workers``) gets the
    variables of the shards ``k`` it hosts (``parts[k]``: indices of ``params``, which are the
    pieces' views with ``shard_assignment="split"``), in shard order."""
    box = [spec]
    dist.broadcast_object_list(box, src=0)
    check_statuses(None)
    if dist.get_rank() != 0:
        return
    for rank in sorted({r for r in ranks if r >= workers}):
        for k, idx in enumerate(parts):
            if ranks[k] != rank:
                continue
            for i in idx:
                dist.send(params[i].detach().cpu().contiguous(), dst=rank)


def receive_from_first(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        dist.recv(t, src=0)


def group_hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's numeric hyperparameters (what a push carries when they change)."""
    return [
        {
            k: v
            for k, v in g.items()
            if k != "params" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for g in opt.param_groups
    ]


class HyperparameterPusher:
    """What a worker's push carries for dedicated servers: its numeric hyperparameters when
    they changed since the last push (None otherwise, and always without dedicated servers)."""

    def __init__(self, opt: torch.optim.Optimizer, dedicated: bool) -> None:
        self.opt, self.dedicated = opt, dedicated
        self.sent: list[dict[str, Any]] | None = None

    def changed(self) -> list[dict[str, Any]] | None:
        if not self.dedicated:
            return None
        hyper = group_hyperparameters(self.opt)
        if hyper == self.sent:
            return None
        self.sent = hyper
        return hyper


def sync_spec(
    params: Sequence[torch.Tensor],
    opt: torch.optim.Optimizer,
    job: Any,
    placement: Any,
    directory: str | None = None,
) -> dict[str, Any]:
    """Step 1's spec of a ``SyncReplicasOptimizer``: its ``job`` (:class:`~.sync.job.Job`)
    and ``placement`` (:class:`~.sync.layout.assignment.Placement`) whole, the variables'
    shapes and dtypes, the wrapped optimizer's parameter groups, and the name of the job's
    directory of its servers (:mod:`.server_directory`; None without standbys)."""
    groups = [
        {"count": len(g["params"]), "hyper": {k: v for k, v in g.items() if k not in _PRIVATE}}
        for g in opt.param_groups
    ]
    return {
        "kind": SYNC,
        "layout": [(list(p.shape), str(p.dtype).removeprefix("torch.")) for p in params],
        "groups": groups,
        "job": job,
        "placement": placement,
        "directory": directory,
    }
