"""Every ``python`` block of docs/torch-tools.md runs, and the asserts in it (what the prose
claims) hold.  A block whose first line is ``# needs: <module>`` is skipped, with that
reason, when the module (an optional trainer) is not installed; ``# needs: cuda``, where CUDA
is not available."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import torch

PAGE = pathlib.Path(__file__).parents[1] / "docs" / "torch-tools.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_page_has_its_examples():
    assert len(BLOCKS) >= 7


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index):
    block = BLOCKS[index]
    needs = re.match(r"# needs: (\w+)", block)
    if needs and needs.group(1) == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available (the block runs on a GPU machine)")
    elif needs and importlib.util.find_spec(needs.group(1)) is None:
        pytest.skip(f"optional trainer {needs.group(1)} is not installed")
    exec(compile(block, f"{PAGE.name}[{index}]", "exec"), {})  # noqa: S102 - the page's own
