"""Hyperparameter handling shared by every optimizer: validation and TF-style scalar casting.

TensorFlow turns a Python-float hyperparameter into a float32 tensor and then casts it to the
variable's dtype, so a float64 variable sees ``float64(float32(0.9))``, and derived constants
such as ``1 - beta1`` are formed in the variable's dtype.  :func:`scalar` reproduces that.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Hyper = float | torch.Tensor | Callable[[], Any]


def resolve(value: Any) -> Any:
    """Call a no-argument callable hyperparameter, as TF's ``_call_if_callable`` does."""
    return value() if callable(value) else value


def as_float(value: Any) -> float:
    """A hyperparameter value as a Python float (for validation)."""
    value = resolve(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"hyperparameter tensors must hold one value, got shape {tuple(value.shape)}"
            )
        return float(value.detach().reshape(()).item())
    return float(value)


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

    def contains(self, x: float) -> bool:
        if math.isnan(x):
            return False
        if self.low is not None and (x < self.low or (x == self.low and not self.low_inclusive)):
            return False
        if self.high is not None and (
            x > self.high or (x == self.high and not self.high_inclusive)
        ):
            return False
        return True

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


def check(owner: str, name: str, value: Any, allowed: Range) -> None:
    """Raise ``ValueError`` naming ``owner.name`` unless ``value`` is finite and in ``allowed``.

    Callables are checked when they are evaluated (each step), not at construction.
    """
    if callable(value):
        return
    try:
        x = as_float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{owner}: {name} must be a number, got {value!r}") from exc
    if math.isinf(x) or not allowed.contains(x):
        raise ValueError(f"{owner}: {name} must be {allowed.describe()}, got {x!r}")


def accept_lr_alias(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap an optimizer ``__init__`` taking ``learning_rate`` so that it also takes torch's
    ``lr`` (what ``torch.optim`` code and RETURNN's torch engine pass).

    ``lr=x`` becomes ``learning_rate=x``; giving both is a ``TypeError`` naming both.  Whether
    a learning rate is required, and its default, stay those of ``init``.  The wrapper's
    signature is ``init``'s plus a keyword-only ``lr``, so introspection (RETURNN's
    ``collect_class_init_kwargs``, ``gradfleet.registry``) sees both names.
    """
    sig = inspect.signature(init)
    names = list(sig.parameters)
    position = names.index("learning_rate")  # counts ``self``, as ``args`` below does
    required = sig.parameters["learning_rate"].default is inspect.Parameter.empty

    @functools.wraps(init)
    def wrapper(self, *args: Any, **kwargs: Any) -> None:
        if "lr" in kwargs:
            if "learning_rate" in kwargs or len(args) >= position:
                raise TypeError(
                    f"{type(self).__name__}: got both lr and learning_rate; pass one of them "
                    f"(lr is torch's name for TF's learning_rate)"
                )
            kwargs["learning_rate"] = kwargs.pop("lr")
        elif required and "learning_rate" not in kwargs and len(args) < position:
            raise TypeError(f"{type(self).__name__}: missing learning_rate (or torch's lr)")
        init(self, *args, **kwargs)

    params = list(sig.parameters.values())
    lr = inspect.Parameter("lr", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    wrapper.__signature__ = sig.replace(parameters=[*params[:at], lr, *params[at:]])
    wrapper._accepts_lr = True
    return wrapper
