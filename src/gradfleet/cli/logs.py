"""Logging for the CLI's processes: the launcher and every rank use the level of ``--log-level``.

Records go to stderr: the console for the launcher and for ranks under torchrun, the rank's
``logs/rank-R/.../stderr.log`` for the ranks the CLI starts itself. gradfleet's loggers are
``logging.getLogger(__name__)`` per module, so ``gradfleet.distributed.job_control`` and
``gradfleet.cli.launch`` can be told apart in the output.
"""

from __future__ import annotations

import logging

__all__ = ["configure_logging"]


def configure_logging(level: str, rank: int | None = None) -> None:
    """Send gradfleet's log records at ``level`` (debug, info, warning, error) and above to
    stderr, each line tagged with the rank (``launcher`` when None)."""
    where = "launcher" if rank is None else f"rank {rank}"
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s [{where}] %(name)s: %(message)s")
    )
    root = logging.getLogger("gradfleet")
    for old in [h for h in root.handlers if getattr(h, "gradfleet_cli", False)]:
        root.removeHandler(old)  # a second run in one process (compare, tests) replaces it
    handler.gradfleet_cli = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
