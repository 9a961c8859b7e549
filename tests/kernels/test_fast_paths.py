"""Every optimizer's foreach and fused paths against its per-parameter reference loop.

Each case runs 10 steps on two param groups (float32 and float64) holding a zero-size
parameter, a parameter whose gradient is None at some steps, and a group whose gradients
are all None at some steps, and compares every parameter, every slot and the non-slot
state after every step.  Optimizers come from ``gradfleet.optimizers.ALL`` and their
configs from the conformance specs, so new optimizers are covered automatically.

Fused compiles once per bucket signature, which is slow, so fused runs each optimizer's
first config only (the foreach runs cover the others through the same ``_apply_dense``),
and only the optimizers in ``PARTIAL_NONE_FUSED`` also lose one parameter's gradient
inside a bucket (every optimizer does so on the foreach path).

Tolerances: foreach must be bit-identical (on CPU each ``_foreach_*`` op runs the same ATen
kernel per tensor).  fused may differ in the last bits (see ``gradfleet/kernels``): float32
rtol 2e-6 / atol 2e-7 (a few ulps after 10 steps), float64 rtol 1e-12 / atol 1e-14, the
conformance suite's tolerances.
"""

from __future__ import annotations

import pytest
import torch
from benchmarks.optimizers.optimizer_speed import peak_extra_mib

import gradfleet as gf
from gradfleet.kernels import _torch_private as private
from gradfleet.kernels import fused
from tests.conformance.specs import SPECS
from tests.conformance.specs_returnn import SPECS as RETURNN_SPECS

STEPS = 10
# (70, 64) is above fused.SMALL_NUMEL: the float32 bucket runs as two CPU kernels (small
# parameters single-threaded, the rest on OpenMP), so both kinds are checked.
SHAPES32 = [(5, 3), (0,), (7,), (70, 64)]
SHAPES64 = [(4, 2), (3,)]
FUSED_TOL = {torch.float32: (2e-6, 2e-7), torch.float64: (1e-12, 1e-14)}
PARTIAL_NONE_FUSED = {"AdamOptimizer", "MomentumOptimizer", "CustomAdamOptimizer"}
_SPECS = {spec.cls: spec for spec in SPECS + RETURNN_SPECS}


def _configs(cls) -> list[tuple[str, dict]]:
    spec = _SPECS.get(cls)
    configs = spec.configs if spec else [{"learning_rate": 0.1}]
    return [(f"{cls.__name__}-c{i}", dict(c)) for i, c in enumerate(configs)]


def _build(cls, groups, config, **options):
    spec = _SPECS.get(cls)
    if spec is not None and spec.make is not None:
        opt = spec.make(groups, dict(config))
        for group in opt.param_groups:
            group.update(options)
        return opt
    return cls(groups, **config, **options)


def _run(cls, config, partial_none=True, device="cpu", **options) -> list[list[torch.Tensor]]:
    """Snapshots of (params, state tensors, non-slot tensors) after every step, on the CPU.

    Values are drawn on the CPU and moved to ``device``: every device sees the same numbers.
    """
    gen = torch.Generator().manual_seed(1234)

    def draw(shape, dtype=torch.float32):
        return torch.randn(shape, generator=gen, dtype=dtype).to(device)

    p32 = [torch.nn.Parameter(draw(s)) for s in SHAPES32]
    p64 = [torch.nn.Parameter(draw(s, torch.float64)) for s in SHAPES64]
    opt = _build(cls, [{"params": p32}, {"params": p64}], config, **options)
    snapshots = []
    for step in range(STEPS):
        for p in p32 + p64:
            p.grad = draw(p.shape, p.dtype)
        if partial_none and step in (3, 4):  # one parameter of a bucket without a gradient
            p32[2].grad = None
        if step in (6, 7):  # a whole group without gradients
            for p in p64:
                p.grad = None
        opt.step()
        snapshots.append(_snapshot(opt))
    return snapshots


def _snapshot(opt) -> list[torch.Tensor]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(p.detach().cpu().clone())
            state = opt.state.get(p, {})
            out.extend(state[k].cpu().clone() for k in sorted(state) if torch.is_tensor(state[k]))
        out.extend(v.cpu().clone() for _, v in sorted(group["non_slot"].items()))
    return out


def _compare(ref, got, exact: bool) -> None:
    for step, (r, g) in enumerate(zip(ref, got)):
        assert len(r) == len(g), f"step {step + 1}: different state layout"
        for i, (a, b) in enumerate(zip(r, g)):
            where = f"step {step + 1}, tensor {i}"
            if exact:
                assert torch.equal(a, b), f"{where}: max diff {(a - b).abs().max()}"
            else:
                rtol, atol = FUSED_TOL[a.dtype] if a.is_floating_point() else (0, 0)
                torch.testing.assert_close(
                    b, a, rtol=rtol, atol=atol, msg=lambda detail, at=where: f"{at}: {detail}"
                )


