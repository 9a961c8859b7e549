"""RETURNN's ``NormalizedSGD``: gradient descent on the L2-normalised gradient.

Update rule (``tf.nn.l2_normalize(g, None)``, then CustomGradientDescent)::

    g_hat = g * rsqrt(max(sum(g * g), 1e-12))      # sum over ALL elements
    w -= lr * g_hat

Sparse: the norm is taken over the sparse values as given, each duplicate occurrence counted
separately, then ``w[i] -= lr * g_hat[k]`` once per occurrence (spec 13.3).  This is not the
norm of the dense gradient.  A zero (or empty) gradient changes nothing.
"""

from __future__ import annotations

import torch

from gradfleet.kernels import fused
from gradfleet.optimizers._rounding import rsqrt
from gradfleet.optimizers.custom_gradient_descent import CustomGradientDescentOptimizer

_NORM_EPSILON = 1e-12  # tf.nn.l2_normalize's default, applied to the squared norm


class NormalizedSGD(CustomGradientDescentOptimizer):
    """RETURNN's ``NormalizedSGD(learning_rate, use_locking=False, name=None)`` (registered
    in RETURNN as "normalizedsgd" only): ``NormalizedSGD(params, learning_rate,
    use_locking=False, name=None, **options)``.  No slots.
    """

    def _apply_var(self, grad, var, indices=None):
        # A sharded DTensor on the fused path: the kernel sees one shard, the global sum
        # comes precomputed (gradfleet.kernels.dtensor).
        squares = self._shared.get(_GLOBAL_SQUARES) if indices is None else None
        if squares is None:
            squares = _sum_of_squares(grad)
        inv_norm = rsqrt(torch.clamp_min(squares, _NORM_EPSILON))
        super()._apply_var(grad * inv_norm, var, indices)

    def _whole_tensor_statistics(self, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole-tensor reductions of the dense maths (see gradfleet.kernels.dtensor)."""
        return {_GLOBAL_SQUARES: _sum_of_squares(grad)}


_GLOBAL_SQUARES = "_grad_sum_of_squares"


_BLOCK = 4096  # inductor's CPU reductions over more elements switch to a slow cascade sum


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """``sum(x * x)`` over all elements, in ``x``'s dtype.

    Eager: ATen's sum (a cascade sum, accurate to a few ulps).  Inside the fused path the
    sum is taken per block of 4096 elements and then over blocks: a two-level sum as
    accurate as ATen's, which inductor keeps in vector registers; a single reduction over
    more than 4096 elements gets inductor's cascade helper, whose accumulator lives in
    memory and runs at a third of the memory bandwidth (benchmarks/optimizers/optimizer_speed.py).
    """
    if not fused.tracing() or x.numel() <= _BLOCK:
        return (x * x).sum()
    flat = x.reshape(-1)
    whole = flat.numel() // _BLOCK * _BLOCK
    blocks, tail = flat[:whole].view(-1, _BLOCK), flat[whole:]
    return (blocks * blocks).sum(1).sum() + (tail * tail).sum()
