"""Launching workers so that one worker's death does not end the job, and rejoining it.

torch's launchers end or restart a whole *worker group* when one member fails: ``torchrun
--nproc-per-node N`` kills the survivors (``--max-restarts 0``) or restarts all of them, and a
multi-node c10d job waits for every agent at exit. The wrappers that tolerate a lost worker
(``SyncReplicasOptimizer`` with backup workers, asynchronous EASGD) need each worker to be its
own group: one launcher agent per worker, with gradfleet's rank and world size given here::

    GRADFLEET_RANK=2 GRADFLEET_WORLD_SIZE=3 \\
    GRADFLEET_MASTER_ADDR=10.0.0.1 GRADFLEET_MASTER_PORT=29500 \\
    GRADFLEET_SERVER_HOST=10.0.0.3 \\
    torchrun --standalone --nnodes=1 --nproc-per-node=1 --max-restarts=3 train.py

:func:`apply_job_env` maps these onto the ``env://`` variables torch reads (rank 0 hosts the
job's TCPStore at the master address), so ``gradfleet.distributed.init()`` joins gradfleet's job
instead of the agent's one-process job. When the agent restarts a worker
(``TORCHELASTIC_RESTART_COUNT > 0``) the others have moved on: the process must not rejoin the
process group; :attr:`JobPlace.rejoining` says so, and :func:`read_key` gives it what the running
job published (e.g. the server address), so it reconnects as TF's restarted worker does
(``local_step := global_step``).

The job store also carries small control messages between the launcher and rank 0 (a lost
worker, finished ranks). It has no authentication, like every c10d store and gloo connection:
bind servers to the cluster network only (:func:`server_host`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .hosting import env_server_host

__all__ = [
    "JobPlace",
    "apply_job_env",
    "job_store",
    "server_host",
    "publish",
    "read_key",
    "mark_lost",
    "lost_workers",
    "arrive",
    "wait_arrived",
]

_PREFIX = "gradfleet/"
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class JobPlace:
    """This process in gradfleet's job: rank, world size, and whether it rejoins a running job."""

    rank: int
    world_size: int
    rejoining: bool


def _int_env(name: str, minimum: int) -> int:
    raw = os.environ[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def apply_job_env() -> JobPlace | None:
    """Read ``GRADFLEET_RANK`` etc. (module doc) and export them as ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (rank 0 hosts the store). None when not set."""
    if "GRADFLEET_RANK" not in os.environ:
        return None
    missing = [f"GRADFLEET_{k}" for k in _ENV if f"GRADFLEET_{k}" not in os.environ]
    if missing:
        raise ValueError(f"GRADFLEET_RANK is set but {', '.join(missing)} is not")
    rank = _int_env("GRADFLEET_RANK", 0)
    world = _int_env("GRADFLEET_WORLD_SIZE", 1)
    if rank >= world:
        raise ValueError(f"GRADFLEET_RANK={rank} must be < GRADFLEET_WORLD_SIZE={world}")
    _int_env("GRADFLEET_MASTER_PORT", 1)
    for key in _ENV:
        os.environ[key] = os.environ[f"GRADFLEET_{key}"]
    os.environ["LOCAL_RANK"] = "0"
    # The agent's own store serves its one-process job; gradfleet's job store is rank 0's.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    rejoining = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    return JobPlace(rank, world, rejoining)


def job_store(timeout: float = 60.0) -> dist.TCPStore:
    """A client of the job's store at ``MASTER_ADDR:MASTER_PORT`` (for gradfleet's keys)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )


def server_host() -> str:
    """The address wrapper servers listen on: ``GRADFLEET_SERVER_HOST`` if set, loopback for a
    job on loopback, else this host's address on the route to ``MASTER_ADDR`` (the interface
    the process group's rendezvous uses). Never the wildcard address."""
    return env_server_host()


# ----------------------------------------------------------------------------- control keys
def publish(store: dist.Store, name: str, value: Any) -> None:
    store.set(_PREFIX + name, json.dumps(value))


def read_key(store: dist.Store, name: str, default: Any = None) -> Any:
    key = _PREFIX + name
    if not store.check([key]):
        return default
    return json.loads(store.get(key))


def mark_lost(store: dist.Store, rank: int, **info: Any) -> None:
    """Record that ``rank`` is gone (the launcher saw it die): rank 0 stops waiting for it."""
    publish(store, f"lost/{rank}", {"rank": rank, **info})


def lost_workers(store: dist.Store, world_size: int) -> dict[int, dict[str, Any]]:
    """Lost ranks not (yet) back: ``{rank: info}``."""
    out = {}
    for r in range(world_size):
        info = read_key(store, f"lost/{r}")
        if info is not None and read_key(store, f"rejoined/{r}") is None:
            out[r] = info
    return out


def arrive(store: dist.Store, point: str, rank: int) -> None:
    """``rank`` reached ``point`` (e.g. ``"finished"``, ``"checkpoint-100"``)."""
    publish(store, f"{point}/{rank}", True)


def wait_arrived(store: dist.Store, point: str, world_size: int, timeout: float) -> list[int]:
    """A barrier that a dead member cannot block (rank 0's side): wait until every rank
    arrived at ``point`` or was reported lost, at most ``timeout`` seconds. Returns the ranks
    that did neither (dead without a launcher that noticed, or stuck)."""
    end = time.monotonic() + timeout
    while True:
        lost = lost_workers(store, world_size)
        missing = [
            r for r in range(world_size) if r not in lost and not read_key(store, f"{point}/{r}")
        ]
        if not missing or time.monotonic() > end:
            return missing
        time.sleep(0.05)
