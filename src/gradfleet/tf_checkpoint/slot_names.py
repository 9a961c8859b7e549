"""Where TensorFlow's ``Saver`` puts each optimizer's state, per gradfleet optimizer class.

TF names a slot ``<variable>/<optimizer name>``; the k-th slot of the same variable made
under the same name gets ``_k`` (``dense/kernel/Adam`` = m, ``dense/kernel/Adam_1`` = v), so
the order in which the TF optimizer creates its slots decides the names.  ``SLOT_ORDER``
lists gradfleet's slot names in that order (taken from TF's ``_create_slots`` and checked
against TF's own ``get_slot(...).name`` by the tests).  Non-slot variables are single
scalars found by their last name component (``beta1_power`` or ``optimize/beta1_power``).

RETURNN's ``AMSGradOptimizer`` keeps plain unnamed variables instead of slots: ``t`` is
``Variable`` and the ``m``, ``v``, ``v_hat`` of the i-th variable of its ``var_list`` are
``Variable_{3i+1}``, ``Variable_{3i+2}``, ``Variable_{3i+3}`` (creation order).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gradfleet import optimizers as opts

SLOT_ORDER: dict[type, tuple[str, ...]] = {
    opts.GradientDescentOptimizer: (),
    opts.MomentumOptimizer: ("momentum",),
    opts.AdamOptimizer: ("m", "v"),
    opts.AdadeltaOptimizer: ("accum", "accum_update"),
    opts.AdagradOptimizer: ("accumulator",),
    opts.AdagradDAOptimizer: ("gradient_accumulator", "gradient_squared_accumulator"),
    opts.FtrlOptimizer: ("accum", "linear"),
    opts.ProximalAdagradOptimizer: ("accumulator",),
    opts.ProximalGradientDescentOptimizer: (),
    opts.RMSPropOptimizer: ("rms", "mg", "momentum"),  # "mg" only when centered
    # RETURNN's own (returnn.tf.updater)
    opts.CustomGradientDescentOptimizer: (),
    opts.NormalizedSGD: (),
    opts.NeuralOptimizer1: ("m",),
    opts.GradVarianceScaledOptimizer: ("m", "v"),
    opts.CustomAdamOptimizer: ("m", "v"),
    opts.AMSGradOptimizer: ("m", "v", "v_hat"),
}

#: gradfleet non-slot key -> TF variable base name (float32 scalars unless noted).
NON_SLOT_NAMES: dict[str, str] = {
    "beta1_power": "beta1_power",
    "beta2_power": "beta2_power",
    "step": "global_step",  # AdagradDA's step: TF reads the graph's int64 global_step
    "t": "Variable",  # RETURNN AMSGrad's counter
}

#: TF dtype of each non-slot variable (the tensor gradfleet keeps has this dtype too).
NON_SLOT_DTYPES = {"step": torch.int64}


def optimizer_class(opt: torch.optim.Optimizer) -> type:
    """The class in ``SLOT_ORDER`` that ``opt`` is (or derives from); ``TypeError`` if none."""
    for cls in type(opt).__mro__:
        if cls in SLOT_ORDER:
            return cls
    known = ", ".join(sorted(c.__name__ for c in SLOT_ORDER))
    raise TypeError(
        f"optimizer: {type(opt).__name__} has no TensorFlow checkpoint layout; gradfleet "
        f"knows {known}"
    )


def slot_suffixes(opt: torch.optim.Optimizer, group: dict) -> dict[str, str]:
    """gradfleet slot name -> the TF name suffix after ``<variable>/`` for ``group``."""
    return _suffixes(
        opt, [s for s in SLOT_ORDER[optimizer_class(opt)] if s in opt._slot_fills(group)]
    )


def suffixes_for_slots(opt: torch.optim.Optimizer, slots: Iterable[str]) -> dict[str, str]:
    """gradfleet slot name -> TF1 suffix for a variable that has exactly ``slots`` (TF's own
    slot names, as a TF2 object graph records them); slots ``opt`` does not know are left out.
    TF1 numbers a variable's slots in creation order, which ``SLOT_ORDER`` gives."""
    present = set(slots)
    return _suffixes(opt, [s for s in SLOT_ORDER[optimizer_class(opt)] if s in present])


def _suffixes(opt: torch.optim.Optimizer, order: list[str]) -> dict[str, str]:
    base = {s: opt.get_name() for s in order}
    if isinstance(opt, opts.FtrlOptimizer):  # Ftrl's accum_name / linear_name
        base["accum"] = opt.accum_name or opt.get_name()
        base["linear"] = opt.linear_name or opt.get_name()
    seen: dict[str, int] = {}
    out = {}
    for slot in order:
        k = seen.get(base[slot], 0)
        seen[base[slot]] = k + 1
        out[slot] = base[slot] if k == 0 else f"{base[slot]}_{k}"
    return out


def is_amsgrad(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, opts.AMSGradOptimizer)


def amsgrad_names(index: int) -> dict[str, str]:
    """TF names of the ``m``, ``v``, ``v_hat`` of RETURNN AMSGrad's ``index``-th variable."""
    return {s: f"Variable_{3 * index + k + 1}" for k, s in enumerate(("m", "v", "v_hat"))}
