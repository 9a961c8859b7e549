"""DTensor parameters and gradients on every path: 16 optimizers x 3 paths on 2 gloo ranks.

One 2-rank job runs the whole matrix (process launches and the fused compiles dominate the
cost): every concrete optimizer, on the loop, foreach and fused paths, steps parameters
distributed ``Shard(0)`` (uneven: 5 rows over 2 ranks), ``Shard(1)`` and ``Replicate`` with
DTensor gradients, and is compared after every step with the same optimizer on the full
plain tensors in the same process (the reference loop).  Every case is asserted and every
failing case is reported.  The same job checks that no tensor subclass ever reaches a
compiled kernel (the compiled call is instrumented), a tensor-parallel ``ColwiseParallel``
layer, and that sparse gradients for DTensor parameters are refused with a clear error.

Tolerances: the loop and foreach paths run the same ATen kernels on each shard as on the
whole tensor, so elementwise optimizers are bit-identical; NormalizedSGD's norm sums in
another order (per shard, then across ranks), and the fused path may differ in the last
bits (``gradfleet/kernels``): float32 rtol 2e-6 / atol 2e-7, tests/kernels/test_fast_paths.py's
fused tolerance (a few ulps after a few steps).
"""

from __future__ import annotations

import pytest
import torch

import gradfleet as gf
from gradfleet.distributed.testing import run_ranks
from gradfleet.kernels import PATHS, fused
from tests.conformance.specs import SPECS
from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS

STEPS = 3
TOL = (2e-6, 2e-7)
CONCRETE = [cls for cls in gf.optimizers.ALL if cls is not gf.BaseCustomOptimizer]
PATH_OPTIONS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# Maths that reduces over the whole tensor: summed in another order when sharded.
REDUCING = {"NormalizedSGD"}
_SPECS = {spec.cls: spec for spec in SPECS + RETURNN_SPECS}


def build(cls, params, **options):
    """``cls`` with its first conformance config (how test_fast_paths builds it)."""
    spec = _SPECS.get(cls)
    config = dict(spec.configs[0]) if spec else {"learning_rate": 0.1}
    if spec is not None and spec.make is not None:
        opt = spec.make(params, config)
        for group in opt.param_groups:
            group.update(options)
        return opt
    return cls(params, **config, **options)


def _layouts():
    from torch.distributed.tensor import Replicate, Shard

    return [((5, 3), [Shard(0)]), ((2, 6), [Shard(1)]), ((4,), [Replicate()])]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(opt):
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(_full(p.detach()).clone())
            state = opt.state.get(p, {})
            out.extend(_full(state[k]).clone() for k in sorted(state) if torch.is_tensor(state[k]))
        out.extend(v.clone() for _, v in sorted(group["non_slot"].items()))
    return out


def _run_case(cls, mesh, sharded: bool, options) -> list[list[torch.Tensor]]:
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(1234)  # the same numbers on every rank
    layouts = _layouts()
    start = [torch.randn(shape, generator=gen) for shape, _ in layouts]
    if sharded:
        params = [
            torch.nn.Parameter(distribute_tensor(x, mesh, pl)) for x, (_, pl) in zip(start, layouts)
        ]
    else:
        params = [torch.nn.Parameter(x) for x in start]
    opt = build(cls, params, **options)
    snapshots = []
    for _ in range(STEPS):
        for p, (shape, pl) in zip(params, layouts):
            g = torch.randn(shape, generator=gen)
            p.grad = distribute_tensor(g, mesh, pl) if sharded else g
        opt.step()
        snapshots.append(_snapshot(opt))
    return snapshots


def _compare(ref, got, exact: bool) -> str | None:
    for step, (r, g) in enumerate(zip(ref, got)):
        if len(r) != len(g):
            return f"step {step + 1}: different state layout"
        for i, (a, b) in enumerate(zip(r, g)):
            where = f"step {step + 1}, tensor {i}"
            if exact and not torch.equal(a, b):
                return f"{where}: not bit-identical, max diff {(a - b).abs().max()}"
            if not exact and not torch.allclose(b, a, rtol=TOL[0], atol=TOL[1]):
                return f"{where}: max diff {(a - b).abs().max()}"
    return None


def _instrument_compiled_calls(seen: list[str]):
    """Wrap every compiled kernel so that its inputs' types are recorded."""
    original = fused.compile_step

    def compile_step(*args, **kwargs):
        compiled = original(*args, **kwargs)

        def call(flat):
            seen.extend(type(t).__name__ for t in flat)
            return compiled(flat)

        return call

    fused.compile_step = compile_step


