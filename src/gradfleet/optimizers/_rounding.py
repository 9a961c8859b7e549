"""Maths helpers that round as TF's kernels (and the fused path) do, where torch's eager
kernels round otherwise."""

from __future__ import annotations

import torch

from gradfleet.kernels import fused

_HALF = (torch.float16, torch.bfloat16)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(x)``, rounded to ``x``'s dtype once.

    For float16/bfloat16 torch's CPU ``rsqrt`` computes in float32 and rounds the result once
    in its vectorised loop, but in the scalar loop it takes for small tensors (fewer than 32
    elements, torch 2.8 to 2.14) it rounds ``sqrt(x)`` to the dtype before the reciprocal: a
    third of the results of a 3-element bias differ by an ulp, and NormalizedSGD's norm (one
    element) is always rounded twice.  TF's Eigen kernels and the fused path's compiled
    kernel round once, so on the CPU every size goes through float32, as the vectorised loop
    does.  Other dtypes, other devices (CUDA's kernel rounds once at every size) and the fused
    path's tracing take ``rsqrt`` as it is.
    """
    if x.dtype in _HALF and x.device.type == "cpu" and not fused.tracing():
        return x.float().rsqrt().to(x.dtype)
    return x.rsqrt()
