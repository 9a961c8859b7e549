"""Run RETURNN's PyTorch engine in this process on a tiny task (seconds per run).

The task: RETURNN's deterministic ``DummyDataset`` (24 sequences of 5 frames, 3 features,
4 classes), an LSTM + linear model with a sparse-gradient label embedding, frame-wise cross
entropy, 4 steps per epoch.  A run
trains from the last checkpoint in ``model_dir`` (if any) up to ``num_epochs``, as
``rnn.py`` would with the same config, and returns the parameters and the optimizer.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from tests.doc_blocks import claimed_blocks

PAGE = "docs/returnn.md"


def page_config() -> dict[str, Any]:
    """The RETURNN config snippet of docs/returnn.md ("Using gradfleet from RETURNN"),
    executed: the names it defines (``optimizer``, ``learning_rate``, ...)."""
    (snippet,) = claimed_blocks(PAGE, __file__)
    namespace: dict[str, Any] = {}
    exec(compile(snippet, PAGE, "exec"), namespace)
    return {k: v for k, v in namespace.items() if not k.startswith("__")}


class Net(torch.nn.Module):
    """LSTM over the features plus a sparse-gradient embedding of the previous frame's label
    (``nn.Embedding(sparse=True)``: row-sparse gradients with repeated rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3, sparse=True)  # row 4: "no previous label"
        self.lstm = torch.nn.LSTM(3, 8, batch_first=True)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        previous = torch.nn.functional.pad(labels[:, :-1], (1, 0), value=4)
        return self.out(self.lstm(x + self.embed(previous))[0])


def get_model(*, epoch: int, step: int, **_kwargs) -> torch.nn.Module:
    torch.manual_seed(42)  # the same start for every run (a restart loads the checkpoint)
    return Net()


def train_step(*, model: torch.nn.Module, extern_data, **_kwargs) -> None:
    import returnn.frontend as rf

    x = extern_data["data"].raw_tensor
    y = extern_data["classes"].raw_tensor.long()
    logits = model(x, y)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    rf.get_run_ctx().mark_as_loss(name="ce", loss=loss)


def decaying_learning_rate(*, global_train_step: int, learning_rate: float, **_kwargs) -> float:
    """A per-step schedule, so that the optimizer's lr changes every step."""
    return learning_rate * 0.9**global_train_step


class _InProcessManager:
    """Stands in for the spawn-context ``SyncManager`` RETURNN's Engine starts only to share
    the epoch number with data-loader worker processes.  With ``num_workers=0`` there are
    none, and each spawned manager would re-import the test process's main module (seconds)."""

    @staticmethod
    def Value(typecode: str, value: Any) -> Any:  # noqa: N802 - SyncManager's name
        return types.SimpleNamespace(value=value)


def train(
    model_dir: str | os.PathLike,
    num_epochs: int,
    optimizer: Any,
    *,
    learning_rate: float = 0.01,
    device_lr: bool = False,
    **config: Any,
) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """Train up to ``num_epochs`` (continuing from ``model_dir``'s checkpoints); returns
    (parameters by name, the optimizer).  ``device_lr``: RETURNN's ``use_device_lr_tensors``
    (a 0-dim tensor lr per group, updated in place, as for its CUDA-graph capture)."""
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
            optimizer=optimizer,
            learning_rate=learning_rate,
            num_epochs=num_epochs,
            batch_size=30,
            model=os.path.join(model_dir, "model"),
            torch_dataloader_opts={"num_workers": 0},
            **config,
        )
    )
    dataset = init_dataset(
        {
            "class": "DummyDataset",
            "input_dim": 3,
            "output_dim": 4,
            "num_seqs": 24,
            "seq_len": 5,
            "name": "train",
        }
    )
    with (
        global_config_ctx(config),
        mock.patch(
            "returnn.util.multi_proc_manager_with_watchdog.create_manager", _InProcessManager
        ),
    ):
        engine = Engine(config=config)
        try:
            engine.init_train_from_config(train_data=dataset)
            if device_lr:
                engine._updater.use_device_lr_tensors("cpu")
            engine.train()
            model = engine.get_pt_model()
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
            return params, engine.get_pt_optimizer()
        finally:
            engine.finalize()
