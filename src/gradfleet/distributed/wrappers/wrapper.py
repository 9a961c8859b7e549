"""Shared base of the distributed wrappers: a ``torch.optim.Optimizer`` around another one.

The wrapper owns no parameters: ``param_groups``, ``state`` and ``defaults`` are properties that
read the wrapped optimizer, so learning-rate schedulers and checkpoints see one set of groups.
It adds the TF-1.x methods (``compute_gradients``, ``apply_gradients``, ``minimize``,
``get_slot``, ``get_slot_names``, ``variables``, ``get_name``): they delegate to the wrapped
optimizer when it has them (gradfleet optimizers) and fall back to autograd + ``step()`` for plain
``torch.optim`` optimizers. Subclasses hook in through :meth:`_after_local_step` (what happens
after each local update) and :meth:`_wrapper_state` / :meth:`_load_wrapper_state`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..common.apply import GradsAndVars, apply_gradients

__all__ = ["WrapperOptimizer", "GradsAndVars"]

STATE_FORMAT = 1


def check_optimizer(owner: str, opt: Any) -> torch.optim.Optimizer:
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"{owner}: the wrapped optimizer must be a torch.optim.Optimizer (gradfleet or "
            f"torch), got {type(opt).__name__}"
        )
    return opt


def check_int(owner: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int ``>= minimum``, else a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


class WrapperOptimizer(torch.optim.Optimizer):
    """Base class: forwards the optimizer protocol to ``opt`` and adds TF-style methods."""

    def __init__(self, opt: torch.optim.Optimizer, name: str) -> None:
        # torch.optim.Optimizer.__init__ is not called: groups and state live in ``opt``.
        self._opt = check_optimizer(type(self).__name__, opt)
        self._init_wrapper(name)

    def _init_wrapper(self, name: str) -> None:
        """Set up the bits of ``torch.optim.Optimizer`` a wrapper needs (hooks, name)."""
        self._name = name
        for hooks in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()

    # ----------------------------------------------------------------- torch protocol
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._opt

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def params(self) -> list[torch.Tensor]:
        """All parameters of the wrapped optimizer, in group order."""
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def init_state(self) -> None:
        """The wrapped optimizer's ``init_state()`` (slots of the parameters with a gradient,
        no update; RETURNN's torch engine calls it before a CUDA-graph capture)."""
        inner = getattr(self.optimizer, "init_state", None)
        if inner is None:
            raise NotImplementedError(
                f"{type(self).__name__}: the wrapped {type(self.optimizer).__name__} has no "
                f"init_state(); its state is created by its first step"
            )
        inner()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}: add parameter groups to the wrapped optimizer before wrapping"
        )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One local update of the wrapped optimizer on the current ``.grad``, then the
        wrapper's own schedule (averaging / elastic exchange)."""
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self._after_local_step()
        return loss

    def _after_local_step(self) -> int:
        """Run after every local update; returns how much ``global_step`` advances."""
        return 0

    # ----------------------------------------------------------------- checkpoints
    def _wrapper_state(self) -> dict[str, Any]:
        return {}

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"format", "wrapper", "optimizer": inner state_dict, "wrapper_state": ...}``."""
        return {
            "format": STATE_FORMAT,
            "wrapper": type(self).__name__,
            "optimizer": self.optimizer.state_dict(),
            "wrapper_state": self._wrapper_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a dict from :meth:`state_dict` of the same wrapper class."""
        missing = {"format", "wrapper", "optimizer", "wrapper_state"} - set(state_dict)
        if missing:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: not a wrapper state_dict, missing keys "
                f"{sorted(missing)}"
            )
        if state_dict["wrapper"] != type(self).__name__:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state_dict was saved by "
                f"{state_dict['wrapper']}"
            )
        if state_dict["format"] != STATE_FORMAT:
            raise ValueError(f"unsupported wrapper state format {state_dict['format']!r}")
        self._check_wrapper_state(state_dict["wrapper_state"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._load_wrapper_state(state_dict["wrapper_state"])

    def _check_wrapper_state(self, counters: dict[str, Any]) -> None:
        """Validate the wrapper part before anything is loaded (load is all-or-nothing)."""
        expected = set(self._wrapper_state())
        if set(counters) != expected:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: wrapper_state keys "
                f"{sorted(counters)} do not match {sorted(expected)}"
            )

    # ----------------------------------------------------------------- TF-style API
    def get_name(self) -> str:
        return self._name

    def compute_gradients(
        self, loss: torch.Tensor | Callable[[], torch.Tensor], var_list: Sequence | None = None
    ) -> GradsAndVars:
        """Gradients of ``loss`` (a tensor or a no-argument callable) for ``var_list``
        (default: every parameter of the wrapped optimizer that requires grad)."""
        inner = getattr(self.optimizer, "compute_gradients", None)
        if inner is not None:
            return list(inner(loss, var_list=var_list))
        return autograd_gradients(loss, var_list if var_list is not None else self.params())

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[Any, torch.Tensor]], global_step: Any = None
    ) -> None:
        """TF's ``apply_gradients``: a local update with these gradients, then the wrapper's
        schedule; ``global_step`` (0-dim int tensor) advances as the wrapper defines."""
        check_global_step(type(self).__name__, global_step)
        pairs = check_grads_and_vars(type(self).__name__, grads_and_vars)
        self._apply_inner(pairs)
        advance = self._after_local_step()
        if global_step is not None and advance:
            with torch.no_grad():
                global_step.add_(advance)

    def minimize(
        self,
        loss: torch.Tensor | Callable[[], torch.Tensor],
        global_step: Any = None,
        var_list: Sequence | None = None,
    ) -> None:
        """``apply_gradients(compute_gradients(loss, var_list), global_step)``."""
        self.apply_gradients(self.compute_gradients(loss, var_list=var_list), global_step)

    def _apply_inner(self, pairs: GradsAndVars) -> None:
        """Apply ``pairs`` with the wrapped optimizer, without any ``global_step``."""
        apply_gradients(self.optimizer, pairs)

    def get_slot(self, var: torch.Tensor, name: str) -> torch.Tensor | None:
        inner = getattr(self.optimizer, "get_slot", None)
        if inner is not None:
            return inner(var, name)
        value = self.state.get(var, {}).get(name)
        return value if isinstance(value, torch.Tensor) else None

    def get_slot_names(self) -> list[str]:
        inner = getattr(self.optimizer, "get_slot_names", None)
        if inner is not None:
            return list(inner())
        names = {
            k
            for p, s in self.state.items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor) and v.shape == p.shape
        }
        return sorted(names)

    def variables(self) -> list[torch.Tensor]:
        inner = getattr(self.optimizer, "variables", None)
        if inner is not None:
            return list(inner())
        return [
            v
            for p in self.params()
            for v in self.state.get(p, {}).values()
            if isinstance(v, torch.Tensor)
        ]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


