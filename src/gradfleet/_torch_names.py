"""torch's argument names for gradfleet's TF-named optimizers.

Two kinds of torch names reach a gradfleet constructor from code written for ``torch.optim``:

* **aliases**: the same maths under torch's name (``lr`` for ``learning_rate``, ``betas`` for
  ``(beta1, beta2)``, ``eps`` for ``epsilon``, ...).  Each class lists its own in
  ``Optimizer.torch_names``; ``lr`` is accepted wherever the constructor takes
  ``learning_rate``.  Giving an alias and its TF name together is a ``TypeError`` naming both.
* **torch-only arguments** (:data:`TORCH_ONLY`): maths TF's optimizer does not have.  The
  value that switches it off (``weight_decay=0``, ``maximize=False``, ...) is accepted and
  changes nothing; any other value is a ``TypeError`` that says so and names the alternative.
  ``capturable`` is accepted either way: every step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from gradfleet import _hyper

#: torch-only argument -> (the value that means "off", or a tuple of the values accepted, what
#: to use instead).
TORCH_ONLY: dict[str, tuple[Any, str]] = {
    "weight_decay": (
        0,
        "TF1's optimizers have no weight decay. For L2 regularisation add "
        "weight_decay * w to the loss (or to p.grad before step()); for decoupled decay as "
        "in AdamW scale the weights before each step, p.mul_(1 - lr * weight_decay)",
    ),
    "maximize": (False, "negate the loss (or the gradients) instead"),
    "amsgrad": (
        False,
        "gradfleet.AMSGradOptimizer is RETURNN's AMSGrad (no bias correction, see its docs)",
    ),
    "nesterov": (False, "Nesterov momentum is MomentumOptimizer(use_nesterov=True)"),
    "momentum": (0, "momentum is MomentumOptimizer's (or RMSPropOptimizer's)"),
    "dampening": (0, "TF's momentum accumulator has no dampening (a = momentum * a + g)"),
    "lr_decay": (0, "use a learning-rate scheduler or a callable learning_rate"),
    # Either value: every step already captures in a CUDA graph (tests/kernels/test_cuda.py).
    "capturable": ((False, True), "gradfleet's steps never read a tensor back"),
    "differentiable": (False, "gradfleet's steps run under torch.no_grad"),
}


def check_torch_only(owner: str, options: dict[str, Any]) -> None:
    """Drop torch-only arguments given with their "off" value; ``TypeError`` for any other."""
    for name in [k for k in options if k in TORCH_ONLY]:
        off, alternative = TORCH_ONLY[name]
        value = options.pop(name)
        if type(value) in (bool, int, float) and value in (off if type(off) is tuple else (off,)):
            continue
        raise TypeError(
            f"{owner} got {name}={value!r}: torch's {name} has no counterpart in the TF "
            f"optimizer's maths; {alternative}"
        )


def targets(tf: str | tuple[str, ...]) -> tuple[str, ...]:
    return (tf,) if isinstance(tf, str) else tf


def accept_torch_names(
    init: Callable[..., None], table: dict[str, Any], group_keys: Iterable[str] = ()
) -> Callable[..., None]:
    """Wrap an optimizer ``__init__`` so that it also takes torch's names in ``table``
    (torch name -> TF name, or a tuple of TF names that the torch name packs, as ``betas``)
    and ``lr`` when it takes ``learning_rate``.

    A required argument of ``init`` that is a param-group key (``learning_rate``, or one of
    ``group_keys``: Momentum's ``momentum``) may be left out when every param group gives
    it, as torch's required hyperparameters may: ``init`` then gets ``_hyper.REQUIRED``, and
    ``Optimizer.add_param_group`` refuses a group without the value (``TypeError``).  The
    wrapper's signature is ``init``'s (required stays required) plus the torch names as
    keyword-only arguments, so introspection (RETURNN's ``collect_class_init_kwargs``,
    ``gradfleet.registry``) sees them.
    """
    sig = inspect.signature(init)
    positions = {name: i for i, name in enumerate(sig.parameters)}  # counts ``self``
    table = dict(table)
    if "learning_rate" in positions:
        table.setdefault("lr", "learning_rate")
    table = {k: v for k, v in table.items() if all(t in positions for t in targets(v))}
    group_keys = {"learning_rate", *group_keys}
    from_groups = [
        name
        for name, p in sig.parameters.items()
        if name in group_keys
        and p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]

    def given(name: str, args: tuple, kwargs: dict) -> bool:
        return name in kwargs or len(args) >= positions.get(name, len(args) + 1)

    @functools.wraps(init)
    def wrapper(self, *args: Any, **kwargs: Any) -> None:
        owner = type(self).__name__
        for torch_name, tf in table.items():
            if torch_name not in kwargs:
                continue
            names = targets(tf)
            both = [n for n in names if given(n, args, kwargs)]
            if both:
                raise TypeError(
                    f"{owner}: got both {torch_name} and {' and '.join(both)}; pass one of "
                    f"them ({torch_name} is torch's name for TF's {', '.join(names)})"
                )
            value = kwargs.pop(torch_name)
            if isinstance(tf, str):
                kwargs[tf] = value
                continue
            if not isinstance(value, tuple | list) or len(value) != len(names):
                raise TypeError(
                    f"{owner}: {torch_name} must be a tuple ({', '.join(names)}), got {value!r}"
                )
            kwargs.update(zip(names, value))
        for name in from_groups:
            if not given(name, args, kwargs):
                kwargs[name] = _hyper.REQUIRED
        init(self, *args, **kwargs)

    params = list(sig.parameters.values())
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
        for name in table
        if name not in positions
    ]
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    wrapper.__signature__ = sig.replace(parameters=[*params[:at], *extra, *params[at:]])
    wrapper._accepts_torch_names = True
    return wrapper
