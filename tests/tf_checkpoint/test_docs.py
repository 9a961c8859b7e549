"""Every ```python block of docs/tf-checkpoints.md runs, with its asserts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.tf_checkpoint import tf_run

DOC = Path(__file__).resolve().parents[2] / "docs" / "tf-checkpoints.md"

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
