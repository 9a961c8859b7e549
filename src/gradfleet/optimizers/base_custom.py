"""RETURNN's ``BaseCustomOptimizer``: write ONE per-parameter update, get dense and sparse.

This is gradfleet's extension point for new algorithms.  A subclass implements
``_apply_var(grad, var, indices=None)`` (RETURNN's ``_apply``; in torch ``_apply`` is already
the base class's step driver) with the helpers below, and the same code then serves dense
gradients (``indices is None``) and row-sparse ones (``grad`` holds the rows listed by
``indices``, duplicates kept, NOT summed):

=====================================  ==========================  =========================
helper                                 dense (``indices=None``)    sparse (TF op)
=====================================  ==========================  =========================
``self._gather(t, indices)``           ``t``                       ``t[indices]`` (gather)
``self._assign(var, value, indices)``  ``var[:] = value``          ``scatter_update``; of
                                                                   duplicates the LAST wins
``self._assign_add(var, value, ...)``  ``var += value``            ``scatter_add``, once per
                                                                   occurrence
``self._assign_sub(var, value, ...)``  ``var -= value``            ``scatter_sub``, once per
                                                                   occurrence
=====================================  ==========================  =========================

``self._get_slot(var, name)`` returns a slot declared in ``slots``; ``self._hp`` holds the
hyperparameters declared in ``hyperparameters`` as 0-dim tensors in ``var``'s dtype (Python
floats rounded through float32 first, as TF casts them); ``self._shared`` is the group's
non-slot state (see ``gradfleet.optimizer``).  Hyperparameters declared in
``hyperparameters`` are validated, may be callables, may be overridden per param group, and
are passed to ``BaseCustomOptimizer.__init__`` as keyword arguments (RETURNN's ``**kwargs``).

Worked example, momentum-free "sign SGD" with a decaying average of ``|g|``::

    class SignSGD(BaseCustomOptimizer):
        hyperparameters = {"lr": _hyper.NON_NEGATIVE, "beta": _hyper.UNIT_OPEN_RIGHT}
        slots = {"a": 0.0}

        def __init__(self, params, learning_rate, beta=0.9, **kwargs):
            super().__init__(params, learning_rate, beta=beta, **kwargs)

        def _apply_var(self, grad, var, indices=None):
            a, beta = self._get_slot(var, "a"), self._hp["beta"]
            a_g = beta * self._gather(a, indices) + (1 - beta) * grad.abs()
            self._assign(a, a_g, indices)
            self._assign_sub(var, self._hp["lr"] * torch.sign(grad) * a_g, indices)

Semantics are those of RETURNN on TF1 reference variables (reads after a scatter see the new
values); RETURNN on resource variables reads stale slots on the sparse path (spec 13.1).
"""

from __future__ import annotations

from typing import Any

import torch

from gradfleet import _hyper
from gradfleet.optimizer import Optimizer


