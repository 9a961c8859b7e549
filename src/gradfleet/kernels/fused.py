"""The fused path: one inductor kernel per (device, dtype) bucket of parameters (two on CPU).

How a bucket's step is compiled (once per signature, then cached on the optimizer):

1. The optimizer's own ``_apply_dense`` runs for every parameter of the bucket on fake
   tensors under ``make_fx`` + ``functionalize`` (with inductor's decompositions, as
   AOTAutograd would apply them): one functional FX graph whose in-place updates become
   ``copy_`` back into the parameter and slot inputs.
2. Each ``copy_`` is moved up to where its value is ready (``_store_in_order``), so the
   kernel finishes one parameter before it starts the next: a parameter's gradient is
   still in cache when its update reads it again after a whole-tensor reduction
   (NormalizedSGD's norm; 6.5 -> 5.5 ms a step on the benchmark's tensors).
3. Inductor's graph compiler (``compile_fx_inner``, the stage AOTAutograd hands inference
   graphs to) turns it into one kernel (C++/OpenMP on CPU, Triton on GPU) that reads each
   input once and stores straight into parameter and slot memory.  Going through
   ``torch.compile`` or ``torch._inductor.compile`` instead would re-run AOTAutograd,
   which moves every store back to the end of the graph.

On CPU, a bucket's small parameters (at most ``SMALL_NUMEL`` elements each, biases and norm
weights) get a kernel of their own that runs on the calling thread.  In one OpenMP kernel each
parameter's loop ends in a barrier (``omp for`` / ``omp single``), so 60 biases cost 60
thread synchronisations a step for a few microseconds of work, and on a loaded machine every
barrier waits for a descheduled thread; ATen's own kernels (torch's fused Adam) run such
tensors on one thread too (below its parallel grain size).

Later steps call the compiled function directly with the same tensors in the same order.
There is no dynamo frame in between, so no guards: ``signature`` is the complete cache key
and is computed every step (a dynamo call costs about 0.4 ms more per step once an
optimizer step's worth of memory traffic has evicted the caches, which for a light
optimizer is a tenth of its step).  Hyperparameters and shared state are 0-dim tensor
inputs, so a new learning rate does not recompile; Python flags are part of the key.
Any tensor ``_apply_dense`` reads that is not an input (hidden state on ``self``) makes
tracing fail with a clear error instead of being baked into the kernel.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

# Inductor, dynamo and make_fx load on the first fused step (seconds of import), through
# the adapter that holds every private torch entry point.
from gradfleet.kernels import _torch_private as private

# Compiled steps per optimizer instance (the traced maths may read the instance's Python
# configuration), keyed by ``signature``; entries die with the optimizer.
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
_OPTIONS = {
    # The per-call size/stride/alignment asserts repeat what ``signature`` checked.
    "size_asserts": False,
    "alignment_asserts": False,
    # Inductor fuses loops that share reads worth >= this many bytes.  At its default (10)
    # the 0-dim hyperparameters every parameter reads make it merge same-shaped parameters
    # into one loop over dozens of streams (Adam: 1.01 -> 1.32 x torch's fused Adam step);
    # the slots and gradient one parameter's updates share are far above 256 bytes.
    "score_fusion_memory_threshold": 256,
    # float16/bfloat16: round every intermediate to the parameter's dtype as eager ATen (and
    # TF's kernels) do, instead of carrying it in float32: the loop's bits instead of a
    # quarter of the elements off by an ulp after a few GradientDescent steps.
    "emulate_precision_casts": True,
}
#: Extra inductor options for CUDA buckets only (CPU kernels never see them).
#: ``combo_kernels``: inductor's horizontal fusion, several parameters' loops in one Triton
#: launch instead of one launch per parameter.  On an H200 (torch 2.11, 134M parameters in 81
#: tensors) it took fused Adam from 1.42x torch's fused Adam's step time to 0.91-0.92x, and
#: FTRL, AMSGrad and RMSProp to 0.93-1.14x torch fused Adam's bandwidth (from 0.68-1.02x);
#: docs/speed.md "GPU".  On by default from torch 2.11, the release it was measured and
#: tested on (tests/kernels/test_cuda.py runs every optimizer with it on and off);
#: ``benchmarks/optimizers/optimizer_speed.py --fused-option combo_kernels=0`` switches it off.
CUDA_OPTIONS: dict[str, Any] = {"combo_kernels": True} if private.COMBO_KERNELS else {}
#: CPU: parameters of at most this many elements run in a single-threaded kernel of their own
#: (a 4096-element Adam update is a few microseconds of work, the order of one OpenMP
#: barrier's cost, which each parameter's loop pays in the threaded kernel), up to
#: ``SMALL_BUDGET`` elements in all so that many mid-sized tensors never lose the threads.
SMALL_NUMEL = 4096
SMALL_BUDGET = 2**20
_SINGLE_THREAD = {"cpp.threads": 1}
#: How many distinct signatures were compiled in this process (tests check it stays put).
compiled_signatures = 0
_tracing = False


def tracing() -> bool:
    """True while the fused path traces an optimizer's maths into a kernel.

    Maths may pick a form that compiles to a faster kernel but would be slower eagerly
    (NormalizedSGD's blocked sum) or skip an eager-only correction (FTRL's float64 root).
    """
    return _tracing


@contextlib.contextmanager
def _tracing_scope() -> Iterator[None]:
    global _tracing
    _tracing = True
    try:
        yield
    finally:
        _tracing = False


def signature(opt, params, grads, slots, hp, shared) -> tuple[Any, ...]:
    """Everything the compiled kernel is specialised on: the complete cache key.

    Within a bucket, parameters, gradients and slots share one dtype and device (gradients
    are validated against their parameter, slots are created and loaded in the parameter's
    dtype); hyperparameter and shared tensors are 0-dim with dtypes fixed by the optimizer.
    So: shapes and strides of every parameter-sized tensor, names, Python flag values, and
    on accelerators the 16-byte alignment that Triton kernels are specialised on.
    """
    p0 = params[0]
    key = [
        p0.dtype,
        p0.device,
        tuple([p.shape for p in params]),
        tuple([p.stride() for p in params]),
        tuple([g.stride() for g in grads]),
        tuple([(name, tuple([s.stride() for s in ts])) for name, ts in slots.items()]),
        *constants_key(hp, shared),
    ]
    if not p0.is_cpu:
        tensors = [*params, *grads, *(s for ts in slots.values() for s in ts)]
        key.append(tuple([t.data_ptr() % 16 for t in tensors]))
    return tuple(key)


def constants_key(hp, shared) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The part of ``signature`` that hyperparameters and shared state give: shared state's
    names and dtypes, hyperparameter names and the values of Python-valued flags."""
    return (
        tuple([(k, v.dtype) for k, v in shared.items()]),
        tuple([(k, None if isinstance(v, torch.Tensor) else v) for k, v in hp.items()]),
    )


