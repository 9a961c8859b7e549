"""Every ```python block of docs/tf-checkpoints.md and the README's migration example run, with
their asserts (here, where TensorFlow is imported once for all of them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_blocks import claimed_blocks
from tests.tf_checkpoint import tf_run

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "tf-checkpoints.md"

pytest.importorskip("tensorflow")


def test_doc_examples_run():
    text = DOC.read_text()
    assert "## Moving a TF1 or RETURNN run" in text
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    namespace: dict = {}
    with tf_run.eager():  # as in a fresh TF2 process (another test may have imported RETURNN)
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
    assert (Path(namespace["workdir"]) / "back" / "model.ckpt.index").exists()


def test_readme_example_runs():
    (block,) = claimed_blocks("README.md", __file__)
    namespace: dict = {}
    with tf_run.eager():
        exec(compile(block, str(ROOT / "README.md"), "exec"), namespace)
    assert namespace["info"].global_step == 1
