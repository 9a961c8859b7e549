"""TF2 object-based checkpoints of ``tf.compat.v1`` optimizers, read under TF1 names.

TF2 (eager) trains K steps with a ``tf.compat.v1.train`` optimizer on dense (``kernel``,
``bias``) and row-sparse (``emb``, ``IndexedSlices`` with a duplicate row) variables and
saves ``tf.train.Checkpoint(model=..., optimizer=..., global_step=...)``.  The keys TF wrote
(``model/dense/kernel/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE`` ...) are
checked against TF's own objects; gradfleet loads the file, every value equals TF's live
state bit for bit, and both continue N steps and agree within the conformance bounds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradfleet as gf
from gradfleet.tf_checkpoint import TRANSPOSE, CheckpointMismatch, load_tf_checkpoint, tf_tensors
from gradfleet.tf_checkpoint.slot_names import slot_suffixes
from tests.conformance.test_conformance import TOLERANCE
from tests.tf_checkpoint import tf_run

tf = pytest.importorskip("tensorflow")

K, N = 3, 3
RTOL, ATOL = TOLERANCE["float32"]
VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
# torch name -> the variable's object path (its checkpoint key without VALUE)
NAME_MAP = {
    "dense.weight": ("model/dense/kernel", TRANSPOSE),
    "dense.bias": "model/dense/bias",
    "emb.weight": "model/emb",
}
PATHS = {"dense/kernel": "model/dense/kernel", "dense/bias": "model/dense/bias", "emb": "model/emb"}

# (id, TF optimizer, gradfleet optimizer, (rtol, atol) or None)
CASES = [
    (
        "Adam",
        lambda: tf.compat.v1.train.AdamOptimizer(0.1),
        lambda p: gf.AdamOptimizer(p, 0.1),
        None,
    ),
    (
        "Ftrl",  # see tests/conformance/specs.py for the wider absolute bound
        lambda: tf.compat.v1.train.FtrlOptimizer(
            0.5, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.1
        ),
        lambda p: gf.FtrlOptimizer(
            p, 0.5, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.1
        ),
        (2e-6, 1e-6),
    ),
    (
        "RMSProp-centered",
        lambda: tf.compat.v1.train.RMSPropOptimizer(0.01, momentum=0.5, centered=True),
        lambda p: gf.RMSPropOptimizer(p, 0.01, momentum=0.5, centered=True),
        None,
    ),
    (
        "Adagrad",
        lambda: tf.compat.v1.train.AdagradOptimizer(0.1),
        lambda p: gf.AdagradOptimizer(p, 0.1),
        None,
    ),
]


@pytest.fixture(autouse=True)
def _eager():
    with tf_run.eager():
        yield


class TF2Run:
    """Eager TF2: the variables in a ``tf.Module`` tree, a v1 optimizer, a ``Checkpoint``."""

    def __init__(self, make_optimizer, init: dict[str, np.ndarray]) -> None:
        self.model = tf.Module()
        self.model.dense = tf.Module()
        self.model.dense.kernel = tf.Variable(init["dense/kernel"])
        self.model.dense.bias = tf.Variable(init["dense/bias"])
        self.model.emb = tf.Variable(init["emb"])
        self.vars = {
            "dense/kernel": self.model.dense.kernel,
            "dense/bias": self.model.dense.bias,
            "emb": self.model.emb,
        }
        self.global_step = tf.Variable(0, dtype=tf.int64)
        self.opt = make_optimizer()
        self.checkpoint = tf.train.Checkpoint(
            model=self.model, optimizer=self.opt, global_step=self.global_step
        )

    def step(self, grads) -> None:
        pairs = []
        for n, var in self.vars.items():
            if n == "emb":
                idx, rows = grads[n]
                dense_shape = tf.constant([5, 3], tf.int64)
                g = tf.IndexedSlices(tf.constant(rows), tf.constant(idx), dense_shape)
            else:
                g = tf.constant(grads[n])
            pairs.append((g, var))
        self.opt.apply_gradients(pairs, global_step=self.global_step)

    def state(self, suffixes: dict[str, str]) -> dict[str, np.ndarray]:
        """TF's live state under TF1 Saver names (slot suffixes from gradfleet's table, which
        test_optimizers checks against TF1's own slot names)."""
        out = {"global_step": self.global_step.numpy()}
        for n, var in self.vars.items():
            out[PATHS[n]] = var.numpy()
            for slot in self.opt.get_slot_names():
                out[f"{PATHS[n]}/{suffixes[slot]}"] = self.opt.get_slot(var, slot).numpy()
        out.update({name: v.numpy() for name, v in self.non_slot().items()})
        return out

    def non_slot(self) -> dict:
        """The optimizer's variables that are not slots (Adam's beta powers), by name."""
        slots = {
            id(self.opt.get_slot(v, s))
            for v in self.vars.values()
            for s in self.opt.get_slot_names()
        }
        return {v.name.split(":")[0]: v for v in self.opt.variables() if id(v) not in slots}