def _inputs(params, grads, slots, hp, shared) -> list[torch.Tensor]:
    """Every tensor of a bucket's step, flat, in the order ``_step_function`` reads them."""
    flat = [*params, *grads]
    for ts in slots.values():
        flat.extend(ts)
    flat.extend(v for v in hp.values() if isinstance(v, torch.Tensor))
    flat.extend(shared.values())
    return flat


def _step_function(opt, params, slots, hp, shared):
    """The bucket's step as a function of the flat input list (``_inputs``' order)."""
    n = len(params)
    slot_names = list(slots)
    hp_tensors = [k for k, v in hp.items() if isinstance(v, torch.Tensor)]
    hp_constants = {k: v for k, v in hp.items() if not isinstance(v, torch.Tensor)}
    shared_names = list(shared)

    def step(*flat):
        ps, gs = flat[:n], flat[n : 2 * n]
        at = 2 * n
        slot_lists = {}
        for name in slot_names:
            slot_lists[name] = flat[at : at + n]
            at += n
        hp_in = dict(hp_constants, **dict(zip(hp_tensors, flat[at : at + len(hp_tensors)])))
        at += len(hp_tensors)
        shared_in = dict(zip(shared_names, flat[at:]))
        for i in range(n):
            slots_i = {name: slot_lists[name][i] for name in slot_names}
            opt._apply_dense(ps[i], gs[i], slots_i, hp_in, shared_in)
        return ()

    return step