_REFERENCE: dict[str, list] = {}


def _reference(cls, config, partial_none=True):
    name = f"{cls.__name__}{sorted(config.items())}{partial_none}"
    if name not in _REFERENCE:
        _REFERENCE[name] = _run(cls, config, partial_none, foreach=False)
    return _REFERENCE[name]


# BaseCustomOptimizer is abstract (stepping it raises NotImplementedError, tested in
# test_returnn_optimizers.py); every concrete optimizer is covered.
CONCRETE = [cls for cls in gf.optimizers.ALL if cls is not gf.BaseCustomOptimizer]
ALL_CONFIGS = [pytest.param(cls, c, id=n) for cls in CONCRETE for n, c in _configs(cls)]
FIRST_CONFIGS = [pytest.param(cls, _configs(cls)[0][1], id=_configs(cls)[0][0]) for cls in CONCRETE]


@pytest.mark.parametrize("cls,config", ALL_CONFIGS)
def test_foreach_matches_loop_bitwise(cls, config):
    ref = _reference(cls, config)
    _compare(ref, _run(cls, config, foreach=True), exact=True)


@pytest.mark.parametrize("cls,config", ALL_CONFIGS)
def test_default_path(cls, config):
    """The default (foreach=None, fused=None): the loop on CPU (measured faster there, the
    reference's bits); on CUDA the fused kernel where it compiles with eager CUDA's numbers,
    else foreach (the rule itself: ``test_default_path_rule``)."""
    opt = _build(cls, [torch.nn.Parameter(torch.zeros(2))], config)
    assert gf.kernels.resolve_path(opt, opt.param_groups[0]) == "loop"
    if torch.cuda.is_available() and "foreach" in cls.fast_paths:
        opt = _build(cls, [torch.nn.Parameter(torch.zeros(2, device="cuda"))], config)
        fused_ok = "fused" in cls.fast_paths and private.fused_by_default_on_cuda()
        want = "fused" if fused_ok else "foreach"
        assert gf.kernels.resolve_path(opt, opt.param_groups[0]) == want


class _Where:
    """A parameter as ``resolve_path`` sees it: only where it lives."""

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda


class _Fast:
    def __init__(self, fast_paths=("foreach", "fused")) -> None:
        self.fast_paths = fast_paths


CUDA, CPU = _Where(True), _Where(False)


@pytest.mark.parametrize(
    "params,flags,fast_paths,compiles,compiling,want",
    [
        ([CPU, CPU], {}, ("foreach", "fused"), True, False, "loop"),
        ([CUDA, CUDA], {}, ("foreach", "fused"), True, False, "fused"),
        ([CUDA, CUDA], {}, ("foreach", "fused"), False, False, "foreach"),  # no Triton, 2.8
        ([CUDA, CPU], {}, ("foreach", "fused"), True, False, "foreach"),  # mixed devices
        ([CUDA], {}, ("foreach",), True, False, "foreach"),  # no fused path
        ([CUDA], {}, ("foreach", "fused"), True, True, "foreach"),  # under torch.compile
        ([CUDA], {"fused": False}, ("foreach", "fused"), True, False, "foreach"),
        ([CUDA], {"foreach": False}, ("foreach", "fused"), True, False, "loop"),
        ([CUDA], {"foreach": True}, ("foreach", "fused"), True, False, "foreach"),
        ([CPU], {"fused": True}, ("foreach", "fused"), False, False, "fused"),
        ([CUDA], {}, (), True, False, "loop"),
    ],
)
def test_default_path_rule(params, flags, fast_paths, compiles, compiling, want, monkeypatch):
    """``resolve_path``'s decision for each kind of group, on any machine: where the
    parameters live, the user's flags, the optimizer's fast paths, whether the fused kernel
    compiles for the GPU with eager numerics, and whether torch.compile is tracing."""
    monkeypatch.setattr(private, "fused_by_default_on_cuda", lambda: compiles)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    group = {"params": params, "foreach": None, "fused": None, **flags}
    assert gf.kernels.resolve_path(_Fast(fast_paths), group) == want


