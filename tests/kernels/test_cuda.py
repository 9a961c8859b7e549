"""Every optimizer's loop, foreach and fused paths on CUDA against the CPU reference loop.

Skipped, with the reason, where CUDA is not available (CI has no GPU); run them on a GPU
machine with ``pytest -q tests/kernels/test_cuda.py``.

Dense: the schedule of ``tests/kernels/test_fast_paths.py`` (10 steps; a float32 and a float64
group; a zero-size parameter; a group without gradients at some steps; on the loop and
foreach paths, and for ``PARTIAL_NONE_FUSED`` on the fused path, one parameter without a
gradient inside a bucket), with the same numbers drawn on the CPU and moved to the GPU.
After every step each parameter, slot and non-slot value is compared with the CPU reference
loop (``foreach=False``) run on the same numbers:

* float64 group: within (rtol 1e-12, atol 1e-14), the float64 ``FUSED_TOL``: the maths is the
  same, only the last bits of sqrt/rsqrt/division/exp differ between CPU and GPU libraries
  (a few float64 ulps, 1.1e-16 each, over 10 steps);
* float32 group: within (rtol 2e-6, atol 2e-7), the float32 ``FUSED_TOL``: ATen's CUDA
  kernels and Triton round float32 division, square roots and exponentials within 1-2 ulps
  (6e-8 each) where the CPU loop rounds correctly or within 1 ulp, a few per step, carried
  over 10 steps: a few tens of ulps at most.

Sparse: ``_apply_sparse`` on CUDA (scatter-adds with duplicate indices, whose atomics add
in any order) against the CPU loop on the same gradients, in every path (sparse gradients
always take ``_apply_sparse``; the dense parameter beside them takes the path).

The default path on CUDA (the fused kernel where it keeps eager CUDA's numbers) against
``fused=True``, bit for bit; and CUDA graphs: every optimizer's ``step()`` on every path,
captured and replayed, against the same steps run eagerly, also with a device lr tensor that
changes between replays.
"""

from __future__ import annotations

import pytest
import torch

import gradfleet as gf
from gradfleet.kernels import _torch_private as private
from gradfleet.kernels import fused
from tests.kernels.test_fast_paths import (
    FIRST_CONFIGS,
    FUSED_TOL,
    PARTIAL_NONE_FUSED,
    SHAPES32,
    SHAPES64,
    _build,
    _compare,
    _reference,
    _run,
    _snapshot,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available (no GPU or a CPU-only torch)"
)
PATHS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _options(cls, path: str) -> dict:
    if path != "loop" and path not in cls.fast_paths:
        pytest.skip(f"{cls.__name__} has no {path} path (fast_paths={cls.fast_paths})")
    return PATHS[path]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("cls,config", FIRST_CONFIGS)
def test_cuda_path_matches_cpu_loop(cls, config, path):
    options = _options(cls, path)
    partial = path != "fused" or cls.__name__ in PARTIAL_NONE_FUSED
    ref = _reference(cls, config, partial)
    _compare(ref, _run(cls, config, partial, device="cuda", **options), exact=False)


@pytest.mark.parametrize("cls,config", FIRST_CONFIGS)
def test_cuda_fused_with_combo_kernels_switched_matches_cpu_loop(cls, config, monkeypatch):
    """The fused path with inductor's horizontal fusion of the parameters' kernels
    (``combo_kernels``) the other way round from this release's default (on from torch 2.11,
    off before): the same bound either way."""
    _options(cls, "fused")
    default = fused.CUDA_OPTIONS.get("combo_kernels", False)
    monkeypatch.setitem(fused.CUDA_OPTIONS, "combo_kernels", not default)
    ref = _reference(cls, config, partial_none=False)
    _compare(ref, _run(cls, config, False, device="cuda", fused=True), exact=False)


def _sparse_specs():
    from tests.conformance.specs import SPECS
    from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS

    out = []
    for spec in SPECS + RETURNN_SPECS:
        if "sparse_duplicates" in spec.modes and spec.cls is not gf.BaseCustomOptimizer:
            out.append(pytest.param(spec.cls, dict(spec.configs[0]), id=spec.name))
    return out


