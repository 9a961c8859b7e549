"""The optimizers the command line offers: those ``gradfleet train`` can drive, one name each.

``train`` calls ``opt.step()`` once per batch, without a closure, after one backward pass, on
every parameter of the workload: dense weights and biases, and the sparse rows of a sparse
embedding. An optimizer that cannot take that -- a closure-based one (LBFGS), one that
refuses dense gradients (SparseAdam) or parameters other than matrices (Muon), a base class
(BaseCustomOptimizer) -- is left out of ``gradfleet list``, and naming it is one ``error:``
line before any rank starts, saying why.

Before a run, what the optimizer can take is found by trying it: one step on a small stand-in
parameter of each kind the workload has, on the CPU, as the ranks would step
(:func:`check_trainable`). ``list`` cannot try them, since building any optimizer loads torch's
compiler (seconds): it reads what the classes declare (a required closure, gradfleet's
``sparse``) and :data:`CANNOT_DRIVE`, which tests/cli/test_optimizer_choice.py holds to a real
training step of every class.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from gradfleet.optimizer import Optimizer as GradfleetOptimizer
from gradfleet.registry import GRADFLEET_OPTIMIZERS, TORCH_OPTIMIZERS, create_optimizer

from .config import ConfigError

__all__ = [
    "CANNOT_DRIVE",
    "check_trainable",
    "closest_names",
    "gradient_kinds",
    "lookup",
    "offered",
    "refusal",
    "shortest_names",
    "TORCH_SPARSE",
    "takes_sparse",
    "unknown",
]

Kind = tuple[int, bool]
"""A kind of gradient: the parameter's number of dimensions, and whether it is sparse."""


def _stand_in(kind: Kind) -> torch.nn.Parameter:
    ndim, sparse = kind
    param = torch.nn.Parameter(torch.zeros((2,) * ndim))
    if sparse:  # one row of two, as an embedding's backward leaves it
        param.grad = torch.sparse_coo_tensor([[0]], torch.ones(1, 2), (2, 2), is_coalesced=True)
    else:
        param.grad = torch.ones_like(param)
    return param


def _needs_closure(cls: type) -> bool:
    closure = inspect.signature(cls.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def refusal(config: dict[str, Any], kinds: Iterable[Kind]) -> str | None:
    """Why ``train`` cannot drive the optimizer ``config`` (a registry config whose values
    are valid) on gradients of ``kinds``; ``None`` where it can."""
    cls = config["class"]
    if _needs_closure(cls):
        return (
            f"{cls.__name__}.step() needs a closure that evaluates the loss again, and train "
            "calls step() once per batch, without one"
        )
    # foreach and fused choose how a dense step runs, not what it takes; fused would compile
    trial = {k: v for k, v in config.items() if k not in ("foreach", "fused")}
    for kind in kinds:
        what = "sparse" if kind[1] else f"dense {kind[0]}-D"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                create_optimizer([_stand_in(kind)], trial).step()
        except Exception as err:  # whatever it refuses a batch with, the ranks would meet
            return f"on a {what} parameter's gradient: {type(err).__name__}: {err}"
    return None


#: The classes a built-in workload's step refuses, besides those that need a closure.
CANNOT_DRIVE = {
    "SparseAdam": "dense gradients",
    "Muon": "vectors (biases)",
    "BaseCustomOptimizer": "any gradient: it is a base class",
}
#: ``torch.optim``'s classes that take sparse gradients (gradfleet's declare it: ``sparse``).
TORCH_SPARSE = {"SGD", "Adagrad", "SparseAdam"}


def shortest_names(source: dict[str, type]) -> dict[str, type]:
    """Each class of a registry table under its shortest name ("adam" rather than
    "adamoptimizer"), sorted by name."""
    shortest: dict[type, str] = {}
    for name, cls in source.items():
        if len(name) < len(shortest.get(cls, name + "_")):
            shortest[cls] = name
    return {name: cls for cls, name in sorted(shortest.items(), key=lambda kv: kv[1])}


def offered() -> dict[str, type]:
    """Each optimizer ``train`` can drive on a dense model, under its shortest name:
    gradfleet's, then ``torch.optim``'s."""
    return {
        name: cls
        for source in (GRADFLEET_OPTIMIZERS, TORCH_OPTIMIZERS)
        for name, cls in shortest_names(source).items()
        if not _needs_closure(cls) and cls.__name__ not in CANNOT_DRIVE
    }


def takes_sparse(cls: type) -> bool:
    """Whether ``cls`` also steps on a sparse embedding's gradient (the ``ctr`` workload)."""
    if issubclass(cls, GradfleetOptimizer):
        return cls.sparse is not None
    return cls.__name__ in TORCH_SPARSE


def closest_names(name: str, choices: dict[str, type]) -> list[str]:
    """The names of ``choices`` that ``name`` may be a misspelling of (any alias of theirs,
    e.g. ``adamoptimizer``, counts as their name)."""
    aliases = {
        alias: shown
        for source in (GRADFLEET_OPTIMIZERS, TORCH_OPTIMIZERS)
        for alias, cls in source.items()
        for shown, chosen in choices.items()
        if cls is chosen
    }
    close = difflib.get_close_matches(name.strip().lower(), aliases, n=6, cutoff=0.6)
    return list(dict.fromkeys(aliases[alias] for alias in close))[:3]


def unknown(name: str, choices: dict[str, type]) -> str:
    """The one line for a name that is no optimizer: what it may have meant, then every
    name on offer."""
    close = closest_names(name, choices)
    meant = f"did you mean {' or '.join(close)}? " if close else ""
    return f"unknown optimizer {name!r}; {meant}the optimizers: {', '.join(choices)}"


def lookup(name: str | type, choices: dict[str, type] | None = None) -> type:
    """The class ``-o NAME`` names (any registry name); a name that is none is a
    :class:`ConfigError` that names what it may have meant among ``choices`` (by default
    :func:`offered`) and lists them."""
    if inspect.isclass(name):
        return name
    key = str(name).strip().lower()
    for source in (GRADFLEET_OPTIMIZERS, TORCH_OPTIMIZERS):
        if key in source:
            return source[key]
    raise ConfigError(unknown(str(name), offered() if choices is None else choices))


def gradient_kinds(model: torch.nn.Module) -> set[Kind]:
    """The kinds of gradient ``model``'s parameters get."""
    sparse = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    }
    return {(p.dim(), id(p) in sparse) for p in model.parameters() if p.requires_grad}


def check_trainable(config: dict[str, Any], kinds: Iterable[Kind], workload: str) -> None:
    """A :class:`ConfigError` unless ``train`` can drive ``config`` (valid values, a class)
    on the workload's kinds of gradient."""
    why = refusal(config, sorted(kinds))
    if why is not None:
        raise ConfigError(
            f"optimizer {config['class'].__name__} cannot train workload {workload}: {why} "
            "(gradfleet list shows the optimizers it can)"
        )