@pytest.mark.compile
@pytest.mark.parametrize("cls,config", FIRST_CONFIGS)
def test_fused_matches_loop(cls, config):
    # A bucket that loses one gradient is a new signature (one more compile), so only a
    # few optimizers run that schedule fused; the rest skip whole groups only.
    partial = cls.__name__ in PARTIAL_NONE_FUSED
    ref = _reference(cls, config, partial)
    _compare(ref, _run(cls, config, partial, fused=True), exact=False)


@pytest.mark.compile
def test_fused_does_not_recompile():
    """Later steps (and a new learning rate) reuse the compiled kernel: no new graph."""
    p = [torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(5))]
    lr = [0.1]
    opt = gf.AdamOptimizer(p, learning_rate=lambda: lr[0], fused=True)
    for _ in range(2):
        for x in p:
            x.grad = torch.randn_like(x)
        opt.step()
    before = fused.compiled_signatures
    for lr[0] in (0.05, 0.01, 0.2):
        for x in p:
            x.grad = torch.randn_like(x)
        opt.step()
    after = fused.compiled_signatures
    assert after == before


def test_fused_and_foreach_together_rejected():
    """At construction (in a param group too), as torch's optimizers refuse it; and at the
    step of a group edited into the conflict afterwards, before anything changes."""
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        gf.AdamOptimizer([w], foreach=True, fused=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        gf.AdamOptimizer([{"params": [w], "foreach": True}], fused=True)
    opt = gf.AdamOptimizer([w], foreach=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "fused": True})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["fused"] = True
    w.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        opt.step()
    assert torch.equal(w.detach(), torch.zeros(2)) and not opt.state


def test_sparse_gradients_take_the_reference_path():
    """A sparse gradient in a fused group is applied by _apply_sparse, never densified."""
    emb = [torch.nn.Parameter(torch.randn(6, 2)), torch.nn.Parameter(torch.randn(3))]
    outs = []
    for options in ({"foreach": False}, {"fused": True}, {"foreach": True}):
        params = [torch.nn.Parameter(x.detach().clone()) for x in emb]
        opt = gf.MomentumOptimizer(params, learning_rate=0.1, momentum=0.9, **options)
        for _ in range(3):
            idx = torch.tensor([[1, 4, 1]])
            params[0].grad = torch.sparse_coo_tensor(idx, torch.ones(3, 2), (6, 2))
            params[1].grad = torch.ones(3)
            opt.step()
        outs.append([x.detach().clone() for x in params])
        assert torch.equal(params[0][0], emb[0][0].detach())  # untouched row: lazy update
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)


# Thread counts for the tests whose reductions torch splits across threads: the summation
# order (and so the rounding) changes with the count; the bounds below hold for any order.
THREADS = [1, 2, 16]