def _sparse_run(cls, config, device: str, dtype: torch.dtype, options: dict):
    """5 steps on an embedding with sparse gradients (duplicate rows) and a dense bias."""
    gen = torch.Generator().manual_seed(99)
    emb = torch.nn.Parameter(torch.randn(8, 3, generator=gen, dtype=dtype).to(device))
    bias = torch.nn.Parameter(torch.randn(3, generator=gen, dtype=dtype).to(device))
    opt = _build(cls, [emb, bias], config, **options)
    for _ in range(5):
        idx = torch.tensor([[1, 4, 1, 6, 4]])
        values = torch.randn(5, 3, generator=gen, dtype=dtype)
        emb.grad = torch.sparse_coo_tensor(idx, values, (8, 3)).to(device)
        bias.grad = torch.randn(3, generator=gen, dtype=dtype).to(device)
        opt.step()
    out = [emb.detach().cpu(), bias.detach().cpu()]
    for p in (emb, bias):
        state = opt.state[p]
        out.extend(state[k].cpu() for k in sorted(state) if torch.is_tensor(state[k]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("cls,config", _sparse_specs())
def test_cuda_sparse_gradients_match_cpu_loop(cls, config, path, dtype):
    options = _options(cls, path)
    ref = _sparse_run(cls, config, "cpu", dtype, PATHS["loop"])
    got = _sparse_run(cls, config, "cuda", dtype, options)
    rtol, atol = FUSED_TOL[dtype]
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=f"tensor {i}")


def test_cuda_default_path_is_the_fused_kernel():
    """Without ``fused=``/``foreach=`` a CUDA group takes the fused kernel (where Triton and
    correctly rounded division are there; torch 2.8 keeps foreach): the same compiled maths
    as ``fused=True``, so the same bits, step after step."""
    cls, config = gf.AdamOptimizer, {"learning_rate": 0.01}
    opt = _build(cls, [torch.nn.Parameter(torch.zeros(2, device="cuda"))], config)
    want = "fused" if private.fused_by_default_on_cuda() else "foreach"
    assert gf.kernels.resolve_path(opt, opt.param_groups[0]) == want
    default = _run(cls, config, partial_none=False, device="cuda")
    explicit = _run(cls, config, partial_none=False, device="cuda", **PATHS[want])
    _compare(explicit, default, exact=True)


# CUDA graphs: ``step()`` captured once and replayed, as RETURNN's engine and torch's
# ``capturable`` users run it.  A replay runs only the recorded kernels, so every counter the
# maths reads (beta powers, AMSGrad's t, AdagradDA's step) must live on the device and be
# advanced by a kernel; anything kept or decided on the host would freeze at its captured value.
WARMUP, REPLAYS = 3, 4


def _graph_run(cls, config, options, capture: bool, lrs=None) -> list[torch.Tensor]:
    """``WARMUP`` eager steps then ``REPLAYS`` more, replayed from one captured step (or eager
    where ``capture`` is False), on the float32 and float64 groups of ``_run``; ``lrs``: a value
    per step for the first group's lr, held in a 0-dim CUDA tensor updated in place."""
    gen = torch.Generator().manual_seed(4321)

    def draw(shape, dtype=torch.float32):
        return torch.randn(shape, generator=gen, dtype=dtype).to("cuda")

    p32 = [torch.nn.Parameter(draw(s)) for s in SHAPES32]
    p64 = [torch.nn.Parameter(draw(s, torch.float64)) for s in SHAPES64]
    opt = _build(cls, [{"params": p32}, {"params": p64}], config, **options)
    params = p32 + p64
    for p in params:  # static gradients: a replay reads them where the capture did
        p.grad = torch.zeros_like(p)
    lr = None
    if lrs is not None:
        lr = torch.tensor(lrs[0], device="cuda")
        opt.param_groups[0]["lr"] = lr

    def feed(step: int) -> None:
        for p in params:
            p.grad.copy_(draw(p.shape, p.dtype))
        if lr is not None:
            lr.fill_(lrs[step])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for step in range(WARMUP):
            feed(step)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    if capture:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
    for step in range(WARMUP, WARMUP + REPLAYS):
        feed(step)
        graph.replay() if capture else opt.step()
    torch.cuda.synchronize()
    return _snapshot(opt)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("cls,config", FIRST_CONFIGS)
def test_cuda_graph_replay_of_step_matches_eager_steps(cls, config, path):
    """Every optimizer and path: a captured ``step()`` replayed equals the same steps run
    eagerly (loop and foreach: the same kernels, so the same bits; fused: the kernel is
    compiled again for the eager run, within the fused tolerance)."""
    options = _options(cls, path)
    eager = _graph_run(cls, config, options, capture=False)
    replayed = _graph_run(cls, config, options, capture=True)
    _compare([eager], [replayed], exact=path != "fused")


@pytest.mark.parametrize("path", list(PATHS))
def test_cuda_graph_replay_follows_a_device_lr_tensor(path):
    """RETURNN's ``use_device_lr_tensors``: the lr is a 0-dim CUDA tensor changed in place
    between replays; each replay uses the value it holds then (Adam, a new lr every step)."""
    lrs = [0.1 * 0.7**k for k in range(WARMUP + REPLAYS)]
    options = _options(gf.AdamOptimizer, path)
    eager = _graph_run(gf.AdamOptimizer, {"learning_rate": 0.1}, options, False, lrs)
    replayed = _graph_run(gf.AdamOptimizer, {"learning_rate": 0.1}, options, True, lrs)
    _compare([eager], [replayed], exact=path != "fused")
    constant = [lrs[0]] * len(lrs)
    frozen = _graph_run(gf.AdamOptimizer, {"learning_rate": 0.1}, options, False, constant)
    assert not torch.equal(frozen[0], replayed[0])  # the lr did change the steps
