"""FTRL-Proximal as in TF1's ``tf.compat.v1.train.FtrlOptimizer`` (McMahan et al. 2013).

With ``p = -learning_rate_power``, ``n`` = accum, ``z`` = linear (stored un-scaled), and
``l2_eff = l2 + beta / (2 * max(lr, 1e-36))`` (formed in float32, as TF's ``_prepare`` does)::

    gs = g + 2 * l2_shrinkage * w            (old w; gs = g when l2_shrinkage = 0)
    n_new = n + g * g                        (always the raw g)
    z += gs - (n_new^p - n^p) / lr * w       (sqrt instead of ^p when lr_power == -0.5)
    y = n_new^p / lr + 2 * l2_eff
    w = (|z| > l1) ? (l1 * sign(z) - z) / y : 0          (dense kernel)
    w = (clip(z, -l1, l1) - z) / y                       (sparse kernel)
    n = n_new

Sparse (duplicates summed first): listed rows only; a rank-1 parameter's ``n^p`` difference
uses ``pow`` even for p = 0.5 (TF's scalar kernel).  The initial ``w`` only enters through
the ``- (...) * w`` term: after one step ``w`` is the closed-form solution.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from gradfleet import _hyper
from gradfleet.kernels import fused
from gradfleet.optimizer import RowwiseOptimizer

_POWER, _INIT = "learning_rate_power", "initial_accumulator_value"
_L1, _L2 = "l1_regularization_strength", "l2_regularization_strength"
_SHRINK = "l2_shrinkage_regularization_strength"


class FtrlOptimizer(RowwiseOptimizer):
    """TF1 FTRL.  ``FtrlOptimizer(params, learning_rate, learning_rate_power=-0.5,
    initial_accumulator_value=0.1, l1_regularization_strength=0.0,
    l2_regularization_strength=0.0, use_locking=False, name="Ftrl", accum_name=None,
    linear_name=None, l2_shrinkage_regularization_strength=0.0, beta=None)``.  Slots
    ``accum`` and ``linear``.  ``learning_rate`` must be > 0 (TF's sparse kernel demands it;
    its dense kernel silently yields NaN for 0).  ``accum_name``/``linear_name`` only name
    TF's slot variables and are kept for reference; ``get_slot`` takes "accum"/"linear".
    """

    hyperparameters = {
        "lr": _hyper.POSITIVE,
        _POWER: _hyper.NON_POSITIVE,
        _INIT: _hyper.NON_NEGATIVE,
        _L1: _hyper.NON_NEGATIVE,
        _L2: _hyper.NON_NEGATIVE,
        _SHRINK: _hyper.NON_NEGATIVE,
        "beta": _hyper.NON_NEGATIVE,
    }
    slots = {"accum": 0.1, "linear": 0.0}
    lr_zero_hint = (
        ". FTRL's update divides by the learning rate, so it has no lr -> 0 limit (TF's "
        "dense kernel turns the weights to NaN, its sparse one refuses). A learning-rate "
        "schedule that starts at 0 is the likely cause, such as a linear warmup from 0 "
        "(transformers' get_linear_schedule_with_warmup, LinearLR(start_factor=0)): start "
        "the warmup at a small positive learning rate instead"
    )

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        learning_rate_power: _hyper.Hyper = -0.5,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: _hyper.Hyper = 0.0,
        l2_regularization_strength: _hyper.Hyper = 0.0,
        use_locking: bool = False,
        name: str = "Ftrl",
        accum_name: str | None = None,
        linear_name: str | None = None,
        l2_shrinkage_regularization_strength: _hyper.Hyper = 0.0,
        beta: _hyper.Hyper | None = None,
        **options: Any,
    ) -> None:
        defaults = {
            "lr": learning_rate,
            _POWER: learning_rate_power,
            _INIT: initial_accumulator_value,
            _L1: l1_regularization_strength,
            _L2: l2_regularization_strength,
            _SHRINK: l2_shrinkage_regularization_strength,
            "beta": 0.0 if beta is None else beta,
        }
        _check_tf_ranges(defaults)
        self.accum_name, self.linear_name = accum_name, linear_name
        super().__init__(params, defaults, name, use_locking, **options)

    def _slot_fills(self, group):
        return {"accum": _hyper.as_float(group[_INIT]), "linear": 0.0}

    def _group_hyper(self, group, hp_for):
        # Derived values are formed here, outside the (possibly compiled) rule: l2_eff in
        # float32 as TF does, and TF's Python-level kernel choices as plain bools.
        power, shrink = (_hyper.resolve(group[k]) for k in (_POWER, _SHRINK))

        def derived(dtype, device):
            hp, hp32 = dict(hp_for(dtype, device)), hp_for(torch.float32, device)
            hp["l2_eff"] = _l2_eff(hp32).to(dtype)
            hp["fast"] = _float32_test(power, hp32[_POWER], lambda x: x == -0.5)
            hp["v2"] = _float32_test(shrink, hp32[_SHRINK], lambda x: x > 0.0)
            return hp

        return derived

    def _rule(self, w, slots, g, hp, shared, sparse):
        lr, l1, p, fast = hp["lr"], hp[_L1], -hp[_POWER], hp["fast"]
        n, z = slots["accum"], slots["linear"]
        gs = g + 2 * hp[_SHRINK] * w if hp["v2"] else g
        n_new = n + g * g
        root_new = _sqrt(n_new) if fast else n_new.pow(p)
        if fast and not (sparse and w.dim() == 1):
            sigma = root_new - _sqrt(n)
        else:
            sigma = n_new.pow(p) - n.pow(p)
        z = z + (gs - sigma / lr * w)
        y = root_new / lr + 2 * hp["l2_eff"]
        if sparse:
            w_new = (z.clamp(-l1, l1) - z) / y
        else:
            w_new = torch.where(z.abs() > l1, (l1 * z.sign() - z) / y, torch.zeros_like(z))
        return w_new, {"accum": n_new, "linear": z}


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt correctly rounded for float32/16, as TF's kernel computes it.

    torch's float32 ``sqrt`` is one ulp off for a good share of inputs (16% here); FTRL's
    ``sqrt(n_new) - sqrt(n)`` cancels, so that ulp shows in ``linear``.  A float64 root
    rounded to float32 is exact (53 >= 2 * 24 + 2 bits).  float64 keeps torch's root: its
    rare one-ulp error stays far inside float64 agreement.  Inside the fused path inductor
    emits the hardware root (IEEE, correctly rounded), so the float64 detour, which halves
    the vector width, is skipped there.
    """
    if x.dtype == torch.float64 or fused.tracing():
        return x.sqrt()
    return x.double().sqrt().to(x.dtype)


