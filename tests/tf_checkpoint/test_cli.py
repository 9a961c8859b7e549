"""``gradfleet convert tf-checkpoint`` and ``convert torch-checkpoint``, run in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import gradfleet as gf
from gradfleet.cli import convert
from gradfleet.cli.main import app
from gradfleet.tf_checkpoint import tf_tensors
from tests.tf_checkpoint import tf_run

pytest.importorskip("tensorflow")

MAP_FILE = """
from tests.tf_checkpoint.tf_run import Model, NAME_MAP

def get_model():
    return Model()
"""
ADAM = json.dumps({"class": "adam", "learning_rate": 0.1})


def _invoke(*args):
    return CliRunner().invoke(app, ["convert", *map(str, args)])


@pytest.fixture(scope="module")
def tf_checkpoint(tmp_path_factory):
    """TF's Adam after 2 steps: (prefix, every TF variable's value)."""
    rng = np.random.default_rng(7)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}
    run = tf_run.TFRun(lambda train, _: train.AdamOptimizer(0.1), init)
    try:
        for g in tf_run.gradients(rng, 2):
            run.step(g)
        prefix = run.save(str(tmp_path_factory.mktemp("tf") / "model.ckpt"))
        return prefix, run.values()
    finally:
        run.close()


def test_both_directions(tmp_path, tf_checkpoint, monkeypatch):
    prefix, values = tf_checkpoint
    (tmp_path / "map.py").write_text(MAP_FILE)
    monkeypatch.setattr(convert, "PROGRESS_MIN_BYTES", 0)  # show the line for a tiny file
    res = _invoke(
        "tf-checkpoint",
        prefix,
        "--optimizer",
        ADAM,
        "--map",
        tmp_path / "map.py",
        "-o",
        tmp_path / "out",
    )
    assert res.exit_code == 0, res.stderr
    assert "reading" in res.stderr  # the progress line
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert state["global_step"] == 2
    model = tf_run.Model()
    opt = gf.AdamOptimizer(model.parameters(), 0.1)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    mine = tf_tensors(model, opt, tf_run.NAME_MAP, global_step=2)
    assert sorted(mine) == sorted(values)
    assert all(np.array_equal(mine[k], values[k]) for k in values)

    res = _invoke(
        "torch-checkpoint",
        tmp_path / "out" / "checkpoint.pt",
        "--optimizer",
        ADAM,
        "--map",
        tmp_path / "map.py",
        "-o",
        tmp_path / "back" / "model.ckpt",
        "-q",
    )
    assert res.exit_code == 0, res.stderr
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(tmp_path / "back" / "model.ckpt"))
    assert sorted(reader.get_variable_to_shape_map()) == sorted(values)
    assert all(np.array_equal(reader.get_tensor(k), values[k]) for k in values)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--optimizer", "nosuch"], "--optimizer nosuch: unknown optimizer"),
        (["--optimizer", "sgd"], "has no TensorFlow checkpoint layout"),
        (["--optimizer", "momentum"], "--optimizer momentum:"),  # needs momentum=
        (["--optimizer", ADAM, "--no-map"], "--map"),
        (["--optimizer", ADAM, "--prefix", "nothing"], "no TensorFlow checkpoint"),
        (["--optimizer", "ftrl"], "--optimizer ftrl:"),  # needs learning_rate
        (["--optimizer", ADAM, "--empty-map"], "does not fit; nothing was loaded"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, tf_checkpoint, args, message):
    prefix = tf_checkpoint[0]
    map_file = tmp_path / "map.py"
    map_file.write_text(MAP_FILE)
    if "--no-map" in args:
        args.remove("--no-map")
        map_file = tmp_path / "absent.py"
    if "--empty-map" in args:
        args.remove("--empty-map")
        map_file.write_text(MAP_FILE + "NAME_MAP = {}\n")  # default names: dense/weight ...
    if "--prefix" in args:
        i = args.index("--prefix")
        prefix = tmp_path / args[i + 1]
        del args[i : i + 2]
    res = _invoke("tf-checkpoint", prefix, *args, "--map", map_file, "-o", tmp_path / "out")
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert message in lines[0]
    assert not (tmp_path / "out").exists()


def _tf_adam_run(tmp_path, learning_rate, steps, seed=43, write_meta_graph=True):
    """TF1 graph-mode Adam at ``learning_rate`` after ``steps`` steps: (run, prefix, grads
    for ``steps`` + 5 steps)."""
    rng = np.random.default_rng(seed)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in tf_run.SHAPES.items()}
    grads = tf_run.gradients(rng, steps + 5)
    run = tf_run.TFRun(lambda train, _: train.AdamOptimizer(learning_rate), init)
    for g in grads[:steps]:
        run.step(g)
    with run.graph.as_default():  # Saver takes its eager path outside its graph
        prefix = run.saver.save(
            run.sess, str(tmp_path / "tf" / "model.ckpt"), write_meta_graph=write_meta_graph
        )
    return run, prefix, grads


# Adam's kernel rounds each element through at most 8 float32 operations per step (m: 3, v: 4,
# the step lr_t * m / (sqrt(v) + eps) and its subtraction: 8 with lr_t's own), each within
# eps/2 of the magnitudes involved, and a step's rounding carries into the next ones unchanged
# in size: after N steps two implementations of the same maths differ by at most
# N * 8 * eps32 * (the largest magnitude), array by array.
ADAM_ROUNDINGS_PER_STEP = 8
EPS32 = float(np.finfo(np.float32).eps)


def test_documented_command_continues_a_tf_adam_run(tmp_path):
    """TF1 Adam at lr 0.01 trains 3 steps; ``gradfleet convert tf-checkpoint PREFIX
    --optimizer adam --map map.py -o out/`` (docs/tf-checkpoints.md); the user builds the
    optimizer as the TF run did and loads; both continue 5 steps: the same trajectory."""
    k, n, lr = 3, 5, 0.01
    run, prefix, grads = _tf_adam_run(tmp_path, lr, k)
    try:
        (tmp_path / "map.py").write_text(MAP_FILE)
        res = _invoke(
            "tf-checkpoint", prefix, "--optimizer", "adam", "--map", tmp_path / "map.py",
            "-o", tmp_path / "out",
        )  # fmt: skip
        assert res.exit_code == 0, res.stderr
        assert "learning_rate=0.01 (TF graph)" in res.stdout
        state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
        assert state["optimizer"]["param_groups"][0]["lr"] == lr
        model = tf_run.Model()
        opt = gf.AdamOptimizer(model.parameters(), learning_rate=lr)
        model.load_state_dict(state["model"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same hyperparameters: nothing to say
            opt.load_state_dict(state["optimizer"])
        for g in grads[k : k + n]:
            run.step(g)
            tf_run.torch_step(model, opt, g)
        theirs = run.values()
        mine = tf_tensors(model, opt, tf_run.NAME_MAP, global_step=k + n)
        assert sorted(mine) == sorted(theirs)
        for name, value in theirs.items():
            bound = n * ADAM_ROUNDINGS_PER_STEP * EPS32 * float(np.abs(value).max())
            np.testing.assert_allclose(mine[name], value, rtol=0, atol=bound, err_msg=name)
    finally:
        run.close()


def test_values_the_graph_lacks_are_required(tmp_path):
    run, prefix, _ = _tf_adam_run(tmp_path, 0.01, 1, write_meta_graph=False)
    run.close()
    (tmp_path / "map.py").write_text(MAP_FILE)
    args = ["--map", tmp_path / "map.py", "-o", tmp_path / "out"]
    res = _invoke("tf-checkpoint", prefix, "--optimizer", "adam", *args)
    assert res.exit_code == 2
    (line,) = res.stderr.strip().splitlines()
    assert "the TF graph does not hold learning_rate, beta1, beta2, epsilon" in line
    assert f"no TF graph: {prefix}.meta does not exist" in line
    assert "--optimizer 'adam:learning_rate=VALUE,beta1=VALUE,beta2=VALUE,epsilon=VALUE'" in line
    assert not (tmp_path / "out").exists()
    full = "adam:learning_rate=0.01,beta1=0.9,beta2=0.999,epsilon=1e-8"
    res = _invoke("tf-checkpoint", prefix, "--optimizer", full, *args)
    assert res.exit_code == 0, res.stderr
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.01


def test_values_that_contradict_the_graph_are_refused(tmp_path):
    run, prefix, _ = _tf_adam_run(tmp_path, 0.01, 1)
    run.close()
    (tmp_path / "map.py").write_text(MAP_FILE)
    res = _invoke(
        "tf-checkpoint", prefix, "--optimizer", "adam:learning_rate=0.001",
        "--map", tmp_path / "map.py", "-o", tmp_path / "out",
    )  # fmt: skip
    assert res.exit_code == 2
    (line,) = res.stderr.strip().splitlines()
    assert "learning_rate 0.001, the TF graph's 0.01 (input lr of " in line
    assert not (tmp_path / "out").exists()


def test_fresh_slots_by_name(tmp_path):
    run, prefix, _ = _tf_adam_run(tmp_path, 0.01, 1)
    run.close()
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    kept = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    del kept["dense/bias/Adam"], kept["dense/bias/Adam_1"]  # a variable TF never updated
    from gradfleet.tf_checkpoint import write_checkpoint

    pruned = write_checkpoint(tmp_path / "pruned" / "model.ckpt", kept)
    (tmp_path / "map.py").write_text(MAP_FILE)
    spec = "adam:learning_rate=0.01,beta1=0.9,beta2=0.999,epsilon=1e-8"  # no graph written
    args = ["--optimizer", spec, "--map", tmp_path / "map.py", "-o", tmp_path / "out"]
    res = _invoke("tf-checkpoint", pruned, *args)
    assert res.exit_code == 2
    assert "no slots (1): dense.bias: no ['dense/bias/Adam', 'dense/bias/Adam_1']" in res.stderr
    res = _invoke("tf-checkpoint", pruned, *args, "--fresh-slots", "dense.bias")
    assert res.exit_code == 0, res.stderr
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert len(state["optimizer"]["state"]) == 2  # the kernel's and the embedding's


def test_tensorflow_logging_is_quiet(tmp_path):
    """A fresh process (TF imported by the conversion): the error is the only line."""
    (tmp_path / "map.py").write_text(MAP_FILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    source = Path(gf.__file__).resolve().parents[1]  # the gradfleet under test
    env["PYTHONPATH"] = os.pathsep.join([str(source), str(Path(__file__).resolve().parents[2])])
    out = subprocess.run(
        [sys.executable, "-m", "gradfleet", "convert", "tf-checkpoint", "nothing",
         "--optimizer", "adam", "--map", "map.py", "-o", "out"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "error: no TensorFlow checkpoint at 'nothing' (expected nothing.index and nothing.data-*)"
    ]
