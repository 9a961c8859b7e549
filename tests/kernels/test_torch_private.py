"""The adapter over torch's private entry points: a release without one gets a clear error
naming it, before anything is traced or any parameter changes."""

from __future__ import annotations

import pytest
import torch

import gradfleet as gf
from gradfleet.kernels import _torch_private as private
from gradfleet.kernels import fused


def _fused_step_error():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = gf.GradientDescentOptimizer([p], learning_rate=0.5, fused=True)
    with pytest.raises(private.TorchPrivateAPIError) as err:
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))  # nothing changed
    return str(err.value)


def test_every_option_the_fused_path_sets_exists_on_this_release():
    config = private.inductor_config()
    assert {*fused._OPTIONS, *fused._SINGLE_THREAD} == set(private.INDUCTOR_OPTIONS)
    assert all(hasattr(config, name) for name in private.INDUCTOR_OPTIONS)
    assert all(hasattr(config, name) for name in fused.CUDA_OPTIONS)  # combo_kernels


def test_cuda_kernels_divide_with_ieee_rounding_where_torch_can():
    """Triton's ``/`` is approximate (up to 2 ulp); the CUDA kernels ask inductor for
    correctly rounded division under whichever name this release gives the option."""
    option = private.exact_division_option()
    config = private.inductor_config()
    known = ("eager_numerics.division_rounding", "emulate_divison_rounding")
    if any(hasattr(config, name) for name in known):
        assert len(option) == 1
        ((name, value),) = option.items()
        assert value is True and hasattr(config, name)
        assert getattr(config, name) is False  # off unless a kernel asks for it
    else:
        assert option == {}  # torch 2.8: approximate division on CUDA (docs/releases.md)
    if torch.__version__ >= "2.10":
        assert option  # every release from 2.10 has one of the two spellings


def test_unknown_inductor_option_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(fused._OPTIONS, "no_such_option", True)
    msg = _fused_step_error()
    assert "inductor config option(s) no_such_option" in msg
    assert f"torch {torch.__version__} does not have" in msg and "foreach=True" in msg


def test_missing_compiler_entry_point_is_a_clear_error(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    monkeypatch.delattr(compile_fx, "compile_fx_inner")
    msg = _fused_step_error()
    assert "torch._inductor.compile_fx.compile_fx_inner" in msg
    assert "checked on torch" in msg


def test_missing_tracer_is_a_clear_error(monkeypatch):
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    monkeypatch.delattr(proxy_tensor, "make_fx")
    assert "torch.fx.experimental.proxy_tensor.make_fx" in _fused_step_error()


_COMPILE_IN_A_NEW_PROCESS = """
import torch
from torch._dynamo.utils import counters

import gradfleet as gf

gen = torch.Generator().manual_seed(7)
params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(40, 30), (30,), (9,)]]
for p in params:
    p.grad = torch.randn(p.shape, generator=gen)
gf.AdamOptimizer(params, learning_rate=0.01, fused=True).step()
print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
print(*(float.hex(x) for p in params for x in p.detach().flatten()[:5].tolist()))
"""


@pytest.mark.compile
@pytest.mark.timeout(700)  # two processes, each up to 300 s: torch's import and a compile
def test_a_new_process_takes_the_fused_kernel_from_inductors_disk_cache(tmp_path):
    """The first fused step of a process compiles; the next process with the same maths and
    tensors loads the kernel from inductor's FX graph cache instead (no "No shape env" bypass:
    the graph is compiled in a tracing context, as AOTAutograd does), with the same result."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", _COMPILE_IN_A_NEW_PROCESS],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout.splitlines()
        runs.append((out[0].split(), out[1]))
    (first_counts, first_values), (second_counts, second_values) = runs
    assert first_counts == ["0", "1"]  # compiled, and stored
    assert second_counts == ["1", "0"]  # loaded, not compiled
    assert second_values == first_values
