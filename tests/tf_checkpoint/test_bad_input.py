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


def _tf_variables(slots: dict[str, int], **extra) -> dict[str, np.ndarray]:
    """The model's variables in TF's layout, each with ``slots`` (suffix -> count) slots."""
    out = {}
    for name, shape in tf_run.SHAPES.items():
        out[name] = np.ones(shape, np.float32)
        for suffix, count in slots.items():
            for k in range(count):
                out[f"{name}/{suffix}" + (f"_{k}" if k else "")] = np.ones(shape, np.float32)
    return {**out, "global_step": np.int64(3), **extra}


def test_checkpoint_without_the_optimizers_slots_is_refused(tmp_path):
    """A TF GradientDescent checkpoint (no slots) into FTRL: TF's Saver refuses it (``Key
    dense/bias/Ftrl not found``); so does loading, unless the slots are named fresh."""
    prefix = write_checkpoint(tmp_path / "gd", _tf_variables({}))
    model = tf_run.Model()
    opt = gf.FtrlOptimizer(model.parameters(), 0.1)
    model.dense.weight.grad, model.dense.bias.grad = torch.ones(2, 3), torch.ones(2)
    opt.step()  # some state to keep
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointMismatch) as info:
        load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP)
    problems = info.value.problems
    assert problems["no slots"] == [
        f"{torch_name}: no ['{tf}/Ftrl', '{tf}/Ftrl_1'] (name it in fresh_slots to start them "
        f"afresh)"
        for torch_name, tf in [("dense.weight", "dense/kernel"), ("dense.bias", "dense/bias")]
        + [("emb.weight", "emb")]
    ]
    (mismatch,) = problems["optimizer mismatch"]
    assert "GradientDescentOptimizer" in mismatch
    assert "FtrlOptimizer (name 'Ftrl') expects accum = <var>/Ftrl, linear = <var>/Ftrl_1" in (
        mismatch
    )
    after = _snapshot(model, opt)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))

    fresh = ["dense.weight", "dense.bias", "emb.weight"]
    with pytest.raises(ValueError, match=r"fresh_slots: \['nosuch'\] are not parameters"):
        load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP, fresh_slots=["nosuch"])
    load_tf_checkpoint(prefix, model, opt, tf_run.NAME_MAP, fresh_slots=fresh)
    assert not opt.state  # created afresh at each parameter's first gradient
    assert torch.equal(model.dense.bias.detach(), torch.ones(2))


def test_another_optimizers_slots_are_named(tmp_path):
    adam = _tf_variables({"Adam": 2}, beta1_power=np.float32(0.9), beta2_power=np.float32(0.99))
    prefix = write_checkpoint(tmp_path / "adam", adam)
    model = tf_run.Model()
    with pytest.raises(CheckpointMismatch) as info:
        load_tf_checkpoint(
            prefix, model, gf.FtrlOptimizer(model.parameters(), 0.1), tf_run.NAME_MAP
        )
    problems = info.value.problems
    assert problems["optimizer mismatch"] == [
        "the checkpoint holds AdamOptimizer slots named 'Adam' (dense/bias/Adam, "
        "dense/bias/Adam_1, dense/kernel/Adam, dense/kernel/Adam_1, ...); FtrlOptimizer "
        "(name 'Ftrl') expects accum = <var>/Ftrl, linear = <var>/Ftrl_1"
    ]
    assert [p.split(":")[0] for p in problems["no slots"]] == [
        "dense.weight",
        "dense.bias",
        "emb.weight",
    ]
    message = str(info.value)
    assert "optimizer mismatch (1): the checkpoint holds AdamOptimizer slots" in message

    # The same optimizer under another TF name: the name= to build it with is suggested.
    with pytest.raises(CheckpointMismatch) as info:
        load_tf_checkpoint(
            prefix, model, gf.AdamOptimizer(model.parameters(), name="MyAdam"), tf_run.NAME_MAP
        )
    assert "AdamOptimizer (name 'MyAdam') expects m = <var>/MyAdam, v = <var>/MyAdam_1" in str(
        info.value
    )


def test_slots_not_created_yet_are_written_as_tf_creates_them(tmp_path):
    """TF's graph has every slot from the start, and its Saver restores all of them: a
    parameter without a gradient yet gets the slots TF would initialise."""
    from gradfleet.tf_checkpoint import save_tf_checkpoint

    model = tf_run.Model()
    opt = gf.AdagradOptimizer(model.parameters(), 0.1, initial_accumulator_value=0.3)
    model.dense.weight.grad, model.dense.bias.grad = torch.ones(2, 3), torch.ones(2)
    opt.step()  # the embedding: no gradient, no slot yet
    prefix = save_tf_checkpoint(tmp_path / "model.ckpt", model, opt, tf_run.NAME_MAP, global_step=1)
    init = {n: np.zeros(s, np.float32) for n, s in tf_run.SHAPES.items()}
    run = tf_run.TFRun(lambda train, _: train.AdagradOptimizer(0.1, 0.3), init)
    try:
        initial = run.values()["emb/Adagrad"]
        run.restore(prefix)  # "Key emb/Adagrad not found" without it
        restored = run.values()
    finally:
        run.close()
    np.testing.assert_array_equal(restored["emb/Adagrad"], initial)
    np.testing.assert_array_equal(
        restored["dense/bias/Adagrad"], opt.get_slot(model.dense.bias, "accumulator").numpy()
    )
