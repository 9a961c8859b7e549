"""This process's place in a job, as its launcher's environment gives it: torchrun (or any
elastic agent) sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; the
per-worker recipe of docs/failures.md sets ``GRADFLEET_RANK`` and the like
(:func:`gradfleet.distributed.job_control.apply_job_env`), which name the job's rank where an
agent runs one worker.
"""

from __future__ import annotations

import os

__all__ = ["env_rank", "under_torchrun"]


def under_torchrun() -> bool:
    """True when this process is already one rank of a torchrun / elastic job."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def env_rank() -> int:
    """This process's rank in the job (0 where no launcher set one)."""
    return int(os.environ.get("GRADFLEET_RANK", os.environ.get("RANK", 0)))