class BaseCustomOptimizer(Optimizer):
    """RETURNN's ``BaseCustomOptimizer(learning_rate, use_locking=False, name=None)``:
    ``BaseCustomOptimizer(params, learning_rate, use_locking=False, name=None, **options)``;
    ``name=None`` means the class name.  Not usable by itself: stepping raises
    ``NotImplementedError``.  See the module docstring for how to subclass it.
    """

    sparse = "raw"

    def __init__(
        self,
        params: Any,
        learning_rate: _hyper.Hyper,
        use_locking: bool = False,
        name: str | None = None,
        **options: Any,
    ) -> None:
        own = {k: options.pop(k) for k in list(options) if self._is_own_option(k)}
        missing = sorted(k for k in self._own_keys() if k not in own)
        if missing:
            raise TypeError(
                f"{type(self).__name__}: hyperparameter(s) {missing} must be passed to "
                f"BaseCustomOptimizer.__init__ as keyword arguments"
            )
        defaults = dict(own, lr=learning_rate)
        name = type(self).__name__ if name is None else name
        super().__init__(params, defaults, name, use_locking, **options)
        self._hp: dict[str, Any] | None = None
        self._shared: dict[str, torch.Tensor] | None = None
        self._var: Any = None  # the variable being updated and its slots (see _run)
        self._slots: dict[str, Any] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_apply" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__}: implement _apply_var(grad, var, indices=None), gradfleet's "
                f"name for RETURNN's BaseCustomOptimizer._apply; _apply drives the whole step"
            )

    @classmethod
    def _own_keys(cls) -> set[str]:
        """The group keys a subclass passes to ``__init__``: hyperparameters (packed ones,
        ``betas``, under their torch name) and flags, but not ``lr``."""
        packed = cls._packed()
        loose = {k for k in cls.hyperparameters if not any(k in t for t in packed.values())}
        return (loose | set(packed) | set(cls.flags)) - {"lr"}

    def _is_own_option(self, key: str) -> bool:
        return key in self._own_keys()

    # ------------------------------------------------------------------ the extension point
    def _apply_var(
        self, grad: torch.Tensor, var: torch.Tensor, indices: torch.Tensor | None = None
    ) -> None:
        """Update ``var`` (and its slots) in place from ``grad``; see the module docstring."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement _apply_var(grad, var, indices=None); "
            f"BaseCustomOptimizer is a base class: subclass it and implement _apply_var "
            f"(RETURNN's _apply), or use e.g. CustomGradientDescentOptimizer"
        )

    # ------------------------------------------------------------------ helpers
    def _get_slot(self, var: torch.Tensor, name: str) -> torch.Tensor:
        """The slot ``name`` of ``var`` (declared in the class's ``slots``)."""
        slots = self._slots if var is self._var else self.state.get(var, {})
        if name not in slots:
            raise KeyError(f"{type(self).__name__}: no slot {name!r}; declare it in `slots`")
        return slots[name]

    @staticmethod
    def _gather(tensor: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
        """``tensor`` (dense) or its rows ``indices`` (one row per occurrence)."""
        return tensor if indices is None else tensor.index_select(0, indices)

    @staticmethod
    def _assign(ref: torch.Tensor, value: torch.Tensor, indices: torch.Tensor | None = None):
        """``ref[:] = value``, or ``ref[indices] = value`` where the last duplicate wins."""
        if indices is None:
            return ref.copy_(value)
        rows, last = _last_occurrences(indices)
        return ref.index_copy_(0, rows, value.index_select(0, last))

    @staticmethod
    def _assign_add(ref: torch.Tensor, value: torch.Tensor, indices: torch.Tensor | None = None):
        """``ref += value``, or ``ref[i] += value[k]`` for every occurrence ``k`` of row ``i``."""
        if indices is None:
            return ref.add_(value)
        return ref.index_add_(0, indices, value)

    @staticmethod
    def _assign_sub(ref: torch.Tensor, value: torch.Tensor, indices: torch.Tensor | None = None):
        """``ref -= value``, or ``ref[i] -= value[k]`` for every occurrence ``k`` of row ``i``."""
        if indices is None:
            return ref.sub_(value)
        return ref.index_add_(0, indices, value, alpha=-1)

    # ------------------------------------------------------------------ routing
    # The dense fast paths (gradfleet.kernels) pass TensorLists for p, g and the slots; the
    # helpers above are elementwise, so _apply_var runs on them unchanged.
    def _apply_dense(self, p, g, slots, hp, shared):
        self._run(g, p, None, slots, hp, shared)

    def _apply_sparse(self, p, idx, values, slots, hp, shared):
        self._run(values, p, idx, slots, hp, shared)

    def _run(self, grad, var, indices, slots, hp, shared) -> None:
        self._var, self._slots, self._hp, self._shared = var, slots, hp, shared
        try:
            self._apply_var(grad, var, indices)
        finally:
            self._var, self._slots, self._hp, self._shared = None, {}, None, None


def _last_occurrences(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique rows, position of each row's last occurrence in ``indices``)."""
    rows, inverse = torch.unique(indices, return_inverse=True)
    positions = torch.arange(indices.numel(), device=indices.device)
    last = torch.full_like(rows, -1).scatter_reduce_(0, inverse, positions, "amax")
    return rows, last
