"""``--resume`` after a SIGKILL: rank 0 truncates ``metrics.jsonl`` to its last checkpoint while
the CLI's progress thread tails the same file. Neither may print a traceback: the truncated file
replaces the old one atomically, the reader notices a new file and reads it from its start, and
a line the killed run left half-written is dropped."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from gradfleet.cli.progress import Progress
from gradfleet.cli.run_files import Metrics

from .launching import GRADFLEET, finish, metrics, popen, stop, wait_for_step


def _write(path: Path, steps: range) -> None:
    with open(path, "a") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": 1.0 / s, "wall": 0.1 * s, "samples": s}) + "\n")


def test_progress_reader_survives_the_resume_truncation(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(path, range(1, 201))
    reader = Progress(path, 400, "run", quiet=True)
    assert [r["step"] for r in reader._records()] == list(range(1, 201))
    metrics = Metrics(path, resume_step=70)  # the resumed rank 0 keeps steps 1-70
    for s in range(71, 301):  # and logs past the reader's old offset
        metrics.write(step=s, loss=1.0 / s, wall=0.1 * s, samples=s)
    records = reader._records()  # before: a JSONDecodeError, or only the lines past the offset
    assert [r["step"] for r in records] == list(range(1, 301))
    metrics.close()


def test_resume_drops_the_line_a_killed_run_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(path, range(1, 31))
    with open(path, "a") as f:
        f.write('{"step": 31, "lo')  # SIGKILL while writing
    metrics = Metrics(path, resume_step=21)  # before: JSONDecodeError in rank 0
    metrics.write(step=22, loss=0.5, wall=2.2, samples=22)
    metrics.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, 23))
    assert not path.with_suffix(".jsonl.tmp").exists()


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_kill9_then_resume_prints_no_traceback(tmp_path: Path) -> None:
    """As a user meets it: ``train --checkpoint-every 7`` SIGKILLed, then ``--resume``."""
    out = tmp_path / "run"
    args = ["train", "--steps", "3000", "--checkpoint-every", "7", "--out", str(out)]
    proc = popen([*GRADFLEET, *args], tmp_path)
    deadline = time.monotonic() + 270
    try:
        wait_for_step(out, 300, [proc], deadline)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        killed_at = max(r["step"] for r in metrics(out) if "loss" in r)
        resumed = popen([*GRADFLEET, "train", "--resume", str(out), "--steps", "600"], tmp_path)
        ((code, console),) = finish([resumed], deadline, out)
    finally:
        stop([proc], out)
    assert code == 0, console
    assert "Traceback" not in console and "Error" not in console, console
    steps = [r["step"] for r in metrics(out) if "loss" in r]
    assert steps == list(range(1, 601)), (killed_at, steps[:5], steps[-5:])
