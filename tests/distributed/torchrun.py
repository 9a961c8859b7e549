"""Running a script under torchrun on this machine, as users launch it, within a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 150) -> tuple[int, str]:
    """``torchrun --standalone --nproc-per-node nproc script args``: its exit code and its
    output (stdout and stderr).  Past ``timeout`` seconds torchrun and its workers are killed
    and the test fails with the output's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(script), *args]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # so a timeout can kill torchrun and its workers
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script.name} under torchrun did not end in {timeout:g} s:\n{out[-4000:]}")
    return proc.returncode, out