def matrix_rank(ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    seen: list[str] = []
    _instrument_compiled_calls(seen)
    failures = {}
    for cls in CONCRETE:
        ref = _run_case(cls, mesh, False, {"foreach": False})
        for path in PATHS:
            case = f"{cls.__name__}/{path}"
            try:
                got = _run_case(cls, mesh, True, PATH_OPTIONS[path])
            except Exception as exc:  # reported per case; the matrix goes on
                failures[case] = f"{type(exc).__name__}: {exc}"[:500]
                continue
            exact = path != "fused" and cls.__name__ not in REDUCING
            problem = _compare(ref, got, exact)
            if problem:
                failures[case] = problem
    return {
        "failures": failures,
        "kernel_input_types": sorted(set(seen)),
        "colwise": _colwise_parallel(mesh),
        "sparse": _sparse_refused(mesh),
        "check_finite": _nan_in_one_shard(mesh),
    }


def _colwise_parallel(mesh) -> dict:
    """A ``ColwiseParallel`` linear layer trained on each path equals the unsharded layer."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    out = {}
    for path, options in PATH_OPTIONS.items():
        torch.manual_seed(0)
        full = torch.nn.Linear(4, 6)
        tp = parallelize_module(torch.nn.Linear(4, 6), mesh, ColwiseParallel())
        with torch.no_grad():
            tp.weight.copy_(_as_dtensor(full.weight, tp.weight))
            tp.bias.copy_(_as_dtensor(full.bias, tp.bias))
        results = []
        for model in (full, tp):
            opt = gf.AdamOptimizer(model.parameters(), learning_rate=0.1, **options)
            gen = torch.Generator().manual_seed(5)
            for _ in range(STEPS):
                x = torch.randn(8, 4, generator=gen)
                opt.zero_grad()
                y = model(x)
                (_full(y) ** 2).mean().backward()
                opt.step()
            results.append([_full(p.detach()) for p in model.parameters()])
        out[path] = max(float((a - b).abs().max()) for a, b in zip(*results))
    return out


def _as_dtensor(full, like):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach(), like.device_mesh, like.placements)


def _sparse_refused(mesh) -> str:
    from torch.distributed.tensor import Shard, distribute_tensor

    p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    opt = gf.AdagradOptimizer([p], learning_rate=0.1)
    g = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 2), (4, 2))
    before = p.detach().full_tensor().clone()
    try:
        opt.apply_gradients([(g, p)])
    except (TypeError, ValueError) as exc:
        unchanged = torch.equal(p.detach().full_tensor(), before) and not opt.state
        return f"{type(exc).__name__}: {exc} (unchanged: {unchanged})"
    return "accepted"


def _nan_in_one_shard(mesh) -> str:
    """check_finite=True: a NaN in rank 1's shard only must stop the step on every rank."""
    from torch.distributed.tensor import Shard, distribute_tensor

    p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    opt = gf.AdamOptimizer([p], learning_rate=0.1, check_finite=True)
    g = torch.ones(4, 2)
    g[3, 1] = float("nan")
    p.grad = distribute_tensor(g, mesh, [Shard(0)])
    try:
        opt.step()
    except FloatingPointError:
        return "raised" if torch.equal(p.detach().full_tensor(), torch.ones(4, 2)) else "changed"
    return "stepped"


@pytest.mark.compile
@pytest.mark.timeout(600)
def test_dtensor_matrix_every_optimizer_every_path():
    before = fused.compiled_signatures
    # every optimizer's fused kernels compiled in both ranks: CPU-bound, and CI's second
    # stage runs beside two pip installs (360 s was exceeded on a VM with CPU stolen)
    result = run_ranks(matrix_rank, 2, timeout=540, pg_timeout=120)
    assert fused.compiled_signatures == before  # the compiles happened in the ranks
    for rank, out in enumerate(result):
        failures = out["failures"]
        assert not failures, f"rank {rank}: {len(failures)}/48 cases fail:\n" + "\n".join(
            f"  {case}: {why}" for case, why in sorted(failures.items())
        )
        # Only plain tensors (and Parameters) ever reached a compiled kernel.
        assert out["kernel_input_types"] == ["Parameter", "Tensor"] or out[
            "kernel_input_types"
        ] == ["Tensor"], out["kernel_input_types"]
        for path, diff in out["colwise"].items():
            assert diff <= 1e-5, f"ColwiseParallel on {path}: max diff {diff}"
        assert out["check_finite"] == "raised"
        assert "sparse gradients" in out["sparse"] and out["sparse"].endswith(
            "(unchanged: True)"
        ), out["sparse"]


class _Tagged(torch.Tensor):
    """A tensor subclass that is not a DTensor."""


def test_fused_refuses_other_tensor_subclasses_and_changes_nothing():
    plain = torch.nn.Parameter(torch.randn(4))
    tagged = torch.nn.Parameter(torch.randn(3).as_subclass(_Tagged))
    before = [plain.detach().clone(), tagged.detach().clone()]
    opt = gf.AdamOptimizer([plain, tagged], learning_rate=0.1, fused=True)
    plain.grad, tagged.grad = torch.ones(4), torch.ones(3).as_subclass(_Tagged)
    with pytest.raises(TypeError, match="fused=True compiles for plain dense tensors.*_Tagged"):
        opt.step()
    assert torch.equal(plain.detach(), before[0]) and torch.equal(tagged.detach(), before[1])
    assert not opt.state
