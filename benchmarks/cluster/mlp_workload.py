"""The cluster benchmark's workload as a ``gradfleet train --workload`` file: the MLP of
:mod:`benchmarks.cluster.cluster_worker` (3 hidden layers, width for ``GF_MLP_PARAMS``
parameters, default 1e6) learning a fixed linear teacher's 4 labels from Gaussian inputs, with
Adam; ``GF_MLP_DEVICE_TIME`` seconds of emulated accelerator time per forward/backward
(``DeviceTime``: the CPU is free meanwhile, as while a GPU computes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cluster.cluster_worker import INPUTS, Teacher, build_model  # noqa: E402
from gradfleet.cli.workloads import Workload  # noqa: E402


def workload(seed: int = 0) -> Workload:
    params = float(os.environ.get("GF_MLP_PARAMS", "1e6"))
    device_time = float(os.environ.get("GF_MLP_DEVICE_TIME", "0"))
    teacher = Teacher(seed)
    gen = torch.Generator().manual_seed(seed + 31)
    x = torch.randn(9216, INPUTS, generator=gen)
    y = (x @ teacher.weight).argmax(dim=1)
    return Workload(
        name="cluster-mlp",
        description=f"MLP of {params:g} parameters learning a linear teacher's 4 labels",
        model=build_model(params, seed, device_time),
        train=(x[:8192], y[:8192]),
        test=(x[8192:], y[8192:]),
        loss_fn=nn.functional.cross_entropy,
        predict=lambda out: out.argmax(dim=1),
        batch_size=32,
        optimizer={"class": "adam", "learning_rate": 1e-3},
        steps=40,
    )