def _float32_test(value, as_float32: torch.Tensor, test) -> bool:
    """``test`` on TF's float32 value of a hyperparameter, a Python bool as TF decides it.

    Under torch.compile a Python number is tested as it is (a guard; reading the float32
    tensor back would be a graph break): the same answer for -0.5 and 0, the values that
    matter, and for every other value except within half a float32 ulp of them.
    A Python number held on an accelerator is rounded to float32 on the host instead: reading
    ``as_float32`` back from a GPU would wait for the device every step and cannot be captured
    in a CUDA graph.
    """
    if torch.compiler.is_compiling() and not isinstance(value, torch.Tensor):
        return bool(test(value))
    if isinstance(value, torch.Tensor) or as_float32.is_cpu:
        return bool(test(float(as_float32)))
    return bool(test(_round_to_float32(float(value))))


def _round_to_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (IEEE, ties to even), on the host, with no tensor
    made; beyond float32's range, infinity (as torch's conversion gives)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _l2_eff(hp32: dict[str, torch.Tensor]) -> torch.Tensor:
    """TF folds beta into l2 in float32 from the current learning rate."""
    return hp32[_L2] + hp32["beta"] / (2 * hp32["lr"].clamp_min(1e-36))


def _check_tf_ranges(values: dict[str, Any]) -> None:
    """TF's own constructor checks and messages (callables are checked when called)."""
    rules = [
        (_INIT, 1, "positive or zero"),
        (_POWER, -1, "negative or zero"),
        (_L1, 1, "positive or zero"),
        (_L2, 1, "positive or zero"),
        (_SHRINK, 1, "positive or zero"),
    ]
    for key, sign, wanted in rules:
        value = values[key]
        _hyper.check_type("FtrlOptimizer", key, value)
        if not callable(value) and sign * _hyper.as_float(value) < 0.0:
            raise ValueError(f"{key} {_hyper.as_float(value):f} needs to be {wanted}")
