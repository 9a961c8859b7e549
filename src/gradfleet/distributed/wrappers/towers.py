"""``TowerOptimizer``: gather the towers' gradients, apply them once (TF ``contrib.estimator``).

Used inside :func:`gradfleet.distributed.replicate_model`, which runs one copy of the model
("tower") per device on a slice of the batch. In tower ``t`` of ``T``:

* ``compute_gradients(loss)`` differentiates ``loss / T`` (``loss`` when the reduction is
  ``"sum"``) with respect to *that tower's* parameters and returns ``(grad, shared_param)``;
* ``apply_gradients(grads_and_vars, global_step)`` (and ``minimize``, and ``step()`` after a
  ``backward()``) only records the call.

When every tower has finished, the ``k``-th call of every tower is merged per parameter --
dense gradients summed, sparse ones concatenated (duplicates are then scatter-added by the
optimizer, as TF's ``IndexedSlices`` concat) -- and the wrapped optimizer is applied **once**, with
the last tower's ``global_step``. Outside ``replicate_model`` (or with one tower) every method
delegates unchanged, as TF does for ``T == 1``.

TF argument mapping: ``optimizer_or_optimizer_fn`` is an optimizer or a no-argument factory,
built on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..common.apply import GradsAndVars, apply_gradients
from .wrapper import (
    WrapperOptimizer,
    autograd_gradients,
    check_global_step,
    check_grads_and_vars,
    check_optimizer,
)

__all__ = ["TowerOptimizer", "TowerContext", "current_tower"]

_tls = threading.local()


@dataclass
class TowerContext:
    """State of one replicated call, shared by its tower threads."""

    num_towers: int
    scale_loss: bool
    #: per tower: {id(shared param): tower param}
    tower_params: list[dict[int, torch.Tensor]]
    #: per tower: {id(tower param): shared param}
    shared_params: list[dict[int, torch.Tensor]]
    #: {id(optimizer): (optimizer, calls per tower)}; a call is (grads_and_vars, global_step)
    calls: dict[int, tuple[TowerOptimizer, list[list[tuple[GradsAndVars, Any]]]]] = field(
        default_factory=dict
    )
    #: the last tower's calls in order, as (optimizer id, ordinal): the order of application
    last_order: list[tuple[int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, opt: TowerOptimizer, tower: int, pairs: GradsAndVars, gstep: Any) -> None:
        with self.lock:
            _, per_tower = self.calls.setdefault(
                id(opt), (opt, [[] for _ in range(self.num_towers)])
            )
            per_tower[tower].append((pairs, gstep))
            if tower == self.num_towers - 1:
                self.last_order.append((id(opt), len(per_tower[tower]) - 1))


def current_tower() -> tuple[TowerContext | None, int]:
    """``(context, tower index)`` of the calling thread, ``(None, 0)`` outside towers."""
    return getattr(_tls, "ctx", None), getattr(_tls, "tower", 0)


def _enter_tower(ctx: TowerContext | None, tower: int) -> None:
    _tls.ctx, _tls.tower = ctx, tower


class TowerOptimizer(WrapperOptimizer):
    """Wrap an optimizer (or a factory of one) for use inside ``replicate_model``."""

    def __init__(
        self,
        optimizer_or_optimizer_fn: torch.optim.Optimizer | Callable[[], torch.optim.Optimizer],
        name: str = "TowerOptimizer",
    ) -> None:
        if isinstance(optimizer_or_optimizer_fn, torch.optim.Optimizer):
            self._opt, self._opt_fn = optimizer_or_optimizer_fn, None
        elif callable(optimizer_or_optimizer_fn):
            self._opt, self._opt_fn = None, optimizer_or_optimizer_fn
        else:
            raise TypeError(
                "TowerOptimizer: optimizer_or_optimizer_fn must be an optimizer or a "
                f"no-argument callable returning one, got {type(optimizer_or_optimizer_fn)}"
            )
        self._build_lock = threading.Lock()
        self._init_wrapper(name)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._opt is None:
            with self._build_lock:  # towers may ask for it concurrently
                if self._opt is None:
                    assert self._opt_fn is not None
                    self._opt = check_optimizer("TowerOptimizer", self._opt_fn())
        return self._opt

    @staticmethod
    def _tower() -> tuple[TowerContext | None, int]:
        ctx, tower = current_tower()
        if ctx is None or ctx.num_towers == 1:
            return None, 0
        return ctx, tower

    # ----------------------------------------------------------------- TF-style API
    def compute_gradients(self, loss: Any, var_list: Any = None) -> GradsAndVars:
        """Gradients of ``loss`` (scaled by ``1/T`` unless the reduction is SUM) for this
        tower's copies of ``var_list``, paired with the shared parameters."""
        ctx, tower = self._tower()
        if ctx is None:
            return super().compute_gradients(loss, var_list=var_list)
        value = loss() if callable(loss) else loss
        if ctx.scale_loss:
            value = value / ctx.num_towers
        shared = list(var_list) if var_list is not None else self.params()
        local = [ctx.tower_params[tower].get(id(v), v) for v in shared]
        inner = getattr(self.optimizer, "compute_gradients", None)
        if inner is not None:
            pairs = list(inner(value, var_list=local))
        else:
            pairs = autograd_gradients(value, local)
        back = ctx.shared_params[tower]
        return [(g, back.get(id(v), v)) for g, v in pairs]

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None) -> None:
        """In a tower: record the call. Otherwise: apply with the wrapped optimizer, which
        increments ``global_step`` once."""
        check_global_step("TowerOptimizer", global_step)
        pairs = check_grads_and_vars("TowerOptimizer", grads_and_vars)
        ctx, tower = self._tower()
        if ctx is None:
            self._apply_now(pairs, global_step)
            return
        back = ctx.shared_params[tower]
        ctx.record(self, tower, [(g, back.get(id(v), v)) for g, v in pairs], global_step)

    def _apply_now(self, pairs: GradsAndVars, global_step: Any) -> None:
        apply_gradients(self.optimizer, pairs, global_step)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """In a tower: record this tower's ``.grad`` (scaled like ``compute_gradients``) as an
        ``apply_gradients`` call and clear it. Otherwise: the wrapped optimizer's step."""
        ctx, tower = self._tower()
        if ctx is None:
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs: GradsAndVars = []
        for p in self.params():
            tp = ctx.tower_params[tower].get(id(p), p)
            g, tp.grad = tp.grad, None
            if g is not None and ctx.scale_loss:
                g = g / ctx.num_towers
            pairs.append((g, p))
        ctx.record(self, tower, check_grads_and_vars("TowerOptimizer", pairs), None)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        ctx, tower = self._tower()
        if ctx is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        for p in self.params():
            ctx.tower_params[tower].get(id(p), p).grad = None
