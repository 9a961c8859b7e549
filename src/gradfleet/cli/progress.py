"""Live progress for a run: a thread tails rank 0's ``metrics.jsonl`` while the job runs.

Tailing the file works the same whether the loop runs in this process or in spawned ranks whose
output goes to log files. The bar (tqdm, stderr) shows only on a terminal; without one, or with
``--quiet``, evaluation lines are printed instead (or nothing when quiet).

The file may be replaced under the reader: ``--resume`` renames a truncated copy over it. The
reader notices (another inode, or a file shorter than what it read) and reads the new file from
its start; a line it cannot parse is skipped with a log record, never an exception.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

__all__ = ["Progress"]

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, metrics: Path, total: int, label: str, quiet: bool) -> None:
        self.metrics, self.total, self.label, self.quiet = metrics, total, label, quiet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._offset, self._inode = 0, -1
        self._said: set[int] = set()  # steps whose evaluation was printed

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _records(self) -> list[dict]:
        try:
            with open(self.metrics, "rb") as f:
                info = os.fstat(f.fileno())
                if info.st_ino != self._inode or info.st_size < self._offset:
                    self._offset, self._inode = 0, info.st_ino  # a new file: read it all
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line may be half-written
        self._offset += len(complete)
        records = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                rec = json.loads(line) if line.strip() else None
            except json.JSONDecodeError as err:
                log.debug("skipped a metrics line (%s): %.80r", err, line)
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                records.append(rec)
        return records

    def _say(self, bar: tqdm | None, rec: dict) -> None:
        if "test_accuracy" not in rec or self.quiet or rec["step"] in self._said:
            return
        self._said.add(rec["step"])
        text = (
            f"[{self.label}] step {rec['step']}: test accuracy {rec['test_accuracy']:.3f}, "
            f"test loss {rec['test_loss']:.4f}"
        )
        if bar is not None:
            bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def _run(self) -> None:
        try:
            self._show()
        except Exception as err:  # the display only: the run goes on without it
            log.warning("progress display stopped: %s: %s", type(err).__name__, err, exc_info=True)

    def _show(self) -> None:
        interactive = sys.stderr.isatty() and not self.quiet
        bar = (
            tqdm(total=self.total, desc=self.label, unit="step", dynamic_ncols=True, leave=True)
            if interactive
            else None
        )
        while True:
            stopping = self._stop.is_set()  # read once more after the job ends
            for rec in self._records():
                if bar is not None and "loss" in rec:
                    bar.n = rec["step"]
                    wall = max(rec["wall"], 1e-9)
                    bar.set_postfix(
                        loss=f"{rec['loss']:.4f}",
                        steps_s=f"{rec['step'] / wall:.0f}",
                        samples_s=f"{rec['samples'] / wall:.0f}",
                        refresh=False,
                    )
                    bar.refresh()
                self._say(bar, rec)
            if stopping:
                break
            time.sleep(0.1)
        if bar is not None:
            bar.close()
