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
#: How many distinct signatures were compiled in this process (tests check it stays put).
compiled_signatures = 0


def _step(opt, params, grads, slots, hp, shared):
    for i in range(len(params)):
        opt._apply_dense(params[i], grads[i], {k: v[i] for k, v in slots.items()}, hp, shared)


def _describe(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset())


def signature(opt, params, grads, slots, hp, shared) -> tuple[Any, ...]:
    """Everything dynamo would specialise on, so one key never needs a recompile."""
    return (
        type(opt),
        tuple(_describe(t) for t in params),
        tuple(_describe(t) for t in grads),
        tuple((k, tuple(_describe(t) for t in v)) for k, v in slots.items()),
        tuple((k, _describe(v) if isinstance(v, torch.Tensor) else v) for k, v in hp.items()),
        tuple((k, _describe(v)) for k, v in shared.items()),
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
        fn = cache[key] = torch.compile(fresh, fullgraph=True, dynamic=False)
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
