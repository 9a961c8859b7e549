"""The fused path: one ``torch.compile``d (inductor) kernel per (device, dtype) bucket.

The compiled function calls the optimizer's own ``_apply_dense`` for every parameter of the
bucket, so inductor sees the whole step as one graph and emits one fused loop per parameter
(C++/OpenMP on CPU, Triton on GPU) that reads each input once and stores straight into the
real parameter and slot storage (inductor turns the functionalised ``copy_`` back into
in-place stores).  Hyperparameters and shared state are 0-dim tensor inputs, so a new
learning rate does not recompile; Python flags are part of the cache key.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch

# Compiled callables per optimizer instance (dynamo guards on the instance whose methods it
# traces, so sharing across instances would only trade a compile for a recompile), keyed
# by the structural signature of a bucket.  Each entry owns a fresh code object, so
# dynamo's per-code cache and its recompile limit are per entry; entries die with the
# optimizer.
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
# Inductor re-checks every input's size, stride and alignment in Python before each call;
# dynamo's guards have checked the same just before, so those asserts are pure overhead
# (0.1-0.2 ms a step for 41 parameters, a few percent of a light optimizer's step).
_OPTIONS = {"size_asserts": False, "alignment_asserts": False}
#: How many distinct signatures were compiled in this process (tests check it stays put).
compiled_signatures = 0


def _step(opt, params, grads, slots, hp, shared):
    for i in range(len(params)):
        opt._apply_dense(params[i], grads[i], {k: v[i] for k, v in slots.items()}, hp, shared)


def signature(opt, params, grads, slots, hp, shared) -> tuple[Any, ...]:
    """The cache key of a bucket: what makes dynamo specialise in practice.

    Only a key: dynamo's own guards (every tensor's dtype, device, size and stride) decide
    whether a compiled graph may run, so a layout the key misses costs a recompile, never a
    wrong result.  It is kept this small because it is computed every step, on cold caches
    (a full per-tensor description cost 0.37 ms per step for 41 parameters; this 0.06 ms).
    Slots and shared state are created by the optimizer in the parameters' layout, and
    dtype/device are uniform within a bucket, so shapes and strides of params and grads
    plus the names and Python flags suffice.
    """
    return (
        type(opt),
        params[0].dtype if params else None,
        params[0].device if params else None,
        tuple([p.shape for p in params]),
        tuple([p.stride() for p in params]),
        tuple([g.stride() for g in grads]),
        tuple(slots),
        tuple(shared),
        tuple((k, None if isinstance(v, torch.Tensor) else v) for k, v in hp.items()),
    )


def compiled_step(opt: Any, key: tuple[Any, ...]) -> Any:
    """The compiled step of ``opt`` for ``key``, compiling it on first use."""
    cache = _CACHE.setdefault(opt, {})
    fn = cache.get(key)
    if fn is None:
        global compiled_signatures
        compiled_signatures += 1
        code = _step.__code__.replace(co_name=f"gradfleet_fused_step_{compiled_signatures}")
        fresh = types.FunctionType(code, _step.__globals__, code.co_name)
        fn = cache[key] = torch.compile(fresh, fullgraph=True, dynamic=False, options=_OPTIONS)
    return fn


def run_fused(opt, params, grads, slots, hp, shared) -> None:
    """Apply ``_apply_dense`` to every (param, grad) of one bucket as one compiled kernel."""
    key = signature(opt, params, grads, slots, hp, shared)
    try:
        compiled_step(opt, key)(opt, params, grads, slots, hp, shared)
    except torch._dynamo.exc.Unsupported as exc:  # a graph break: refuse, never fall back
        raise RuntimeError(
            f"{type(opt).__name__}: fused=True needs _apply_dense to compile as one graph "
            f"(torch.compile fullgraph=True); use foreach=True instead. Cause: {exc}"
        ) from exc
