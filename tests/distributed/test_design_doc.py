"""The Python blocks of ``docs/distributed-design.md`` run, and their asserts hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed-design.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_page_has_its_examples():
    assert len(blocks()) == 7


@pytest.mark.parametrize("index", range(7))
def test_block_runs(index):
    exec(compile(blocks()[index], f"{DOC.name}[{index}]", "exec"), {})


def test_the_layer_table_names_every_module_in_its_folders_layer():
    from .test_layering import LAYER_NAMES, modules
    from .test_layering import layers as module_layers

    table = DOC.read_text().split("| layer |", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    for name, layer in module_layers().items():
        if modules()[name].name == "__init__.py":
            continue  # the folders themselves
        folder, _, module = name.rpartition(".")
        row = rows[f"{layer}. {LAYER_NAMES[layer - 1]}"]
        assert f"`{module}`" in row, f"{name}: not in the {LAYER_NAMES[layer - 1]} row"
        if folder:
            assert f"`{folder.replace('.', '/')}/`" in row, f"{name}: its folder is not named"


def test_every_function_a_trail_names_exists():
    from ..test_code_map import resolve, trail_functions

    names = trail_functions(DOC.read_text())
    assert len(names) >= 20  # the sharded path and the all-reduce path
    for dotted in names:
        assert callable(resolve(dotted)), dotted
