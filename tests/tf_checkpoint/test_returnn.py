"""A RETURNN run moves from its TF backend to its PyTorch engine mid-run.

RETURNN's TF engine (a real config: ``network`` dict, Adam) trains epoch 1 and saves
``model.001``; its checkpoint holds the parameters and ``global_step`` (RETURNN's TF Saver
keeps no optimizer state, so a restarted TF run starts Adam afresh).  Reference: RETURNN-TF
restarted from ``model.001`` trains epoch 2 and saves ``model.002``.  Under test: the
checkpoint converted to ``model.001.pt`` + ``model.001.opt.pt``, RETURNN's PyTorch engine with
gradfleet's AdamOptimizer (the README's RETURNN setting) trains epoch 2.  Both epoch-2 results
agree within float32 bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import gradfleet as gf
from gradfleet.tf_checkpoint import TRANSPOSE, CheckpointReader
from gradfleet.tf_checkpoint.returnn import convert_returnn_checkpoint
from tests.returnn_engine import harness

pytest.importorskip("returnn.tf.engine")
pytest.importorskip("returnn.torch.engine")

DATASET = {"class": "DummyDataset", "input_dim": 3, "output_dim": 4, "num_seqs": 24, "seq_len": 5}
TF_CONFIG = """#!rnn.py
use_tensorflow = True
task = "train"
train = {dataset!r}
extern_data = {{"data": {{"dim": 3}}, "classes": {{"dim": 4, "sparse": True}}}}
network = {{"output": {{"class": "softmax", "loss": "ce", "from": "data"}}}}
optimizer = {{"class": "adam", "epsilon": 1e-16}}
learning_rate = 0.01
num_epochs = {epochs}
batch_size = 30
model = {model!r}
log_verbosity = 2
"""
NAME_MAP = {"output.weight": ("output/W", TRANSPOSE), "output.bias": "output/b"}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.output = torch.nn.Linear(3, 4)


def get_model(**_kwargs):
    return Net()


def train_step(*, model, extern_data, **_kwargs):
    import returnn.frontend as rf

    x = extern_data["data"].raw_tensor
    y = extern_data["classes"].raw_tensor.long()
    loss = torch.nn.functional.cross_entropy(
        model.output(x).flatten(0, 1), y.flatten(), reduction="none"
    )
    rf.get_run_ctx().mark_as_loss(name="output", loss=loss)


def _returnn_tf(tmp_path, name, epochs):
    config = tmp_path / f"{name}.config"
    model = str(tmp_path / "tf" / "model")
    config.write_text(TF_CONFIG.format(dataset=DATASET, epochs=epochs, model=model))
    code = f"from returnn.__main__ import main; main(['rnn.py', {str(config)!r}])"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(proc, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"RETURNN TF run timed out:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]


def _torch_engine(model_dir, num_epochs):
    from unittest import mock

    from returnn.config import Config, global_config_ctx
    from returnn.datasets import init_dataset
    from returnn.log import log
    from returnn.torch.engine import Engine

    if not getattr(log, "initialized", False):
        log.initialize(verbosity=[0])
    config = Config(
        dict(
            backend="torch",
            task="train",
            device="cpu",
            extern_data={"data": {"dim": 3}, "classes": {"dim": 4, "sparse": True}},
            get_model=get_model,
            train_step=train_step,
            optimizer={"class": "gradfleet.AdamOptimizer", "epsilon": 1e-16},
            learning_rate=0.01,
            num_epochs=num_epochs,
            batch_size=30,
            model=os.path.join(model_dir, "model"),
            torch_dataloader_opts={"num_workers": 0},
        )
    )
    dataset = init_dataset(dict(DATASET, name="train"))
    patch = mock.patch(
        "returnn.util.multi_proc_manager_with_watchdog.create_manager",
        harness._InProcessManager,
    )
    with global_config_ctx(config), patch:
        engine = Engine(config=config)
        try:
            engine.init_train_from_config(train_data=dataset)
            engine.train()
            return engine.get_pt_model(), engine.get_pt_optimizer()
        finally:
            engine.finalize()


@pytest.mark.slow  # two RETURNN-TF processes: ~45 s CPU, minutes on a loaded machine
def test_returnn_tf_run_continues_in_the_torch_engine(tmp_path):
    _wait(_returnn_tf(tmp_path, "epoch1", 1))
    restart = _returnn_tf(tmp_path, "epoch2", 2)  # RETURNN-TF's own continuation, meanwhile:
    try:
        model = Net()
        opt = gf.AdamOptimizer(model.parameters(), 0.01, epsilon=1e-16)
        files = convert_returnn_checkpoint(
            tmp_path / "tf" / "model.001", model, opt, NAME_MAP, tmp_path / "torch" / "model"
        )
        meta = torch.load(files[0], weights_only=True)
        assert (meta["epoch"], meta["step"]) == (1, 4)
        continued, torch_opt = _torch_engine(tmp_path / "torch", 2)
        assert type(torch_opt) is gf.AdamOptimizer
    finally:
        _wait(restart)
    reference = CheckpointReader(tmp_path / "tf" / "model.002")
    assert int(reference.get("global_step")) == 8
    weight = continued.output.weight.detach().numpy()
    bias = continued.output.bias.detach().numpy()
    # 4 Adam steps on float32 gradients summed over 30 frames in another order: a few ulps
    # of the gradient, each step moving at most lr; 4 steps x 30 terms x eps x |w|.
    tol = 4 * 30 * np.finfo(np.float32).eps
    np.testing.assert_allclose(weight, reference.get("output/W").T, rtol=tol, atol=tol)
    np.testing.assert_allclose(bias, reference.get("output/b"), rtol=tol, atol=tol)
    start = CheckpointReader(tmp_path / "tf" / "model.001").get("output/W").T
    assert not np.allclose(weight, start)  # epoch 2 did train