@pytest.fixture(params=THREADS, ids=lambda n: f"{n}threads")
def num_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's gamma_n = n u / (1 - n u), u = eps / 2: the relative error bound of a sum of
    n + 1 terms of one sign added in ANY order (any blocking, any number of threads)."""
    u = torch.finfo(dtype).eps / 2
    return n * u / (1 - n * u)


@pytest.mark.compile
def test_fused_normalized_sgd_blocked_norm_matches_float64(num_threads):
    """NormalizedSGD's fused kernel sums squares in blocks of 4096 (a faster reduction under
    inductor); on tensors longer than a block, with a tail, it still matches float64.

    Bound, element-wise, float32 with u = eps/2 and n elements: the squares and their sum in
    any order are off by at most gamma_n (relative), the root halves that and adds u, the
    division and the learning-rate product add u each, so the update is off by at most
    d = gamma_n / 2 + 3u relative; the subtraction rounds once more: |p - p64| <=
    d |update64| + u |p64|.  The tails hold a large share of each norm (gradient x 30
    there), so a kernel that dropped or doubled a tail would miss by far more than d.
    """
    gen = torch.Generator().manual_seed(7)
    shapes = [(3 * 4096 + 5,), (64, 129), (4096,)]  # tail, 2-D with tail, exactly one block
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * 10 for s in shapes]
    for g in grads[:2]:
        g.view(-1)[-(g.numel() % 4096) :] *= 30
    params = [torch.nn.Parameter(x.clone()) for x in start]
    opt = gf.NormalizedSGD(params, learning_rate=100.0, fused=True)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    u = torch.finfo(torch.float32).eps / 2
    for p, w, g in zip(params, start, grads):
        g64 = g.double()
        update = 100.0 * g64 / g64.square().sum().clamp_min(1e-12).sqrt()
        expected = w.double() - update
        d = _gamma(g.numel(), torch.float32) / 2 + 3 * u
        bound = d * update.abs() + u * expected.abs()
        err = (p.detach().double() - expected).abs()
        assert bool((err <= bound).all()), f"max error/bound {(err / bound).max():.3g}"
        # the tail matters: without it the update differs by far more than the bound
        if g.numel() % 4096:
            head = g64.view(-1)[: g.numel() // 4096 * 4096]
            dropped = 100.0 * g64 / head.square().sum().sqrt()
            assert bool(((dropped - update).abs() > bound).any())


@pytest.mark.compile
def test_fused_follows_gradient_layout_changes():
    """A transposed (non-contiguous) gradient, then a contiguous one, then transposed again:
    the fused step compiles one kernel per layout and matches the loop at every step."""
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(4, 6, generator=gen)
    grads = [torch.randn(6, 4, generator=gen).t(), torch.randn(4, 6, generator=gen)]
    results = []
    for options in ({"foreach": False}, {"fused": True}):
        w = torch.nn.Parameter(start.clone())
        opt = gf.AdamOptimizer([w], learning_rate=0.1, **options)
        snapshots = []
        for g in (grads[0], grads[1], grads[0]):
            w.grad = g
            opt.step()
            snapshots.append(w.detach().clone())
        results.append(snapshots)
    assert not grads[0].is_contiguous()
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)


@pytest.mark.compile
def test_fused_reads_a_caller_owned_global_step_live():
    """AdagradDA with the caller's global_step: the tensor is an input of the compiled kernel,
    not a constant baked in at the first step, so advancing it changes the next step."""
    config = {"learning_rate": 0.1, "l1_regularization_strength": 0.2, "_global_step": "explicit"}
    ref = _reference(gf.AdagradDAOptimizer, config, partial_none=False)
    _compare(ref, _run(gf.AdagradDAOptimizer, config, False, fused=True), exact=False)


class _HiddenTensorSGD(gf.BaseCustomOptimizer):
    """Reads a tensor that is neither a slot nor a hyperparameter (unsupported when fused)."""

    def __init__(self, params, learning_rate, **kwargs):
        super().__init__(params, learning_rate, **kwargs)
        self.scale = torch.tensor(2.0)

    def _apply_var(self, grad, var, indices=None):
        self._assign_sub(var, self._hp["lr"] * self.scale * grad, indices)


def test_fused_refuses_hidden_tensor_state_and_changes_nothing():
    w = torch.nn.Parameter(torch.ones(3))
    opt = _HiddenTensorSGD([w], learning_rate=0.1, fused=True)
    w.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="fused=True needs _apply_dense to trace"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3))
    loop = _HiddenTensorSGD([w], learning_rate=0.1)  # the eager paths read it as usual
    loop.step()
    torch.testing.assert_close(w.detach(), torch.full((3,), 0.8))


@pytest.mark.compile
def test_fused_follows_slot_layout_changes():
    """A slot replaced by a differently strided tensor (e.g. loaded from a checkpoint of a
    transposed model) is part of the kernel's signature: recompiled, still correct."""
    gen = torch.Generator().manual_seed(5)
    start, grad = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    results = []
    for options in ({"foreach": False}, {"fused": True}):
        w = torch.nn.Parameter(start.clone())
        opt = gf.AdamOptimizer([w], learning_rate=0.1, **options)
        w.grad = grad
        opt.step()
        m = opt.state[w]["m"]
        opt.state[w]["m"] = m.t().contiguous().t()  # same values, column-major
        assert opt.state[w]["m"].stride() != m.stride()
        opt.step()
        results.append([w.detach().clone(), opt.state[w]["m"].clone()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize(
    "cls", [gf.AdamOptimizer, gf.FtrlOptimizer, gf.NormalizedSGD, gf.RMSPropOptimizer]
)
@pytest.mark.compile
def test_fused_step_allocates_no_parameter_sized_temporary(cls):
    """The compiled kernel stores straight into parameter and slot memory: a step allocates
    far less than one parameter (NormalizedSGD: only its per-block partial sums)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(256, 96), (3 * 4096 + 7,), (64,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = cls(params, learning_rate=0.01, fused=True)
    for _ in range(2):  # the first step compiles and creates the slots
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    smallest_big = 4 * min(p.numel() for p in params[:2])
    assert peak_extra_mib(opt.step) * 2**20 < smallest_big // 8


def _half_run(cls, dtype, config, steps=5, **options):
    gen = torch.Generator().manual_seed(11)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in [(64, 33), (5000,)]
    ]
    opt = cls(params, **config, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return opt, params


HALF = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
HALF_STEPS = 5


def _half_compare(cls, config, dtype, exact: bool) -> None:
    """The loop and the fused path on float16/bfloat16 for HALF_STEPS steps.

    Exact: the fused kernel rounds every intermediate to the dtype as eager ATen and TF do
    (inductor would otherwise carry them in float32), so it gives the loop's bits.

    Where it cannot (NormalizedSGD's whole-tensor sum is taken in another order; releases
    whose CPU code generator drops the round trips, ``HALF_PRECISION_EXACT`` False: torch <
    2.13), each step may differ by one rounding of the update and one of the stored value,
    eps/2 relative each, of operands no larger than |p| + |update| <= 2|p| + 1 here (lr 0.1,
    standard normal gradients): |fused - loop| <= HALF_STEPS x eps x (2|p| + 1), the bound
    docs/releases.md states for those releases.
    """
    _, ref = _half_run(cls, dtype, config, steps=HALF_STEPS, foreach=False)
    _, got = _half_run(cls, dtype, config, steps=HALF_STEPS, fused=True)
    eps = torch.finfo(dtype).eps
    for a, b in zip(ref, got):
        a, b = a.detach().float(), b.detach().float()
        if exact and private.HALF_PRECISION_EXACT:
            assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} elements differ"
            continue
        bound = HALF_STEPS * eps * (2 * a.abs() + 1)
        err = (a - b).abs()
        assert bool((err <= bound).all()), f"max error/bound {(err / bound).max():.3g}"


@HALF
@pytest.mark.parametrize(
    "cls,config",
    [
        (gf.GradientDescentOptimizer, {"learning_rate": 0.1}),
        (gf.MomentumOptimizer, {"learning_rate": 0.1, "momentum": 0.9}),
        (gf.RMSPropOptimizer, {"learning_rate": 0.01}),
        (gf.FtrlOptimizer, {"learning_rate": 0.1, "l1_regularization_strength": 0.01}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
@pytest.mark.compile
def test_fused_half_precision_rounds_like_the_loop(cls, config, dtype):
    """Element-wise maths: the loop's bits (within the stated bound on torch < 2.13)."""
    _half_compare(cls, config, dtype, exact=True)


@HALF
@pytest.mark.parametrize(
    "cls,config",
    [
        (gf.AdagradOptimizer, {"learning_rate": 0.1}),
        (gf.ProximalAdagradOptimizer, {"learning_rate": 0.1, "l1_regularization_strength": 0.01}),
        (gf.RMSPropOptimizer, {"learning_rate": 0.01}),
        (gf.AdadeltaOptimizer, {"learning_rate": 1.0}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_loop_half_precision_does_not_depend_on_tensor_size(cls, config, dtype):
    """Element-wise maths: a 3-element parameter gets the bits the same values get inside a
    64-element one.  torch's CPU rsqrt on float16/bfloat16 rounds sqrt(x) to the dtype before
    the reciprocal for tensors under 32 elements only; gradfleet's maths rounds once at every
    size, as TF's kernels and the fused kernel do (so the fused path gives the loop's bits)."""
    gen = torch.Generator().manual_seed(12)
    values = torch.randn(64, generator=gen).to(dtype)
    small, big = torch.nn.Parameter(values[:3].clone()), torch.nn.Parameter(values.clone())
    opts = [cls([p], **config, foreach=False) for p in (small, big)]
    for _ in range(HALF_STEPS):
        g = torch.randn(64, generator=gen).to(dtype)
        small.grad, big.grad = g[:3].clone(), g.clone()
        for opt in opts:
            opt.step()
        assert torch.equal(small.detach(), big.detach()[:3])


@pytest.mark.compile
@HALF
def test_fused_half_precision_normalized_sgd_within_bound(dtype, num_threads):
    """NormalizedSGD sums 5000 squares in float32 in another order (one that depends on the
    thread count): off by at most gamma_5000 = 3e-4 relative, far below half precision's
    eps, so its rounded norm is the loop's or one ulp away: within ``_half_compare``'s
    bound for any thread count."""
    _half_compare(gf.NormalizedSGD, {"learning_rate": 0.1}, dtype, exact=False)


@pytest.mark.compile
def test_fused_bucket_of_only_empty_parameters():
    """A dtype bucket whose only parameter is zero-size has nothing to compile; the other
    bucket still steps, as on the loop."""
    results = []
    for options in ({"foreach": False}, {"fused": True}):
        empty = torch.nn.Parameter(torch.zeros(0))
        w = torch.nn.Parameter(torch.arange(3, dtype=torch.float64))
        opt = gf.AdamOptimizer([empty, w], learning_rate=0.1, **options)
        empty.grad, w.grad = torch.zeros(0), torch.ones(3, dtype=torch.float64)
        opt.step()
        results.append(w.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-14)
