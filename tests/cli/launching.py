"""Helpers for the fault and launch tests: start gradfleet as users do, kill a rank mid-run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRADFLEET = [sys.executable, "-m", "gradfleet"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_step(out: Path, step: int, procs: list[subprocess.Popen], deadline: float) -> None:
    """Block until rank 0 logged ``step`` (fails if a process ends first or time runs out)."""
    while time.monotonic() < deadline:
        recs = [r for r in metrics(out) if "loss" in r]
        if recs and recs[-1]["step"] >= step:
            return
        ended = [p.args for p in procs if p.poll() is not None]
        assert not ended, f"ended before step {step}: {ended}"
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in time")


def running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def kill_rank(out: Path, rank: int) -> int:
    """SIGKILL the worker process of ``rank`` (its pid file in the run directory)."""
    pid = int((out / "pids" / f"rank-{rank}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    return pid


def finish(
    procs: list[subprocess.Popen], deadline: float, out: Path | None = None
) -> list[tuple[int, str]]:
    """Wait for every process until ``deadline``; on overrun kill them all and fail."""
    results = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((p.returncode, stdout))
    except subprocess.TimeoutExpired:
        stop(procs, out)
        raise AssertionError("hang: a launcher did not finish before its deadline") from None
    return results


def stop(procs: list[subprocess.Popen], out: Path | None = None) -> None:
    """End each launcher and its workers: SIGTERM to each launcher's session (torchrun stops
    its workers), then SIGKILL to the sessions and to the workers named in ``out/pids``
    (torchrun starts workers in sessions of their own)."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + 10
    while any(p.poll() is None for p in alive) and time.monotonic() < end:
        time.sleep(0.1)
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    if alive and out is not None:
        for pid_file in (out / "pids").glob("rank-*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
            p.communicate(timeout=10)


def popen(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # killpg reaches the launcher's workers
    )
