"""TowerOptimizer + replicate_model with CUDA parameters and towers on several GPUs, against
the same towers on the CPU. Skipped, with the reason, where the GPUs are missing.

What must hold on any placement: each tower's gradients are summed onto the device of the
shared parameter (which, and whose optimizer state, never moves), every replica lives on its
tower's device and equals the shared copy after a step, and the result is the CPU run's up to
float32 rounding: ``4 x steps x L x eps`` relative, where ``L`` is the longest chain of
reductions a parameter's gradient passes through (inputs 8 + hidden 16 + a tower's 4 rows +
the 2 towers' sum), so the bound holds on any GPU and any matmul algorithm that is not TF32.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradfleet
from gradfleet.distributed import TowerOptimizer, replicate_model

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device (none visible)")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices, {GPUS} visible")
pytestmark = pytest.mark.timeout(120)

STEPS = 3
LENGTH = 8 + 16 + 4 + 2
TOL = 4 * STEPS * LENGTH * torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def ieee_matmul():
    """TF32 matmuls round to 10 mantissa bits: not the float32 the tolerance is derived for."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def inner_optimizer(family: str, params):
    if family == "gradfleet":
        return gradfleet.MomentumOptimizer(params, 0.1, 0.9)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_towers(family: str, home: str, devices: list[str], data_device: str = "cpu"):
    """``STEPS`` replicated steps of a float32 MLP whose shared copy lives on ``home``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(home)
    opt = TowerOptimizer(inner_optimizer(family, net.parameters()))

    def model_fn(mod, x, y):
        loss = ((mod(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    rm = replicate_model(model_fn, net, loss_reduction="mean", devices=devices)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 8, generator=gen).to(data_device)
        y = torch.randn(8, 1, generator=gen).to(data_device)
        losses.append(rm(x, y).loss.detach().cpu())
    return net, rm, opt, torch.stack(losses)


def check_against_cpu(family: str, home: str, devices: list[str], data_device: str = "cpu"):
    net, rm, opt, losses = train_towers(family, home, devices, data_device)
    ref, _, _, ref_losses = train_towers(family, "cpu", ["cpu"] * len(devices))
    for p in net.parameters():
        assert p.device == torch.device(home)  # the shared copy never moves
        slots = [v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim()]
        assert slots and all(s.device == p.device for s in slots)  # nor does its state
    for tower, device in zip(rm.towers, devices, strict=True):
        for tp, p in zip(tower.parameters(), net.parameters(), strict=True):
            assert tp.device == torch.device(device)
            assert torch.equal(tp.detach().cpu(), p.detach().cpu())  # broadcast after the step
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        scale = float(q.detach().abs().max()) + 1.0
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=TOL, atol=TOL * scale)
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL * float(ref_losses.max()))


FAMILIES = ["torch", "gradfleet"]


@needs_gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("home", "devices", "data"),
    [
        ("cuda:0", ["cuda:0", "cuda:0"], "cpu"),  # two towers on one GPU, one of them shared
        ("cpu", ["cuda:0", "cuda:0"], "cpu"),  # TF's placement: variables on the CPU
        ("cuda:0", ["cuda:0", "cpu"], "cuda:0"),  # a CPU tower fed from the GPU
    ],
)
def test_towers_on_one_gpu_match_cpu(family, home, devices, data):
    check_against_cpu(family, home, devices, data)


@needs_two_gpus
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("home", "devices"),
    [
        ("cuda:0", ["cuda:0", "cuda:1"]),
        ("cpu", ["cuda:0", "cuda:1"]),
        ("cuda:1", ["cuda:0", "cuda:1"]),  # the shared copy is not on the current device
    ],
)
def test_towers_on_two_gpus_match_cpu(family, home, devices):
    check_against_cpu(family, home, devices)


@needs_gpu
def test_unindexed_cuda_is_the_current_gpu():
    net = nn.Linear(2, 1).to("cuda:0")
    with torch.cuda.device(0):
        rm = replicate_model(lambda m, x, y: None, net, devices=["cuda", "cuda:0"])
    assert rm.devices == [torch.device("cuda", 0)] * 2
    assert rm.towers[1] is net and rm.towers[0] is not net  # one shared tower, one replica


def sparse_towers(devices: list[str]) -> None:
    emb = nn.Embedding(5, 3, sparse=True).double().to(devices[0])
    start = emb.weight.detach().cpu().clone()
    opt = TowerOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5))

    def model_fn(mod, ids, _):
        loss = mod(ids).sum()
        pairs = opt.compute_gradients(loss)
        assert pairs[0][0].is_sparse and pairs[0][0].device == ids.device
        opt.apply_gradients(pairs)
        return loss

    ids = torch.tensor([1, 1, 2, 1, 4, 4])
    replicate_model(model_fn, emb, loss_reduction="sum", devices=devices)(ids, None)
    counts = torch.bincount(ids, minlength=5).double()
    # every gradient entry is 1: sums, concatenation and the update are exact on any device
    torch.testing.assert_close(
        emb.weight.detach().cpu(), start - 0.5 * counts[:, None], rtol=0, atol=0
    )


@needs_gpu
def test_sparse_gradients_on_one_gpu():
    sparse_towers(["cuda:0", "cuda:0"])


@needs_two_gpus
def test_sparse_gradients_on_two_gpus():
    sparse_towers(["cuda:0", "cuda:1"])
