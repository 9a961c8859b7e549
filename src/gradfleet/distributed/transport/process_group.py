"""``gradfleet.distributed.init()``: bring up torch.distributed from torchrun's environment.

torchrun (``python -m torch.distributed.run``) exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` on every machine; ``init()`` reads them through the ``env://``
init method, so the same script runs with ``--nproc-per-node N`` on one machine or with a
multi-node rendezvous. Without those variables (``python script.py``) it creates a world of one
process on an in-memory store, so examples and tests run unchanged without a launcher.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init", "shutdown"]

#: Default collective timeout. gloo's own default is 30 minutes, which turns one dead peer into a
#: half-hour hang; a few minutes is plenty for optimizer-sized collectives.
DEFAULT_TIMEOUT = timedelta(minutes=5)

_created_here = False


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank/size, local rank, backend and compute device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout)
    if not seconds > 0:
        raise ValueError(f"init: timeout must be a positive number of seconds, got {timeout!r}")
    return timedelta(seconds=seconds)


#: torch's own default on a CUDA build: CPU tensors reduce over gloo, CUDA tensors over NCCL.
COMBINED_BACKEND = "cpu:gloo,cuda:nccl"


def _ranks_on_this_machine(env_ok: bool) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE``; without it, every rank of the world (one machine)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return int(os.environ["WORLD_SIZE"]) if env_ok else 1


def _default_backend(ranks_here: int) -> tuple[str, str | None]:
    """``(backend, why_gloo)``: the combined CPU+CUDA backend when CUDA is available and each
    local rank gets a GPU of its own; gloo otherwise.  ``why_gloo`` explains a fallback from
    CUDA to gloo (NCCL refuses two ranks on one GPU: "Duplicate GPU detected")."""
    if not torch.cuda.is_available():
        return "gloo", None
    gpus = torch.cuda.device_count()
    if ranks_here > gpus:
        return "gloo", (
            f"{ranks_here} ranks on this machine but {gpus} CUDA device(s): NCCL needs one GPU "
            f"per rank, so gradfleet.distributed.init() uses gloo (CPU tensors only; CUDA "
            f"tensors would have to be moved to the CPU). Start at most {gpus} ranks per "
            f"machine for NCCL, or pass backend='gloo' to silence this warning."
        )
    return COMBINED_BACKEND, None


def _device_for(backend: str, local_rank: int) -> torch.device:
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _agree_on_fallback(fell_back: bool) -> None:
    """All ranks must have made the same automatic choice: machines with different numbers
    of GPUs per rank would mix NCCL and gloo for CUDA tensors (a hang).  One CPU all-reduce,
    which both gloo and the combined backend serve."""
    votes = torch.tensor([int(fell_back), int(not fell_back)], dtype=torch.int64)
    dist.all_reduce(votes)
    if votes.min().item() > 0:
        dist.destroy_process_group()
        raise RuntimeError(
            f"init: {votes[0].item()} rank(s) fell back to gloo (more ranks than GPUs on their "
            f"machine) and {votes[1].item()} chose {COMBINED_BACKEND!r}; pass the same backend "
            f"to init() on every machine"
        )


def _info() -> DistInfo:
    backend = str(dist.get_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=backend,
        device=_device_for(backend, local_rank),
    )


def init(
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    set_device: bool = True,
) -> DistInfo:
    """Initialise the default process group once and describe this process.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"`` or any backend string torch
            accepts.  ``None``: without CUDA, gloo; with CUDA, torch's combined
            ``"cpu:gloo,cuda:nccl"`` (CPU and CUDA tensors both work) when every rank on this
            machine (``LOCAL_WORLD_SIZE``) has a GPU of its own, and otherwise gloo with a
            ``RuntimeWarning`` saying why (NCCL cannot put two ranks on one GPU).  All ranks
            must make the same choice; a mix is a ``RuntimeError`` on every rank.
        timeout: collective timeout (seconds or ``timedelta``); default 5 minutes instead of
            gloo's 30.
        set_device: with NCCL (alone or combined), call
            ``torch.cuda.set_device(LOCAL_RANK % device_count)``.

    Idempotent: if a default group already exists (created by an earlier ``init()`` or by the
    user's own ``init_process_group``), nothing is created and the existing group is described.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"init: backend must be a string or None, got {type(backend).__name__}")
    td = _as_timedelta(timeout)
    if dist.is_initialized():
        return _info()
    env_ok = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    chosen, why_gloo = (
        (backend, None) if backend else _default_backend(_ranks_on_this_machine(env_ok))
    )
    if why_gloo:
        warnings.warn(why_gloo, RuntimeWarning, stacklevel=2)
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))
    if "nccl" in chosen and set_device and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    global _created_here
    if env_ok:
        dist.init_process_group(backend=chosen, init_method="env://", timeout=td)
    else:
        # No launcher: a world of one, rendezvous through an in-process store (no port).
        dist.init_process_group(
            backend=chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=td
        )
    if backend is None and torch.cuda.is_available() and dist.get_world_size() > 1:
        _agree_on_fallback(why_gloo is not None)
    _created_here = True
    return _info()


def shutdown() -> None:
    """Destroy the default group if :func:`init` created it (a user-created group is kept)."""
    global _created_here
    if _created_here and dist.is_initialized():
        dist.destroy_process_group()
    _created_here = False
