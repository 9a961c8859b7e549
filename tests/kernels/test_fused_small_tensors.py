"""The fused path's split of a CPU bucket: small parameters (biases, norm weights) in a
single-threaded kernel of their own, the rest in the OpenMP kernel (``fused.run_fused``).

That both kernels give the reference loop's results for every optimizer is checked by
``tests/kernels/test_fast_paths.py`` (its float32 bucket mixes both kinds); here: which parameters
go where, and that each kernel is compiled once with the threading it is meant to have.
"""

from __future__ import annotations

import pytest
import torch

import gradfleet as gf
from gradfleet.kernels import fused


def _zeros(*sizes: int, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(n, device=device) for n in sizes]


def test_small_parameters_are_those_up_to_the_size_limit():
    n = fused.SMALL_NUMEL
    params = _zeros(n + 1, 3, n, 10 * n, 1)
    assert fused.small_parameters(params) == [1, 2, 4]


def test_small_parameters_stop_at_the_budget(monkeypatch):
    """Many mid-sized tensors never all lose the threads: past the budget they stay in the
    parallel kernel."""
    monkeypatch.setattr(fused, "SMALL_BUDGET", 10)
    assert fused.small_parameters(_zeros(4, 4, 4, 2)) == [0, 1, 3]


def test_small_parameters_only_on_cpu():
    assert fused.small_parameters(_zeros(3, 5, device="meta")) == []


@pytest.mark.compile
def test_mixed_bucket_compiles_a_single_threaded_and_a_parallel_kernel(monkeypatch):
    compiled = []
    compile_step = fused.compile_step

    def spy(opt, params, grads, slots, hp, shared, single_thread=False):
        compiled.append(([p.numel() for p in params], single_thread))
        return compile_step(opt, params, grads, slots, hp, shared, single_thread)

    monkeypatch.setattr(fused, "compile_step", spy)
    big = fused.SMALL_NUMEL + 8
    params = [torch.nn.Parameter(torch.randn(n)) for n in (16, big, 32)]
    opt = gf.AdamOptimizer(params, learning_rate=0.1, fused=True)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert sorted(compiled) == [([16, 32], True), ([big], False)]


@pytest.mark.compile
def test_all_small_bucket_is_one_single_threaded_kernel(monkeypatch):
    flags = []
    compile_step = fused.compile_step

    def spy(opt, params, grads, slots, hp, shared, single_thread=False):
        flags.append(single_thread)
        return compile_step(opt, params, grads, slots, hp, shared, single_thread)

    monkeypatch.setattr(fused, "compile_step", spy)
    start = [torch.randn(n) for n in (16, 32)]
    params = [torch.nn.Parameter(x.clone()) for x in start]
    opt = gf.GradientDescentOptimizer(params, learning_rate=0.5, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert flags == [True]
    for p, x in zip(params, start):  # x - 0.5 * 1: exact in float32 for these magnitudes
        torch.testing.assert_close(p.detach(), x - 0.5, rtol=0, atol=2 * 2**-24 * 8)
