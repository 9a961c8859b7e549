"""docs/speed.md: every ```python block runs, and does what the prose around it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradfleet.kernels import plan

DOC = Path(__file__).resolve().parents[2] / "docs" / "speed.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.compile
def test_speed_page_python_blocks_run_and_replay(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    seen: list[bool] = []
    replay = plan.StepPlan.replay

    def spy(self, opt):
        seen.append(replay(self, opt))
        return seen[-1]

    monkeypatch.setattr(plan.StepPlan, "replay", spy)
    blocks = _blocks()
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    assert seen == [True, True]  # "step 0 compiles and records; steps 1 and 2 replay"
    opt = namespace["opt"]
    assert all(len(opt.state[p]) == 2 for p in namespace["params"])  # m and v exist
