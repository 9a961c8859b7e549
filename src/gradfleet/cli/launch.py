"""Run the worker loop: in this process, or as N local ranks via torch's elastic launcher.

Local ranks rendezvous on a free loopback port (c10d backend, no etcd), their stdout/stderr go
to ``<run>/logs``, and a failed rank ends the whole job at once (``max_restarts=0``: the agent
kills the survivors instead of letting them wait out a collective timeout).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from .worker import run_worker

__all__ = ["WorkerFailed", "run_local", "launch", "under_torchrun"]


class WorkerFailed(RuntimeError):
    """A rank failed: ``str()`` is one line naming the rank, the cause and its log."""


def under_torchrun() -> bool:
    """True when this process is already one rank of a torchrun / elastic job."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_local(spec: dict[str, Any]) -> dict[str, Any] | None:
    """One process (``none``, ``towers``, or this rank under torchrun)."""
    return run_worker(spec)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no error message"


def _failure(err: Any, log_dir: Path) -> WorkerFailed:
    rank, failure = err.get_first_failure()
    logs = sorted(log_dir.glob(f"**/{rank}/stderr.log"))
    where = f"; log: {logs[-1]}" if logs else f"; logs under {log_dir}"
    message = failure.message
    if isinstance(message, dict):  # the error-file payload: {"message": ..., "extraInfo": ...}
        message = message.get("message", message)
    if failure.exitcode < 0:
        cause = f"killed by signal {-failure.exitcode}"
    else:
        cause = _last_line(str(message)) if message else f"exit code {failure.exitcode}"
    return WorkerFailed(f"worker rank {rank} failed: {cause}{where}")


def launch(spec: dict[str, Any], workers: int) -> dict[str, Any] | None:
    """Spawn ``workers`` ranks of :func:`run_worker` on loopback; rank 0's summary."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs each failure with a traceback; the CLI reports it as one line instead.
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    log_dir = Path(spec["out"]) / "logs"
    timeout = int(spec.get("timeout", 120))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers,
        run_id=f"gradfleet-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        rdzv_configs={"timeout": timeout, "join_timeout": timeout},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    try:
        results = elastic_launch(config, run_worker)(spec)
    except ChildFailedError as err:
        raise _failure(err, log_dir) from None
    return results.get(0)
