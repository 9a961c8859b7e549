"""Hyperparameter handling shared by every optimizer: validation and TF-style scalar casting.

TensorFlow turns a Python-float hyperparameter into a float32 tensor and then casts it to the
variable's dtype, so a float64 variable sees ``float64(float32(0.9))``, and derived constants
such as ``1 - beta1`` are formed in the variable's dtype.  :func:`scalar` reproduces that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Hyper = float | torch.Tensor | Callable[[], Any]


class _Required:
    """The value of a hyperparameter the constructor was not given (torch's ``required``):
    every param group must then give it (``Optimizer.add_param_group``)."""

    def __repr__(self) -> str:
        return "<required>"

    def __reduce__(self) -> str:
        # Pickled and deep-copied as a reference to the one instance, so that a copied
        # optimizer's defaults still mark the hyperparameter as required.
        return "REQUIRED"


REQUIRED = _Required()


def resolve(value: Any) -> Any:
    """Call a no-argument callable hyperparameter, as TF's ``_call_if_callable`` does."""
    return value() if callable(value) else value


def as_float(value: Any) -> float:
    """A hyperparameter value as a Python float (for validation); see :func:`check_type`."""
    value = resolve(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"hyperparameter tensors must hold one value, got shape {tuple(value.shape)}"
            )
        return float(value.detach().reshape(()).item())
    return float(value)


def is_number(value: Any) -> bool:
    """True for what a hyperparameter may be (besides a callable): a real Python or numpy
    number (not a bool), or a one-element real tensor."""
    if isinstance(value, torch.Tensor):
        return not (value.dtype.is_complex or value.dtype == torch.bool)
    if isinstance(value, bool | np.bool_):
        return False
    return isinstance(value, int | float | np.integer | np.floating)


def check_type(owner: str, name: str, value: Any) -> None:
    """``TypeError`` naming ``owner``'s argument ``name`` unless ``value`` is a number, a
    one-element real tensor or a no-argument callable (whose result is checked when called)."""
    if callable(value) and not isinstance(value, torch.Tensor):
        return
    if not is_number(value):
        raise TypeError(
            f"{owner}: {name} must be a real number, a one-element tensor or a no-argument "
            f"callable, got {type(value).__name__} {value!r}"
        )


def scalar(
    value: Any, dtype: torch.dtype, device: torch.device, through_float32: bool = True
) -> torch.Tensor:
    """A 0-dim tensor of ``dtype`` on ``device`` holding ``value`` the way TF's kernels see it.

    Python numbers go through float32 first (TF's ``convert_to_tensor``) unless
    ``through_float32`` is False (a Python float that TF code multiplies straight into a
    tensor, which converts it to that tensor's dtype); a floating tensor keeps its own
    precision before the cast to ``dtype``.
    """
    value = resolve(value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        t = value.detach().reshape(())
    elif torch.compiler.is_compiling() and not isinstance(value, torch.Tensor):
        # Under torch.compile a Python number that changes between calls (a schedule's lr)
        # is traced as a symbolic input; ``torch.tensor(x)`` would bake it in as a constant
        # and recompile for every new value.  ``1 * x`` in float32 rounds x once, as the
        # conversion does.
        t = torch.ones((), dtype=torch.float32 if through_float32 else dtype, device=device)
        t = t.mul(value)
    else:
        t = torch.tensor(float(value), dtype=torch.float32 if through_float32 else dtype)
    return t.to(device=device, dtype=dtype)


@dataclass(frozen=True)
class Range:
    """An allowed interval for a hyperparameter; ``None`` bounds are open-ended."""

    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is finite and in the interval.  Comparisons only (NaN fails every
        one), so under torch.compile a symbolic float is checked by guards, not baked in."""
        low, high = -math.inf, math.inf
        if self.low is not None:
            low = self.low
        if self.high is not None:
            high = self.high
        above = x >= low if self.low_inclusive else x > low
        below = x <= high if self.high_inclusive else x < high
        return bool(above and below and -math.inf < x < math.inf)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            lb = "[" if self.low_inclusive else "("
            hb = "]" if self.high_inclusive else ")"
            return f"in {lb}{self.low:g}, {self.high:g}{hb}"
        if self.low is not None:
            return f"{'>=' if self.low_inclusive else '>'} {self.low:g}"
        if self.high is not None:
            return f"{'<=' if self.high_inclusive else '<'} {self.high:g}"
        return "a finite number"


NON_NEGATIVE = Range(0.0)
POSITIVE = Range(0.0, low_inclusive=False)
NON_POSITIVE = Range(None, 0.0)
UNIT = Range(0.0, 1.0)
UNIT_OPEN_RIGHT = Range(0.0, 1.0, high_inclusive=False)
FINITE = Range()


def check(owner: str, name: str, value: Any, allowed: Range, zero_hint: str = "") -> None:
    """Raise ``TypeError`` (see :func:`check_type`) or ``ValueError`` naming ``owner.name``
    unless ``value`` is a finite number in ``allowed``; ``zero_hint`` is appended to the
    message when the refused value is 0.

    Callables are checked when they are evaluated (each step), not at construction.  A Python
    number is checked with comparisons only (``Range.contains``), which torch.compile turns
    into guards; only the error path reads its value (``float``).
    """
    check_type(owner, name, value)
    if callable(value) and not isinstance(value, torch.Tensor):
        return
    x = as_float(value) if isinstance(value, torch.Tensor) else value
    if not allowed.contains(x):
        got = float(x)  # specialises a traced value: only on the way to an error
        hint = zero_hint if got == 0 else ""
        raise ValueError(f"{owner}: {name} must be {allowed.describe()}, got {got!r}{hint}")
