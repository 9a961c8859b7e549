"""The end-to-end example, launched exactly as documented: torchrun with 2 processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "distributed_wrappers.py"

pytestmark = pytest.mark.timeout(180)


def test_torchrun_example_trains_with_every_wrapper():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--steps",
        "40",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a timeout can kill torchrun *and* its workers
    )
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun example timed out:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    found = re.findall(r"rank (\d)/2 (\w+): test accuracy ([0-9.]+)", out)
    assert len(found) == 6, out[-4000:]
    assert {(r, name) for r, name, _ in found} == {
        (r, n) for r in "01" for n in ("model_average", "elastic_average", "towers")
    }
    for _, name, acc in found:
        assert float(acc) >= 0.8, (name, acc)
    accs = {(r, name): acc for r, name, acc in found}
    # model averaging ends on a round (40 % 5 == 0): both replicas are the same model
    assert accs[("0", "model_average")] == accs[("1", "model_average")]
