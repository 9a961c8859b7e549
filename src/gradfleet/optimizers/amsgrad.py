"""RETURNN's ``AMSGradOptimizer`` (Reddi et al. 2018): Adam with a non-decreasing second
moment, no bias correction, and an optional ``1/sqrt(t)`` learning-rate decay.

Update rule, with ``t`` a float32 step counter shared by every parameter and incremented
first (so the first step sees ``t = 1``)::

    lr_t = lr / sqrt(t) if decay else lr
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    v_hat = max(v_hat, v)
    w += -lr_t * m / (epsilon + sqrt(v_hat))

As in RETURNN, whose betas stay Python floats, ``1 - beta`` is formed in double precision and
then rounded through float32 (f32(0.1) for beta1 = 0.9), not as ``1 - f32(beta)`` in the
parameter dtype like TF's kernels; this reproduces RETURNN's float32 results to the bit.

Dense only: a sparse gradient raises ``TypeError`` (RETURNN fails on ``IndexedSlices`` too).
"""

from __future__ import annotations

from typing import Any

import torch

from gradfleet import _hyper
from gradfleet.optimizer import Optimizer


class AMSGradOptimizer(Optimizer):
    """RETURNN's ``AMSGradOptimizer(learning_rate=0.001, decay=False, beta1=0.9, beta2=0.99,
    epsilon=0.0, var_list=())`` (RETURNN's config injects epsilon 1e-16):
    ``AMSGradOptimizer(params, learning_rate=0.001, decay=False, beta1=0.9, beta2=0.99,
    epsilon=0.0, **options)``.

    Differences from RETURNN: ``var_list`` is gone (``params`` plays its role and state is
    created lazily), so unlike RETURNN (``KeyError`` on apply) it works from a config; the
    name is fixed to "AMSGradOptimizer" and, as in RETURNN, ``use_locking``/``name`` are not
    accepted.  RETURNN keeps ``m``, ``v``, ``v_hat`` as plain float32 variables, not slots;
    here they are slots in the parameter's dtype, reachable through ``get_slot``.  The
    counter ``t`` is non-slot state (float32, ``param_groups[i]["non_slot"]["t"]``).
    """

    hyperparameters = {
        "lr": _hyper.NON_NEGATIVE,
        "beta1": _hyper.UNIT_OPEN_RIGHT,
        "beta2": _hyper.UNIT_OPEN_RIGHT,
        "epsilon": _hyper.NON_NEGATIVE,
    }
    torch_names = {"betas": ("beta1", "beta2"), "eps": "epsilon"}
    slots = {"m": 0.0, "v": 0.0, "v_hat": 0.0}
    sparse = None
    flags = ("decay",)

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper = 0.001,
        decay: bool = False,
        beta1: _hyper.Hyper = 0.9,
        beta2: _hyper.Hyper = 0.99,
        epsilon: _hyper.Hyper = 0.0,
        **options: Any,
    ) -> None:
        for arg in ("use_locking", "name"):
            if arg in options:  # RETURNN's ctor has neither: TypeError there too
                raise TypeError(
                    f"AMSGradOptimizer got an unexpected keyword argument {arg!r}; as in RETURNN "
                    f"it takes no use_locking and its name is fixed"
                )
        defaults = dict(lr=learning_rate, decay=decay, betas=(beta1, beta2), epsilon=epsilon)
        super().__init__(params, defaults, "AMSGradOptimizer", **options)

    def _validate_gradient(self, p, g):
        if g.is_sparse:
            raise TypeError(
                "AMSGradOptimizer supports dense gradients only (as in RETURNN); use "
                "CustomAdamOptimizer (lazy sparse Adam) or AdamOptimizer for sparse gradients, "
                "or a dense gradient (e.g. nn.Embedding(sparse=False))"
            )
        super()._validate_gradient(p, g)

    def _init_shared(self, group):
        device = group["params"][0].device if group["params"] else None
        return {"t": torch.zeros((), dtype=torch.float32, device=device)}

    def _finish(self, group, shared, hp_for):
        shared["t"].add_(1.0)

    def _hyper_resolver(self, group):
        betas = dict(zip(("beta1", "beta2"), map(_hyper.resolve, group["betas"])))
        hp_for = super()._hyper_resolver(dict(group, betas=tuple(betas.values())))

        def with_complements(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
            hp = hp_for(dtype, device)
            for k, beta in betas.items():
                # cached like the hyperparameters: no host-to-device copy per step, which a
                # CUDA graph could not capture
                hp.setdefault(f"1-{k}", self._scalar(f"1-{k}", 1 - beta, dtype, device))
            return hp

        return with_complements

    def _apply_dense(self, p, g, slots, hp, shared):
        # ``t`` advances in _finish, after all parameters; this step's t is the stored t + 1.
        lr = hp["lr"]
        if hp["decay"]:
            lr = lr / torch.sqrt((shared["t"] + 1).to(p.dtype))
        m, v, v_hat = slots["m"], slots["v"], slots["v_hat"]
        m.copy_(hp["beta1"] * m + hp["1-beta1"] * g)
        v.copy_(hp["beta2"] * v + hp["1-beta2"] * g * g)
        torch.maximum(v_hat, v, out=v_hat)
        p.add_((-lr * m) / (hp["epsilon"] + torch.sqrt(v_hat)))
