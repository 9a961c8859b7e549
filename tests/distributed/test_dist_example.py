"""The end-to-end example, launched exactly as documented: torchrun with 2 processes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .torchrun import torchrun

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "distributed_wrappers.py"

pytestmark = pytest.mark.timeout(180)


def test_torchrun_example_trains_with_every_wrapper():
    code, out = torchrun(EXAMPLE, "--steps", "40")
    assert code == 0, out[-4000:]
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