def compile_step(opt, params, grads, slots, hp, shared, single_thread: bool = False):
    """Trace ``opt``'s maths for this bucket and compile it; returns ``f([flat inputs])``."""
    global compiled_signatures
    flat = _inputs(params, grads, slots, hp, shared)
    step = torch.func.functionalize(
        _step_function(opt, params, slots, hp, shared), remove="mutations"
    )
    options = _OPTIONS
    if params[0].is_cuda:
        options = dict(options, **private.exact_division_option(), **CUDA_OPTIONS)
    elif single_thread:
        options = dict(options, **_SINGLE_THREAD)
    # The options cover tracing too: make_fx marks float16/bfloat16 results for
    # ``emulate_precision_casts`` while it traces.
    with private.inductor_options(options):
        graph = _trace(type(opt).__name__, step, flat)
        _store_in_order(graph)
        compiled = private.compile_fx_inner(graph, flat)
    compiled_signatures += 1
    return compiled


def _trace(name: str, step, flat: list[torch.Tensor]) -> torch.fx.GraphModule:
    # Outside the try: a torch without these entry points gets the adapter's own error.
    trace = private.make_fx(step, private.decomposition_table(), tracing_mode="fake")
    try:
        with torch.no_grad(), _tracing_scope():
            return trace(*flat)
    except NotImplementedError:  # an abstract optimizer (BaseCustomOptimizer): its own message
        raise
    except Exception as exc:
        raise RuntimeError(
            f"{name}: fused=True needs _apply_dense to trace as one graph of tensor operations "
            f"on its inputs (no branching on tensor values, no tensors other than the "
            f"parameter, gradient, slots, hyperparameters and shared state); use "
            f"foreach=True instead. Cause: {type(exc).__name__}: {exc}"
        ) from exc


def _store_in_order(graph: torch.fx.GraphModule) -> None:
    """Move each ``copy_(input, value)`` right after the last node it must follow: its value
    and every other reader of the input (those read the old contents).  Functionalisation
    leaves no reader of an input after its new value exists, so this is the earliest point
    that keeps every read's meaning."""
    order = {node: i for i, node in enumerate(graph.graph.nodes)}
    for node in list(graph.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            target, value = node.args[0], node.args[1]
            after = [value, *(u for u in target.users if u is not node)]
            max(after, key=order.__getitem__).append(node)
    graph.graph.lint()
    graph.recompile()


def small_parameters(params) -> list[int]:
    """Indices of the CPU parameters that go to the single-threaded kernel: at most
    ``SMALL_NUMEL`` elements each, in order, while their total stays within ``SMALL_BUDGET``.
    A bucket of small parameters only is one single-threaded kernel."""
    if not params[0].is_cpu:
        return []
    small, total = [], 0
    for j, p in enumerate(params):
        n = p.numel()
        if n <= SMALL_NUMEL and total + n <= SMALL_BUDGET:
            small.append(j)
            total += n
    return small


def run_fused(opt, params, grads, slots, hp, shared, record=None) -> None:
    """Apply ``_apply_dense`` to every (param, grad) of one bucket: one compiled kernel, two on
    CPU when the bucket mixes small parameters with others (``small_parameters``).

    ``record``: a list that gets ``(compiled, params, slot names, constants_key)`` per
    kernel call (``kernels/plan.py`` replays them on later steps)."""
    small = small_parameters(params)
    if not small or len(small) == len(params):
        _run_kernel(opt, params, grads, slots, hp, shared, bool(small), record)
        return
    taken = set(small)
    for idx, single_thread in (
        (small, True),
        ([j for j in range(len(params)) if j not in taken], False),
    ):
        part = (
            [params[j] for j in idx],
            [grads[j] for j in idx],
            {name: [ts[j] for j in idx] for name, ts in slots.items()},
        )
        _run_kernel(opt, *part, hp, shared, single_thread, record)


def _run_kernel(opt, params, grads, slots, hp, shared, single_thread: bool, record=None) -> None:
    key = (single_thread, signature(opt, params, grads, slots, hp, shared))
    cache = _CACHE.get(opt)  # not setdefault: that builds a weakref and a dict every step
    if cache is None:
        cache = _CACHE[opt] = {}
    compiled = cache.get(key)
    if compiled is None:
        compiled = compile_step(opt, params, grads, slots, hp, shared, single_thread)
        cache[key] = compiled
    if record is not None:
        record.append((compiled, params, list(slots), constants_key(hp, shared)))
    compiled(_inputs(params, grads, slots, hp, shared))  # takes (and empties) the list
