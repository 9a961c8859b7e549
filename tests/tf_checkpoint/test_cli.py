"""``gradfleet convert tf-checkpoint`` and ``convert torch-checkpoint``, run in process."""

from __future__ import annotations

import json

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
