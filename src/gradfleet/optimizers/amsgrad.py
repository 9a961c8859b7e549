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

``epsilon=0`` (RETURNN's default): an element whose gradient is exactly 0 at its parameter's
first step gets ``m = v = v_hat = 0`` and the update ``0 / (0 + sqrt(0))``, so its weight is
NaN from then on, in RETURNN as here (RETURNN's configs pass ``epsilon=1e-16``; so does
``gradfleet.registry.create_optimizer(..., returnn_defaults=True)``).  gradfleet warns once
(``UserWarning``) when a parameter's first step (the one that creates its slots) meets such
an element: the check reads the gradients back at that step only, never on later steps (no
wait for the device there), and not under ``torch.compile`` or CUDA-graph capture.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gradfleet import _hyper, kernels
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

    With ``epsilon=0`` (the default, as in RETURNN) a gradient element that is exactly 0 at
    its parameter's first step turns that weight into NaN for good (``0 / (0 + sqrt(0))``);
    a warning says so the first time it happens.  Pass ``epsilon=1e-16`` as RETURNN's
    configs do.
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

    def _update_group(self, group, params, grads, hp_for, record=None):
        if not self.__dict__.get("_warned_zero_epsilon"):
            self._warn_zero_epsilon(group, params, grads)
        super()._update_group(group, params, grads, hp_for, record)

    def _warn_zero_epsilon(self, group, params, grads) -> None:
        """Warn if ``epsilon`` is 0 and a parameter's first step (no slots yet) has a zero
        gradient element.  Reads the gradients back once per parameter, at that step; never
        under torch.compile or while a CUDA graph is being captured."""
        if torch.compiler.is_compiling():  # before reading self.state: no guard on it
            return
        first = [g for p, g in zip(params, grads) if p not in self.state]
        if not first or _capturing(first):
            return
        if _hyper.as_float(group["epsilon"]) != 0.0:
            return
        zeros = [(g == 0).sum() for g in first]
        count = sum(int(z.full_tensor() if kernels.dtensor.is_dtensor(z) else z) for z in zeros)
        if count:
            self._warned_zero_epsilon = True
            warnings.warn(
                f"AMSGradOptimizer: epsilon is 0 (RETURNN's default) and {count} gradient "
                f"element(s) are exactly 0 at their parameter's first step: those weights are "
                f"now NaN (0 / (0 + sqrt(0))) and stay NaN. Pass epsilon=1e-16, as RETURNN's "
                f"configs do",
                UserWarning,
                stacklevel=4,
            )

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


def _capturing(grads: list[torch.Tensor]) -> bool:
    return any(g.is_cuda for g in grads) and torch.cuda.is_current_stream_capturing()
