"""What a run writes to its directory besides the model: the metrics file (rank 0's JSON lines,
cut back to the last checkpoint on resume) and the pointer to the newest complete checkpoint.

Shared by the training ranks (:mod:`.worker`) and the dedicated server ranks (:mod:`.servers`),
so it imports neither.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["Metrics", "atomic_save", "latest_checkpoint", "truncate_metrics"]

log = logging.getLogger(__name__)


def atomic_save(obj: Any, path: Path) -> None:
    """Write ``obj`` aside and rename it over ``path``: a reader never sees half a file (the
    file aside is this process's: two writers of one path never write into each other's)."""
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def latest_checkpoint(out: Path) -> int | None:
    """The step of the newest complete checkpoint in run directory ``out`` (or None)."""
    pointer = out / "checkpoints" / "latest"
    return int(pointer.read_text()) if pointer.is_file() else None


def truncate_metrics(path: Path, resume_step: int) -> None:
    """Drop what an interrupted run logged after its last checkpoint (and a line its death
    cut short). The kept lines are written aside and renamed over the file, so that a reader
    (the CLI's progress thread) sees the old file or the new one, never a half-truncated one."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1  # the last line a killed rank 0 was writing
            continue
        if rec["step"] <= resume_step and not rec.get("final"):
            kept.append(line + "\n")
        else:
            dropped += 1
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    log.info(
        "resume at step %d: kept %d metrics lines, dropped %d", resume_step, len(kept), dropped
    )


def last_logged_step(metrics: Path) -> int | None:
    """The newest step the writing rank logged (the end of ``metrics.jsonl``)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as err:
        log.debug("no step from %s: %s", metrics, err)
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # the first, cut line of the tail, a half-written last one, an event
    return None


class Metrics:
    """Rank 0's metrics file; other ranks write nothing."""

    def __init__(self, path: Path | None, resume_step: int | None) -> None:
        self._f = None
        if path is None:
            return
        if resume_step is not None:
            truncate_metrics(path, resume_step)
        self._f = open(path, "a" if resume_step is not None else "w")  # noqa: SIM115

    def write(self, **record: Any) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()  # the CLI's progress bar tails this file

    def close(self) -> None:
        if self._f:
            self._f.close()