# --------------------------------------------------------------------- helpers
def check_global_step(owner: str, global_step: Any) -> None:
    """``global_step`` must be None or a 0-dim int64 tensor (TF's global step variable)."""
    if global_step is None:
        return
    if (
        not isinstance(global_step, torch.Tensor)
        or global_step.dtype != torch.int64
        or global_step.dim() != 0
    ):
        raise TypeError(f"{owner}: global_step must be None or a 0-dim torch.int64 tensor")


def check_grads_and_vars(owner: str, grads_and_vars: Iterable) -> GradsAndVars:
    """Materialise ``grads_and_vars`` and apply TF's checks (non-empty, some gradient)."""
    pairs = [(g, v) for g, v in grads_and_vars]
    if not pairs:
        raise ValueError(f"{owner}.apply_gradients: Must supply at least one variable")
    if all(g is None for g, _ in pairs):
        raise ValueError(
            f"{owner}.apply_gradients: No gradients provided for any variable: "
            f"{[tuple(v.shape) for _, v in pairs]}"
        )
    return pairs


def autograd_gradients(
    loss: torch.Tensor | Callable[[], torch.Tensor], var_list: Sequence[torch.Tensor]
) -> GradsAndVars:
    """``[(d loss / d v or None, v)]`` with autograd; ``.grad`` is left untouched."""
    value = loss() if callable(loss) else loss
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError("compute_gradients: loss must be a scalar tensor or return one")
    vs = list(var_list)
    trainable = [v for v in vs if v.requires_grad]
    grads = torch.autograd.grad(value.reshape(()), trainable, allow_unused=True)
    by_id = {id(v): g for v, g in zip(trainable, grads, strict=True)}
    return [(by_id.get(id(v)), v) for v in vs]