def _fresh(make):
    torch.manual_seed(0)  # any start: loading must overwrite all of it
    model = tf_run.Model()
    return model, make(list(model.parameters()))


def _assert_same(got: dict, expected: dict, rtol: float, atol: float, where: str) -> None:
    assert sorted(got) == sorted(expected), where
    for name, value in expected.items():
        np.testing.assert_allclose(
            got[name], value, rtol=rtol, atol=atol, err_msg=f"{where}: {name}"
        )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tf2_checkpoint_continues_in_gradfleet(tmp_path, case):
    _, make_tf, make_gf, tolerance = case
    rtol, atol = tolerance or (RTOL, ATOL)
    rng = np.random.default_rng(sum(map(ord, case[0])) + 2)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}
    grads = tf_run.gradients(rng, K + N)
    run = TF2Run(make_tf, init)
    for g in grads[:K]:
        run.step(g)
    prefix = run.checkpoint.save(str(tmp_path / "tf2" / "ckpt"))

    # The keys TF wrote: one per variable, slot (by TF's slot name) and non-slot variable.
    keys = {k for k, _ in tf.train.list_variables(prefix)}
    slot_names = run.opt.get_slot_names()
    expected_keys = {f"{p}{VALUE}" for p in PATHS.values()}
    expected_keys |= {
        f"{p}/.OPTIMIZER_SLOT/optimizer/{s}{VALUE}" for p in PATHS.values() for s in slot_names
    }
    expected_keys |= {f"optimizer/{name}{VALUE}" for name in run.non_slot()}
    expected_keys |= {f"global_step{VALUE}", f"save_counter{VALUE}", "_CHECKPOINTABLE_OBJECT_GRAPH"}
    assert keys == expected_keys

    model, opt = _fresh(make_gf)
    suffixes = slot_suffixes(opt, opt.param_groups[0])
    assert sorted(suffixes) == sorted(slot_names)
    loaded = load_tf_checkpoint(prefix, model, opt, NAME_MAP)
    assert loaded.global_step == K
    at_k = run.state(suffixes)
    _assert_same(tf_tensors(model, opt, NAME_MAP, global_step=K), at_k, 0, 0, "loaded")
    for g in grads[K:]:
        run.step(g)
        tf_run.torch_step(model, opt, g)
    continued = tf_tensors(model, opt, NAME_MAP, global_step=K + N)
    _assert_same(continued, run.state(suffixes), rtol, atol, "continued")


def test_tf2_checkpoint_without_the_optimizer_lists_its_slots(tmp_path):
    rng = np.random.default_rng(5)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}
    run = TF2Run(lambda: tf.compat.v1.train.AdamOptimizer(0.1), init)
    run.step(tf_run.gradients(rng, 1)[0])
    prefix = run.checkpoint.save(str(tmp_path / "ckpt"))
    model = tf_run.Model()
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(CheckpointMismatch) as info:
        load_tf_checkpoint(prefix, model, None, NAME_MAP, ignore=["global_step"])
    unused = info.value.problems["unused checkpoint variables"]
    # a slot nobody claims keeps its object path; the non-slot variables theirs
    assert "model/dense/kernel/.OPTIMIZER_SLOT/optimizer/m" in unused
    assert "optimizer/beta1_power" in unused
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    # the model alone, the optimizer's variables deliberately left
    load_tf_checkpoint(prefix, model, None, NAME_MAP, ignore=lambda n: n not in PATHS.values())
    np.testing.assert_array_equal(model.emb.weight.detach().numpy(), run.model.emb.numpy())
