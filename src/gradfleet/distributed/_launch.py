"""``gradfleet.distributed.init()``: bring up torch.distributed from torchrun's environment.

torchrun (``python -m torch.distributed.run``) exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` on every machine; ``init()`` reads them through the ``env://``
init method, so the same script runs with ``--nproc-per-node N`` on one machine or with a
multi-node rendezvous. Without those variables (``python script.py``) it creates a world of one
process on an in-memory store, so examples and tests run unchanged without a launcher.
"""

from __future__ import annotations

import os
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


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device_for(backend: str, local_rank: int) -> torch.device:
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


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
        backend: ``"gloo"``, ``"nccl"`` or any backend string torch accepts; ``None`` picks
            NCCL when CUDA is available and gloo otherwise.
        timeout: collective timeout (seconds or ``timedelta``); default 5 minutes instead of
            gloo's 30.
        set_device: with NCCL, call ``torch.cuda.set_device(LOCAL_RANK)``.

    Idempotent: if a default group already exists (created by an earlier ``init()`` or by the
    user's own ``init_process_group``), nothing is created and the existing group is described.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"init: backend must be a string or None, got {type(backend).__name__}")
    td = _as_timedelta(timeout)
    if dist.is_initialized():
        return _info()
    chosen = backend or _default_backend()
    env_ok = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
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
    _created_here = True
    return _info()


def shutdown() -> None:
    """Destroy the default group if :func:`init` created it (a user-created group is kept)."""
    global _created_here
    if _created_here and dist.is_initialized():
        dist.destroy_process_group()
    _created_here = False
