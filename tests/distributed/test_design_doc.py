"""The Python blocks of ``docs/distributed-design.md`` run, and their asserts hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed-design.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_has_its_examples():
    assert len(blocks()) == 5


@pytest.mark.parametrize("index", range(5))
def test_block_runs(index):
    exec(compile(blocks()[index], f"{DOC.name}[{index}]", "exec"), {})


def test_the_layer_table_names_every_module_of_the_layering_test():
    from .test_layering import LAYERS

    table = DOC.read_text().split("| layer |", 1)[1].split("\n\n", 1)[0]
    for name in LAYERS:
        if name in ("", "sync", "easgd", "transport", "sync.server", "sync.worker", "sync.layout"):
            continue  # packages
        shown = name.split(".", 1)[1] if name.startswith("transport.") else name
        assert f"`{shown}`" in table, name
