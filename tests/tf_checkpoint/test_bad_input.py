"""Bad input: one error that lists every misfit, and nothing changes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import gradfleet as gf
from gradfleet.tf_checkpoint import (
    CheckpointMismatch,
    TensorFlowMissing,
    load_tf_checkpoint,
    write_checkpoint,
)
from tests.tf_checkpoint import tf_run

pytest.importorskip("tensorflow")


def _snapshot(model, opt):
    out = [t.detach().clone() for t in model.state_dict().values()]
    out += [t.clone() for s in opt.state.values() for t in s.values()]
    return out + [t.clone() for g in opt.param_groups for t in g["non_slot"].values()]


def test_every_misfit_in_one_error_and_nothing_loaded(tmp_path):
    z = np.zeros
    tensors = {
        "dense/kernel": z((2, 3), np.float32),  # torch layout, but the map transposes
        "dense/kernel/Adam": z((2, 3), np.float32),
        "dense/kernel/Adam_1": z((2, 3), np.float32),
        "dense/bias": z(2, np.float32),
        "dense/bias/Adam": z(2, np.float32),  # Adam_1 absent: incomplete slots
        "emb": z((5, 3), np.float64),  # wrong dtype
        "stray": z(1, np.float32),  # nothing claims it
        "beta1_power": np.float32(0.5),  # beta2_power absent
    }
    prefix = write_checkpoint(tmp_path / "bad", tensors)
    model = tf_run.Model()
    opt = gf.AdamOptimizer(model.parameters(), 0.1)
    for p in model.parameters():  # some state to keep
        p.grad = torch.ones_like(p)
    opt.step()
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointMismatch) as info:
        load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP)
    problems = info.value.problems
    assert problems["unused checkpoint variables"] == ["stray"]
    assert problems["missing in the checkpoint"] == ["beta2_power (for non-slot beta2_power)"]
    assert problems["shape mismatch"] == [
        "dense/kernel [2, 3] after TRANSPOSE vs dense.weight [2, 3]"
    ]
    assert problems["dtype mismatch"] == ["emb float64 vs emb.weight torch.float32"]
    assert problems["incomplete slots"] == ["dense.bias: no ['dense/bias/Adam_1']"]
    message = str(info.value)
    assert message.startswith(f"TF checkpoint {prefix!r} does not fit; nothing was loaded:")
    after = _snapshot(model, opt)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    # ignore= accepts the stray name; the other misfits remain
    with pytest.raises(CheckpointMismatch) as info:
        load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP, ignore=["stray"])
    assert "unused checkpoint variables" not in info.value.problems


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TensorFlow checkpoint"):
        load_tf_checkpoint(tmp_path / "nothing", tf_run.Model())
    with pytest.raises(FileNotFoundError, match="no TensorFlow checkpoint in directory"):
        load_tf_checkpoint(tmp_path, tf_run.Model())


def test_clear_error_without_tensorflow(tmp_path):
    code = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "from gradfleet.tf_checkpoint import load_tf_checkpoint, TensorFlowMissing\n"
        "import torch\n"
        "try:\n"
        "    load_tf_checkpoint('x', torch.nn.Linear(1, 1))\n"
        "except TensorFlowMissing as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'gradfleet[tf]'" in out.stdout, out.stderr
    assert issubclass(TensorFlowMissing, ImportError)
