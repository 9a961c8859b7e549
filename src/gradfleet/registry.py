"""RETURNN-style optimizer lookup: names and ``{"class": ..., ...}`` configs -> optimizers.

Names are case-insensitive and may omit the "Optimizer" suffix, as in RETURNN's registry.
gradfleet's own classes come first; any other name falls back to ``torch.optim``'s classes
(the seeds' "Keras" row: the framework's own optimizers by name), e.g. "sgd" or "adamw".
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from gradfleet import optimizers as _ours
from gradfleet.optimizer import _OPTIONS as _TORCH_SIDE_OPTIONS

_SUFFIX = "optimizer"


def _register(classes: Iterable[type]) -> dict[str, type]:
    table: dict[str, type] = {}
    for cls in classes:
        key = cls.__name__.lower()
        table.setdefault(key, cls)
        if key.endswith(_SUFFIX) and len(key) > len(_SUFFIX):
            table.setdefault(key[: -len(_SUFFIX)], cls)
    return table


def _torch_classes() -> list[type]:
    return [
        obj
        for name, obj in vars(torch.optim).items()
        if inspect.isclass(obj)
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer
        and not name.startswith("_")
    ]


GRADFLEET_OPTIMIZERS: dict[str, type] = _register(_ours.ALL)
TORCH_OPTIMIZERS: dict[str, type] = {
    k: v for k, v in _register(_torch_classes()).items() if k not in GRADFLEET_OPTIMIZERS
}


def optimizer_names() -> list[str]:
    """Every name :func:`get_optimizer_class` accepts (lowercase, suffix-less where possible)."""
    return sorted(GRADFLEET_OPTIMIZERS) + sorted(TORCH_OPTIMIZERS)


def get_optimizer_class(name: str | type) -> type:
    """The optimizer class for ``name`` (a class is returned as is)."""
    if inspect.isclass(name):
        if not issubclass(name, torch.optim.Optimizer):
            raise ValueError(f"{name!r} is not a torch.optim.Optimizer subclass")
        return name
    if not isinstance(name, str):
        raise ValueError(f"optimizer class must be a name or a class, got {name!r}")
    key = name.strip().lower()
    for table in (GRADFLEET_OPTIMIZERS, TORCH_OPTIMIZERS):
        if key in table:
            return table[key]
    raise ValueError(f"unknown optimizer {name!r}; valid names: {', '.join(optimizer_names())}")


def create_optimizer(
    params: Any,
    config: str | dict[str, Any],
    *,
    learning_rate: float | None = None,
    returnn_defaults: bool = False,
) -> torch.optim.Optimizer:
    """Build an optimizer from a RETURNN-style config.

    ``config`` is a name (``"adam"``) or a dict ``{"class": "adam", "epsilon": 1e-16, ...}``
    whose other entries are constructor arguments (TF names).  ``learning_rate`` may be given
    here or in the dict.  For torch.optim classes, ``learning_rate``/``epsilon`` are renamed to
    ``lr``/``eps``.  ``returnn_defaults=True`` injects ``epsilon=1e-16`` where the class takes
    an epsilon and the config sets none, as RETURNN's TF backend does.
    """
    opts = {"class": config} if isinstance(config, str) else dict(config)
    if "class" not in opts:
        raise ValueError(f"optimizer config needs a 'class' entry, got {config!r}")
    cls = get_optimizer_class(opts.pop("class"))
    if learning_rate is not None:
        if "learning_rate" in opts or "lr" in opts:
            raise ValueError("learning_rate given both in the config and as an argument")
        opts["learning_rate"] = learning_rate
    accepted = set(constructor_arguments(cls))
    if returnn_defaults and "epsilon" in accepted and "eps" not in opts:
        opts.setdefault("epsilon", 1e-16)  # torch's `eps` in the config is the same setting
    if cls in TORCH_OPTIMIZERS.values():
        for tf_name, torch_name in (("learning_rate", "lr"), ("epsilon", "eps")):
            if tf_name in opts and torch_name in accepted:
                opts[torch_name] = opts.pop(tf_name)
    unknown = sorted(k for k in opts if k not in accepted)
    if unknown and not _takes_var_kwargs(cls):
        raise ValueError(
            f"{cls.__name__} does not take {unknown}; its arguments are {sorted(accepted)}"
        )
    return cls(params, **opts)


def constructor_arguments(cls: type) -> list[str]:
    """The keyword arguments ``cls`` accepts, sorted; for gradfleet's optimizers this includes
    the torch-side options (foreach, fused, check_finite)."""
    names = _init_arg_names(cls)
    if issubclass(cls, _ours.Optimizer):
        names |= set(_TORCH_SIDE_OPTIONS)
    return sorted(names)


def _init_arg_names(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names.update(inspect.signature(init).parameters)
    return names - {"self", "params", "args", "kwargs", "options", "defaults"}


def _takes_var_kwargs(cls: type) -> bool:
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        for p in inspect.signature(cls.__init__).parameters.values()
    ) and not issubclass(cls, _ours.Optimizer)
