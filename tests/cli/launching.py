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
    # the run may be writing a record while we read: only whole lines (ending in a newline)
    # count, as the CLI's own progress reader does
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


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


def wait_for_rejoin(out: Path, rank: int, procs: list[subprocess.Popen], deadline: float) -> None:
    """Block until rank 0 logged that ``rank`` rejoined: the restarted process has built its
    exchange (and, where the job keeps standbys, become one), which it does before it says so.
    Fails if a process ends first or time runs out."""
    while time.monotonic() < deadline:
        if any(r.get("event") == "worker_rejoined" and r.get("rank") == rank for r in metrics(out)):
            return
        ended = [p.args for p in procs if p.poll() is not None]
        assert not ended, f"ended before rank {rank} rejoined: {ended}"
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} did not rejoin in time")


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


def _stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command name (state, ppid, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry.name)] = int(_stat(int(entry.name))[1])
    found, frontier = [], [root]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _cpu_ticks(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[11]) + int(fields[12])  # utime + stime


def _idle_window(pid: int) -> bool:
    """Whether ``pid`` sat waiting for one second: at most 50 ms of CPU, never in disk wait
    (``D``: an import or a read stalled on a loaded disk is not waiting for the job), and
    seldom runnable (``R``: on a loaded machine a busy process queues for a CPU too)."""
    before, states = _cpu_ticks(pid), []
    for _ in range(10):
        time.sleep(0.1)
        states.append(_stat(pid)[0])
    return _cpu_ticks(pid) - before <= 5 and "D" not in states and states.count("R") <= 2


def _waiting_for_the_job(pid: int) -> bool:
    """Whether the replacement ``pid`` has imported torch and then sat waiting for two
    seconds in a row (``_idle_window``): it waits for the frozen ranks, not for its start."""
    if b"libtorch" not in Path(f"/proc/{pid}/maps").read_bytes():
        return False
    return _idle_window(pid) and _idle_window(pid)


def hold_until_replaced(
    out: Path, survivors: list[int], agent: subprocess.Popen, old_pid: int, deadline: float
) -> int:
    """Freeze the ``survivors``' worker processes (SIGSTOP) until ``agent`` has started a
    replacement for the killed worker ``old_pid`` and that replacement sits waiting
    (``_waiting_for_the_job``: imports done, it waits for the frozen ranks); then let them go
    on.  Returns the replacement's pid.  Without this a restarted worker that starts slowly
    (a loaded machine) finds the job already finished: the survivors need no gradient of it.
    A CPU-time stall alone was not enough: under CI's load (installs beside the tests) a
    replacement stalled on the disk while importing was taken for waiting, the survivors
    finished without it, and it waited for the ended job until the store went."""
    frozen = [int((out / "pids" / f"rank-{r}.pid").read_text()) for r in survivors]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        while time.monotonic() < deadline:
            new = [
                p for p in _descendants(agent.pid)
                if p != old_pid and b"gradfleet" in _cmdline(p) and running(p)
            ]  # fmt: skip
            if new:
                with contextlib.suppress(OSError, IndexError):
                    if _waiting_for_the_job(new[0]):
                        return new[0]
            time.sleep(0.2)
        raise AssertionError("no replacement worker was started and waiting in time")
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def kill_midway(
    procs: list[subprocess.Popen],
    out: Path,
    *,
    at_step: int,
    rank: int,
    deadline: float,
    rejoin: list[int] | None = None,
) -> tuple[int, list[tuple[int, str]]]:
    """Once rank 0 logged ``at_step``, SIGKILL ``rank``'s worker and wait for every launcher
    (``finish``); with ``rejoin`` (the survivors' ranks), freeze them until ``procs[rank]``'s
    agent has a replacement waiting (``hold_until_replaced``).  The launchers are stopped
    whatever happens.  Returns the killed pid and each launcher's ``(code, console)``."""
    try:
        wait_for_step(out, at_step, procs, deadline)
        first = kill_rank(out, rank)
        if rejoin is not None:
            hold_until_replaced(out, rejoin, procs[rank], first, deadline)
        return first, finish(procs, deadline, out)
    finally:
        stop(procs, out)


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
        said = stop(procs, out)
        tails = [  # what each launcher said, its ranks' tracebacks too
            f"--- launcher {i}, last lines:\n" + _tail(text, 40) for i, text in enumerate(said)
        ]
        raise AssertionError(
            "hang: a launcher did not finish before its deadline\n" + "\n".join(tails)
        ) from None
    return results


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def stop(procs: list[subprocess.Popen], out: Path | None = None) -> list[str]:
    """End each launcher and its workers: SIGTERM to each launcher's session (torchrun stops
    its workers), then SIGKILL to the sessions and to the workers named in ``out/pids``
    (torchrun starts workers in sessions of their own).  Returns what each said since the
    last read (the launchers' consoles, their ranks' tracebacks in them)."""
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
    said = []
    for p in procs:
        text = ""
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
            text = p.communicate(timeout=10)[0] or ""
        said.append(text)
    return said


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
