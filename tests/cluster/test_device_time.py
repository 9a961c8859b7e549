"""The cluster benchmark's emulated accelerator time (``--device-time``): the same model and
numbers, plus sleeps in forward and backward during which the CPU is free."""

from __future__ import annotations

import time

import torch
from benchmarks.cluster.cluster_worker import DeviceTime, build_model


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], float, float]:
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    loss = model(x).square().mean()
    forward = time.perf_counter() - start
    loss.backward()
    total = time.perf_counter() - start
    return loss.detach(), [p.grad for p in model.parameters()], forward, total


def test_device_time_changes_no_number_and_adds_its_sleeps():
    plain, timed = build_model(2e4, 0), build_model(2e4, 0, device_time=0.4)
    assert sum(isinstance(m, DeviceTime) for m in timed) == 4  # one after every Linear
    for a, b in zip(plain.parameters(), timed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    loss, grads, _, _ = _run(plain)
    timed_loss, timed_grads, forward, total = _run(timed)
    torch.testing.assert_close(timed_loss, loss, rtol=0, atol=0)
    for a, b in zip(timed_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # sleeps last at least as long as asked: a third of 0.4 s in forward, all of it in total
    assert forward >= 0.4 / 3 and total >= 0.4
