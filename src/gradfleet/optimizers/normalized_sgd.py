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

from gradfleet.optimizers.custom_gradient_descent import CustomGradientDescentOptimizer

_NORM_EPSILON = 1e-12  # tf.nn.l2_normalize's default, applied to the squared norm


class NormalizedSGD(CustomGradientDescentOptimizer):
    """RETURNN's ``NormalizedSGD(learning_rate, use_locking=False, name=None)`` (registered
    in RETURNN as "normalizedsgd" only): ``NormalizedSGD(params, learning_rate,
    use_locking=False, name=None, **options)``.  No slots.
    """

    def _apply_var(self, grad, var, indices=None):
        inv_norm = torch.rsqrt(torch.clamp_min((grad * grad).sum(), _NORM_EPSILON))
        super()._apply_var(grad * inv_norm, var, indices)
