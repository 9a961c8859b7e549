"""The base class of every gradfleet optimizer: a ``torch.optim.Optimizer`` with TF1's API.

A subclass describes one algorithm declaratively and writes its maths once:

* ``hyperparameters``: the floats of TF's maths (cast like TF, see ``_hyper.scalar``) mapped
  to their allowed range; ``"lr"`` holds TF's ``learning_rate``; keys listed in
  ``unrounded`` skip TF's float32 rounding of Python floats;
* ``torch_names``: torch's argument names for this class's TF ones (``gradfleet._torch_names``;
  ``lr`` is implied).  A torch name mapped to a tuple of TF names (``"betas": ("beta1",
  "beta2")``) is also how the param groups store them, because torch's momentum-cycling
  schedulers (``OneCycleLR``, ``CyclicLR``) edit ``group["betas"]``; ``lr`` and ``momentum``
  are stored under torch's names for the same reason, every other key under TF's;
* ``slots``: slot name -> initial fill value (slots are created lazily, in the parameter's
  dtype, the first time the parameter gets a gradient, as TF's ``_create_slots`` does);
  override ``_slot_fills(group)`` when the set or the fills depend on the group's options
  (Adagrad's ``initial_accumulator_value``, centered RMSProp's ``mg``);
* ``sparse``: how a torch sparse COO gradient (row-sparse, as ``nn.Embedding(sparse=True)``
  makes) reaches ``_apply_sparse``: ``"sum_duplicates"`` (TF's default ``tf.unique`` +
  ``unsorted_segment_sum``), ``"raw"`` (duplicates kept; RETURNN's custom family and
  GradientDescent), or ``None`` (sparse gradients are rejected);
* ``_apply_dense(p, g, slots, hp, shared)`` and ``_apply_sparse(p, idx, values, slots, hp,
  shared)``: the per-parameter update, in place; ``hp`` holds 0-dim tensors in ``p``'s dtype;
* ``_init_shared(group)`` / ``_finish(group, shared)``: non-slot state (Adam's beta powers),
  kept per parameter group in ``group["non_slot"]`` and advanced once per step after all
  parameters, whenever any parameter of the optimizer had a gradient (TF's ``_finish``).

Each step validates every gradient before changing anything, so bad input leaves parameters,
slots and counters untouched.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import numpy as np
import torch

from gradfleet import _groups, _hyper, _torch_names, kernels
from gradfleet._hyper import Range

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OPTIONS = ("foreach", "fused", "check_finite")


class HyperparametersReplacedWarning(UserWarning):
    """``load_state_dict`` gave the optimizer the saved param groups' hyperparameters (torch's
    rule) where they differ from the ones it was built with; the message names each."""


class Optimizer(torch.optim.Optimizer):
    """Base class: torch's Optimizer plus TF1's ``compute_gradients``/``apply_gradients``/
    ``minimize``/``get_slot`` API.  See the module docstring for how to write a subclass.

    Options every subclass accepts as keyword arguments (torch-side, not in TF):

    * ``foreach`` / ``fused``: implementation switch, same meaning as in ``torch.optim``.
    * ``lr`` and the class's ``torch_names`` (``betas``, ``eps``, ...): torch's names for TF's
      arguments (giving both names is a ``TypeError``); torch-only arguments such as
      ``weight_decay`` are refused with the alternative unless they have their "off" value
      (``gradfleet._torch_names``).
    * ``check_finite``: if True, a step whose gradients hold NaN or Inf raises
      ``FloatingPointError`` naming the parameter and changes nothing.  The default (False)
      is TensorFlow's behaviour: non-finite values flow into parameters and slots.
    """

    hyperparameters: ClassVar[dict[str, Range]] = {"lr": _hyper.NON_NEGATIVE}
    slots: ClassVar[dict[str, float]] = {}
    sparse: ClassVar[str | None] = "sum_duplicates"
    #: Option keys (bools/ints) that live in the param group but are not cast like floats.
    flags: ClassVar[tuple[str, ...]] = ()
    #: Hyperparameters the seed's code uses as Python floats inside tensor ops: converted
    #: straight to the parameter's dtype, not rounded through float32 first.
    unrounded: ClassVar[tuple[str, ...]] = ()
    #: Fast paths whose use of ``_apply_dense`` this class supports (``gradfleet.kernels``):
    #: "foreach" needs elementwise maths (no branching on data), "fused" needs it traceable
    #: into one graph whose only tensors are the step's inputs (``kernels/fused.py``).
    fast_paths: ClassVar[tuple[str, ...]] = ("foreach", "fused")
    #: torch's argument names: torch name -> TF name, or the TF names a torch tuple packs.
    torch_names: ClassVar[dict[str, str | tuple[str, ...]]] = {}
    #: Appended to the error for learning rate 0 by a class whose maths has no lr -> 0 limit.
    lr_zero_hint: ClassVar[str] = ""

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        name: str,
        use_locking: bool = False,
        **options: Any,
    ) -> None:
        owner = type(self).__name__
        _torch_names.check_torch_only(owner, options)
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword argument(s) {unknown}; "
                f"torch-side options are {list(_OPTIONS)}"
            )
        if not name:
            raise ValueError(f"{type(self).__name__}: Must specify the optimizer name")
        self._name = name
        self.use_locking = use_locking  # accepted for TF compatibility; torch needs no locks
        self.check_finite = bool(options.get("check_finite", False))
        defaults = dict(defaults, foreach=options.get("foreach"), fused=options.get("fused"))
        for key in self.flags:  # TF's Python bools; "False" (a string) would read as True
            flag = defaults[key]
            if not isinstance(flag, bool | int) or flag not in (0, 1):
                raise TypeError(f"{owner}: {key} must be a bool, got {flag!r}")
            defaults[key] = bool(flag)
        self._check_values(self._values(defaults))
        super().__init__(params, defaults)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # torch's names (``lr=`` from torch.optim code and RETURNN's torch engine, ``betas=``,
        # ``eps=``, ...) as aliases of TF's in every subclass constructor that takes them.
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_accepts_torch_names", False):
            cls.__init__ = _torch_names.accept_torch_names(
                init, cls.torch_names, cls.hyperparameters
            )

    # ------------------------------------------------------------------ hyperparameter values
    @classmethod
    def _packed(cls) -> dict[str, tuple[str, ...]]:
        """Group keys holding a tuple of TF hyperparameters (``betas``)."""
        return {k: v for k, v in cls.torch_names.items() if isinstance(v, tuple)}

    def _values(self, group: dict[str, Any]) -> dict[str, Any]:
        """The hyperparameters of ``group`` by ``hyperparameters`` key, tuples unpacked."""
        out = {}
        owner = type(self).__name__
        for key, names in self._packed().items():
            packed = group[key]
            if not isinstance(packed, tuple | list) or len(packed) != len(names):
                raise TypeError(
                    f"{owner}: {key} must be a tuple ({', '.join(names)}), got {packed!r}"
                )
            out.update(zip(names, packed))
        for key in self.hyperparameters:
            if key not in out:
                out[key] = group[key]
        return out

    def _check_values(self, values: dict[str, Any]) -> None:
        """Type and range of every hyperparameter (callables: when called; a required one
        the constructor did not get: in each param group)."""
        owner = type(self).__name__
        for key, allowed in self.hyperparameters.items():
            if values[key] is _hyper.REQUIRED:
                continue
            hint = self.lr_zero_hint if key == "lr" else ""
            _hyper.check(owner, _tf_name(key), values[key], allowed, hint)

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        owner = type(self).__name__
        if not isinstance(param_group, dict):
            raise TypeError(f"{owner}: param_group must be a dict, got {type(param_group)}")
        param_group = _groups.canonical(self, param_group)  # TF and torch names both work
        _groups.check_unique(self, param_group)
        # torch-only settings (weight_decay, maximize, ...) in a group, as in the constructor:
        # their "off" value is dropped, any other refused (a group would ignore it silently).
        own = {"lr", *self.hyperparameters, *self.flags, *self._packed()}
        foreign = {k: v for k, v in param_group.items() if k in _torch_names.TORCH_ONLY}
        foreign = {k: v for k, v in foreign.items() if k not in own}
        _torch_names.check_torch_only(f"{owner}'s param group", dict(foreign))
        for key in foreign:
            del param_group[key]
        merged = {**self.defaults, **param_group}
        missing = [key for key, value in merged.items() if value is _hyper.REQUIRED]
        if missing:
            names = ", ".join(
                _tf_name(k) + (" (or torch's lr)" if k == "lr" else "") for k in missing
            )
            raise TypeError(
                f"{owner}: missing {names}: pass it to the constructor or give it in every "
                f"param group (param group {len(self.param_groups)} has none)"
            )
        _check_paths(self, merged)
        values = self._values(merged)
        self._check_values(values)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.dtype not in _FLOAT_DTYPES:
                raise TypeError(
                    f"{owner}: parameters must be float16, bfloat16, float32 or float64, "
                    f"got {p.dtype}"
                )
        group["non_slot"] = self._init_shared(group)

    # ------------------------------------------------------------------ copies and pickles
    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy``, ``pickle`` and ``torch.save(opt)`` keep: torch's
        ``defaults``/``state``/``param_groups`` and every other attribute of the instance
        (``check_finite``, ``use_locking``, the name, a subclass's own settings), which
        torch's ``__getstate__`` drops.  Left out, as torch leaves them out: the hooks
        registered on this instance and torch's bookkeeping that ``__setstate__`` makes
        anew; and gradfleet's caches (the compiled kernels' step plan and the 0-dim
        hyperparameter tensors), which the copy builds again on its first step."""
        state = super().__getstate__()
        for key, value in self.__dict__.items():
            if key not in state and key not in _NOT_COPIED and not key.startswith("_optimizer_"):
                state[key] = value
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's __setstate__ adds ``differentiable`` to the defaults (its own optimizers
        # read it); a copy should not gain it.  (torch's load_state_dict calls this too, with
        # the state and param groups only.)
        defaults = state.get("defaults", self.__dict__.get("defaults", {}))
        had_differentiable = "differentiable" in defaults
        super().__setstate__(state)
        if not had_differentiable:
            self.defaults.pop("differentiable", None)

    # ------------------------------------------------------------------ subclass hooks
    def _init_shared(self, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {}

    def _shared_state(self, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The non-slot tensors the maths of ``group`` reads: ``group["non_slot"]``, plus
        any the optimizer keeps elsewhere (AdagradDA's caller-owned ``global_step``)."""
        return group["non_slot"]

    def _slot_fills(self, group: dict[str, Any]) -> dict[str, float]:
        """Slot name -> initial fill for the parameters of ``group``."""
        return self.slots

    def _finish(self, group: dict[str, Any], shared: dict[str, torch.Tensor], hp_for) -> None:
        pass

    def _apply_dense(self, p, g, slots, hp, shared) -> None:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} does not implement _apply_dense")

    def _apply_sparse(self, p, idx, values, slots, hp, shared) -> None:  # pragma: no cover
        raise NotImplementedError(f"{type(self).__name__} does not implement _apply_sparse")

    def _group_hyper(self, group: dict[str, Any], hp_for: Callable[..., dict[str, Any]]):
        """The ``hp_for`` the maths of ``group`` sees: ``hp_for`` itself, or a wrapper adding
        values derived from the hyperparameters (FTRL's ``l2_eff``)."""
        return hp_for

    def _update_group(self, group, params, grads, hp_for, record=None) -> None:
        """Apply one step to the parameters of one group.

        ``hp_for(dtype, device)`` returns the group's hyperparameters as 0-dim tensors.
        Sparse gradients take the per-parameter reference loop; dense ones take the path
        ``group["foreach"]``/``group["fused"]`` select (``gradfleet.kernels.resolve_path``).
        ``record`` gets the group's fused kernel calls, with a None entry for anything a
        ``kernels.plan.StepPlan`` cannot replay.
        """
        hp_for = self._group_hyper(group, hp_for)
        shared = self._shared_state(group)
        path = kernels.resolve_path(self, group)
        if record is not None and path != "fused":
            record.append(None)
        fast: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p, g in zip(params, grads):
            if g.is_sparse:  # sparse rules always take the reference path
                if record is not None:
                    record.append(None)
                idx, values = sparse_rows(g, self.sparse == "sum_duplicates")
                slots = self._slots_for(p, group)
                self._apply_sparse(p, idx, values, slots, hp_for(p.dtype, p.device), shared)
            elif path != "loop":
                fast.append((p, g))  # kernels.apply_dense fetches the slots
            else:
                slots = self._slots_for(p, group)
                self._apply_dense(p, g, slots, hp_for(p.dtype, p.device), shared)
        if fast:
            ps, gs = zip(*fast)
            kernels.apply_dense(self, group, list(ps), list(gs), hp_for, path, record)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update from ``p.grad`` of every parameter that has one (torch convention)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compiling = torch.compiler.is_compiling()
        if not compiling:
            # Fused steps replay the bookkeeping of the last full step when nothing it
            # depended on changed (kernels/plan.py); a first step at learning rate 0 may be
            # the slot-creating step below, so it takes the full path.
            plan = self.__dict__.get("_step_plan")
            if plan is not None and (self.state or not self._all_lr_zero()):
                if plan.replay(self):
                    return loss
            self._step_plan = None
        work = [
            [(p, p.grad) for p in group["params"] if p.grad is not None]
            for group in self.param_groups
        ]
        # ``compiling`` first: under torch.compile reading ``self.state`` here would guard on
        # its being empty, and the first step's graph would not serve the second.
        if not compiling and not self.state and self._is_state_initialisation(work):
            for group, pairs in zip(self.param_groups, work):
                self._slots_of([p for p, _ in pairs], group)
            return loss
        if compiling:
            # torch.compile runs ``_init_group`` eagerly while it traces (dynamo's optimizer
            # support): the slots exist before the graph, so the first step's graph is
            # the one every later step reuses.  No plan: the compiled graph is the replay.
            for group in self.param_groups:
                self._init_group(group)
            self._apply(work)
            return loss
        record: list[list | None] = []
        self._apply(work, record)
        self._step_plan = kernels.plan.build(self, record)
        return loss

    def _init_group(self, group: dict[str, Any]) -> None:
        """Create the missing slots of the parameters of ``group`` that have a gradient (what
        a step would create first).  The name is the one torch.compile intercepts."""
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            self._slots_of(params, group)

    def _all_lr_zero(self) -> bool:
        return all(_is_zero_on_host(g["lr"]) for g in self.param_groups)

    def _is_state_initialisation(self, work) -> bool:
        """A first step with learning rate 0 and all-zero gradients only creates the slots.

        ``torch.distributed.checkpoint``'s ``get/set_optimizer_state_dict`` take such a step
        on a fresh optimizer to create its state before loading into it.  As a real step it
        would not be harmless here (AdagradDA's and FTRL's closed forms set the weights from
        the slots; FTRL rejects learning rate 0), so it creates the slots and stops.
        """
        if not any(work) or not self._all_lr_zero():
            return False
        for pairs in work:
            for _, g in pairs:
                if g.is_sparse:
                    return False
                total = g.abs().sum()  # a DTensor's is global: every rank decides alike
                if kernels.dtensor.is_dtensor(total):
                    total = total.full_tensor()
                if bool(total != 0):
                    return False
        return True

    def _apply(self, work: list[list[tuple[torch.Tensor, torch.Tensor]]], record=None) -> None:
        """One update: ``work[i]`` holds the (parameter, gradient) pairs of param group i.

        Lists rather than a dict keyed by tensor: hashing a tensor is a Python call, and on
        the fused path this bookkeeping is a visible share of a step.  ``record`` (from
        ``step``) gets one list per group of the fused kernel calls made (``kernels.plan``).
        """
        if not any(work):
            return
        for pairs in work:
            for p, g in pairs:
                self._validate_gradient(p, g)
        if self.check_finite:
            for pairs in work:
                for p, g in pairs:
                    values = g._values() if g.is_sparse else g
                    if not kernels.dtensor.all_finite(values):
                        raise FloatingPointError(
                            f"{type(self).__name__}: non-finite gradient for parameter of "
                            f"shape {tuple(p.shape)}; no parameter was changed (check_finite=True)"
                        )
        for group, pairs in zip(self.param_groups, work):
            meta = next((p for p, _ in pairs if p.is_meta), None)
            if meta is not None and kernels.resolve_path(self, group) == "fused":
                raise RuntimeError(
                    f"{type(self).__name__}: `fused=True` needs parameters that hold data, got "
                    f"one of shape {tuple(meta.shape)} on the meta device; materialise the "
                    f"model first (Module.to_empty(device=...)) or use foreach=False"
                )
        for group in self.param_groups:
            # Non-slot state (beta powers, step counters) is made at construction, on the
            # parameters' device: for a model built on the meta device it holds no data.  Once
            # the parameters are materialised (Module.to_empty), it is made again on their
            # device, with the initial values an optimizer built on them would have.
            params = group["params"]
            shared = group["non_slot"].values()
            if params and not params[0].is_meta and any(t.is_meta for t in shared):
                group["non_slot"] = self._init_shared(group)
        # Evaluate and validate every group's hyperparameters before touching anything.
        resolvers = [self._hyper_resolver(group) for group in self.param_groups]
        for group, pairs, hp_for in zip(self.param_groups, work, resolvers):
            calls: list | None = [] if record is not None else None
            if pairs:
                params, grads = (list(t) for t in zip(*pairs))
                self._update_group(group, params, grads, hp_for, calls)
            if record is not None:
                record.append(calls)
        for group, hp_for in zip(self.param_groups, resolvers):
            if group["non_slot"]:
                self._finish(group, group["non_slot"], hp_for)

    def _hyper_resolver(self, group: dict[str, Any]) -> Callable[..., dict[str, Any]]:
        owner = type(self).__name__
        compiling = torch.compiler.is_compiling()
        values = {}
        for key, value in self._values(group).items():
            value = _hyper.resolve(value)
            # A tensor on an accelerator (RETURNN's device lr) is not read back each step: that
            # would wait for the device and cannot be captured in a CUDA graph.  Nor is any
            # tensor under torch.compile (a read-back is a graph break); a Python number is
            # checked there by comparisons, which become guards.
            if not (isinstance(value, torch.Tensor) and (compiling or not value.is_cpu)):
                hint = self.lr_zero_hint if key == "lr" else ""
                _hyper.check(owner, _tf_name(key), value, self.hyperparameters[key], hint)
            values[key] = value
        cache: dict[tuple[torch.dtype, torch.device], dict[str, Any]] = {}

        def hp_for(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
            key = (dtype, device)
            if key not in cache:
                hp = {k: self._scalar(k, v, dtype, device) for k, v in values.items()}
                hp.update({k: group[k] for k in self.flags})
                cache[key] = hp
            return cache[key]

        return hp_for

    def _scalar(self, key: str, value: Any, dtype, device) -> torch.Tensor:
        """``_hyper.scalar(value, dtype, device)``, reusing the tensor made for the same Python
        number before (building 0-dim tensors is a measurable share of a fused step)."""
        via_float32 = key not in self.unrounded
        # Tensors may change in place: re-read them.  Under torch.compile a number may be
        # symbolic (a schedule's lr): no cache lookup, which would specialise on its value.
        if type(value) not in (int, float) or torch.compiler.is_compiling():
            return _hyper.scalar(value, dtype, device, via_float32)
        cache = self.__dict__.setdefault("_scalar_cache", {})
        # The sign is part of the key: 0.0 == -0.0 in Python, not as tensors.
        slot = (key, value, math.copysign(1, value), dtype, device)
        hit = cache.get(slot)
        if hit is None:
            if len(cache) >= 256:  # a schedule makes a new value every step: stay bounded
                cache.clear()
            hit = cache[slot] = _hyper.scalar(value, dtype, device, via_float32)
        return hit

    def _slots_for(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self._slots_of([p], group)[0]

    def _slots_of(self, params: list[torch.Tensor], group: dict[str, Any]) -> list[dict]:
        """The slot dicts of ``params`` (all of ``group``), creating missing slots."""
        fills = self._slot_fills(group)
        if not fills:  # no entry in self.state, as torch's SGD without momentum leaves none
            return [{} for _ in params]
        out = []
        for p in params:
            state = self.state[p]
            if not fills.keys() <= state.keys():
                for name, fill in fills.items():
                    if name not in state:
                        state[name] = torch.full_like(p, fill, memory_format=torch.preserve_format)
            out.append(state)
        return out

    @torch.no_grad()
    def init_state(self) -> None:
        """Create every slot of the parameters that have a gradient now, with the fill the
        first ``step()`` would give it, changing no parameter and no counter: the next
        ``step()`` is the same as without this call.  Non-slot state (beta powers) exists
        from construction.  RETURNN's torch engine calls this before it captures the
        optimizer step in a CUDA graph, whose state tensors must exist up front."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._slots_of(params, group)

    def _validate_gradient(self, p: torch.Tensor, g: torch.Tensor) -> None:
        owner = type(self).__name__
        if g.is_sparse:
            if kernels.dtensor.is_dtensor(p):
                raise TypeError(
                    f"{owner}: sparse gradients are not supported for DTensor parameters "
                    f"(shape {tuple(p.shape)}, placements {p.placements}); use a dense "
                    f"gradient (e.g. nn.Embedding(sparse=False))"
                )
            if self.sparse is None:
                raise TypeError(
                    f"{owner} does not support sparse gradients; use a dense gradient "
                    f"(e.g. nn.Embedding(sparse=False)) or an optimizer with a sparse rule "
                    f"such as AdamOptimizer or AdagradOptimizer"
                )
            if g.sparse_dim() != 1 or p.dim() < 1 or tuple(g.shape) != tuple(p.shape):
                raise ValueError(
                    f"{owner}: sparse gradient of shape {tuple(g.shape)} (sparse_dim "
                    f"{g.sparse_dim()}) does not fit parameter of shape {tuple(p.shape)}; "
                    f"row-sparse gradients with sparse_dim 1 are supported"
                )
            idx = g._indices()
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= p.shape[0]):
                bad = idx[(idx < 0) | (idx >= p.shape[0])][0]
                raise IndexError(
                    f"{owner}: sparse gradient index {int(bad)} is out of range [0, {p.shape[0]})"
                )
        elif g.shape != p.shape:
            raise ValueError(
                f"{owner}: gradient of shape {tuple(g.shape)} does not match parameter of "
                f"shape {tuple(p.shape)}"
            )
        if g.dtype != p.dtype or g.device != p.device:
            raise TypeError(
                f"{owner}: gradient ({g.dtype}, {g.device}) must match its parameter "
                f"({p.dtype}, {p.device})"
            )

    # ------------------------------------------------------------------ TF1 API
    def get_name(self) -> str:
        """The optimizer's name (TF's ``name`` argument)."""
        return self._name

    def get_slot_names(self) -> list[str]:
        """The slot names this optimizer creates, sorted (as TF returns them)."""
        return sorted({name for group in self.param_groups for name in self._slot_fills(group)})

    def get_slot(self, var: torch.Tensor, name: str) -> torch.Tensor | None:
        """The slot ``name`` of parameter ``var``, or None if it has not been created."""
        return self.state[var].get(name) if var in self.state else None

    def variables(self) -> list[torch.Tensor]:
        """Every tensor of optimizer state: slots, then per-group non-slot state."""
        out = [
            self.state[p][n]
            for group in self.param_groups
            for p in group["params"]
            if p in self.state
            for n in sorted(self._slot_fills(group))
            if n in self.state[p]
        ]
        for group in self.param_groups:
            out.extend(group["non_slot"].values())
        return out

    def compute_gradients(
        self, loss: torch.Tensor | Callable[[], torch.Tensor], var_list: Iterable | None = None
    ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """``[(gradient, parameter), ...]`` of ``loss`` (a tensor or no-argument callable).

        ``var_list`` defaults to every parameter of this optimizer; gradients are None for
        parameters that do not influence the loss.  ``.grad`` attributes are not touched.
        """
        params = list(var_list) if var_list is not None else self._all_params()
        if not params:
            raise ValueError("No variables to optimize.")
        if callable(loss):
            with torch.enable_grad():
                loss = loss()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return list(zip(grads, params))

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]],
        global_step: torch.Tensor | None = None,
    ) -> None:
        """Apply ``(gradient, parameter)`` pairs; then ``global_step += 1`` if given.

        Parameters whose gradient is None are left alone (their slots do not decay).
        """
        pairs = list(grads_and_vars)
        if not pairs:
            raise ValueError("No variables provided.")
        _check_global_step(global_step)
        known = {id(p) for p in self._all_params()}
        grads = {}
        for g, p in pairs:
            if id(p) not in known:
                raise ValueError(
                    f"{type(self).__name__}.apply_gradients: parameter of shape "
                    f"{tuple(p.shape)} is not in this optimizer's param_groups"
                )
            if g is not None:
                grads[id(p)] = g
        if not grads:
            raise ValueError(
                f"No gradients provided for any variable: {[tuple(p.shape) for _, p in pairs]}"
            )
        work = [
            [(p, grads[id(p)]) for p in group["params"] if id(p) in grads]
            for group in self.param_groups
        ]
        with torch.no_grad():
            self._apply(work)
            if global_step is not None:
                global_step += 1

    def minimize(
        self,
        loss: torch.Tensor | Callable[[], torch.Tensor],
        global_step: torch.Tensor | None = None,
        var_list: Iterable | None = None,
    ) -> None:
        """``compute_gradients`` then ``apply_gradients`` (TF's ``minimize``)."""
        _check_global_step(global_step)
        self.apply_gradients(self.compute_gradients(loss, var_list), global_step)

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["gradfleet"] = {
            "optimizer": type(self).__name__,
            "param_shapes": [[list(p.shape) for p in g["params"]] for g in self.param_groups],
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by the same optimizer class for the same parameter list.

        Refuses (``ValueError``, nothing changed) a state dict from another optimizer class
        or a parameter list of different shapes, instead of loading it by position.

        The saved param groups' hyperparameters replace the optimizer's, as in torch; each
        that differs from the value the optimizer had (at the precision its maths uses: TF's
        float32 rounding) is named in a :class:`HyperparametersReplacedWarning`.  Under a
        torch learning-rate scheduler the learning rate is compared at the schedule's start
        (``initial_lr``), so a resumed schedule is not reported.
        """
        owner = type(self).__name__
        meta = state_dict.get("gradfleet")
        if meta is None:  # torch.distributed.checkpoint's form, or someone else's
            meta = self._check_named_state_dict(state_dict)
        if meta["optimizer"] != owner:
            raise ValueError(
                f"{owner}.load_state_dict: state dict was saved by {meta['optimizer']}"
            )
        mine = [[list(p.shape) for p in g["params"]] for g in self.param_groups]
        if [list(map(list, g)) for g in meta["param_shapes"]] != mine:
            raise ValueError(
                f"{owner}.load_state_dict: saved parameter shapes {meta['param_shapes']} do "
                f"not match this optimizer's {mine}"
            )
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            # Same shapes in another order can only be told apart by name (torch >= 2.6
            # records names when the optimizer was built from named_parameters()).
            if "param_names" in saved and "param_names" in group:
                if list(saved["param_names"]) != list(group["param_names"]):
                    raise ValueError(
                        f"{owner}.load_state_dict: saved parameter names "
                        f"{saved['param_names']} do not match {group['param_names']}"
                    )
        named = {
            k: (gi, pi)
            for gi, g in enumerate(state_dict["param_groups"])
            for pi, k in enumerate(g["params"])
            if isinstance(k, str)
        }
        for key, entry in state_dict["state"].items():
            if isinstance(key, str) and key in named:
                gi, pi = named[key]
            elif isinstance(key, int):
                gi, pi = _locate(meta["param_shapes"], key)
            else:
                continue
            for slot, t in entry.items():
                if isinstance(t, torch.Tensor) and t.dim() and list(t.shape) != mine[gi][pi]:
                    raise ValueError(
                        f"{owner}.load_state_dict: slot {slot!r} of parameter {key} has shape "
                        f"{list(t.shape)}, expected {mine[gi][pi]}"
                    )
        # Param groups saved before ``betas`` was stored as torch's tuple hold TF's names.
        groups = [_groups.canonical(self, g) for g in state_dict["param_groups"]]
        replaced = self._replaced_hyperparameters(groups)
        # Earlier releases saved an empty entry for each parameter of a slot-free
        # optimizer (``{0: {}}``); loading it would bring the empty entries back.
        state = {k: v for k, v in state_dict["state"].items() if not _is_empty_entry(k, v)}
        state_dict = dict(state_dict, param_groups=groups, state=state)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "gradfleet"})
        self._step_plan = None  # it holds the replaced slots; the next step records anew
        for group in self.param_groups:
            device = group["params"][0].device if group["params"] else None
            group["non_slot"] = {k: v.to(device) for k, v in group["non_slot"].items()}
        if replaced:
            warnings.warn(
                f"{owner}.load_state_dict: the saved param groups' hyperparameters replace "
                f"this optimizer's (torch's rule), and differ: {'; '.join(replaced)}. Build the "
                f"optimizer with the saved values, or set them after loading",
                HyperparametersReplacedWarning,
                stacklevel=2,
            )

    def _replaced_hyperparameters(self, saved_groups: list[dict[str, Any]]) -> list[str]:
        """``"group 0: learning_rate 0.001 replaces 0.01"`` for each saved value that is not
        the optimizer's own."""
        out = []
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            try:
                theirs = self._values({**group, **saved})
            except (TypeError, KeyError):  # malformed: super().load_state_dict says so
                continue
            mine = self._values(group)
            theirs.update({f: saved.get(f, group.get(f)) for f in self.flags})
            mine.update({f: group.get(f) for f in self.flags})
            if "initial_lr" in saved or "initial_lr" in group:  # a torch scheduler's start
                theirs["lr"] = saved.get("initial_lr", theirs["lr"])
                mine["lr"] = group.get("initial_lr", mine["lr"])
            for key, value in theirs.items():
                rounded = key not in self.unrounded and key not in self.flags
                if not _same_hyperparameter(value, mine[key], rounded):
                    out.append(f"group {gi}: {_tf_name(key)} {value!r} replaces {mine[key]!r}")
        return out

    def _check_named_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Structural checks for a state dict keyed by parameter names, as
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` makes (it keeps
        only "state" and "param_groups"): the same groups and parameter counts, this class's
        slot names and non-slot state; ``load_state_dict`` then checks every slot's shape."""
        owner = type(self).__name__
        saved = state_dict.get("param_groups", [])
        if not saved or not all(isinstance(k, str) for g in saved for k in g["params"]):
            raise ValueError(
                f"{owner}.load_state_dict: not a gradfleet state dict (no 'gradfleet' entry); "
                f"it was probably saved by another optimizer"
            )
        counts = [len(g["params"]) for g in saved]
        if counts != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"{owner}.load_state_dict: saved parameter groups of sizes {counts} do not "
                f"match this optimizer's {[len(g['params']) for g in self.param_groups]}"
            )
        for saved_group, group in zip(saved, self.param_groups):
            if set(saved_group.get("non_slot", {})) != set(group["non_slot"]):
                raise ValueError(
                    f"{owner}.load_state_dict: saved non-slot state "
                    f"{sorted(saved_group.get('non_slot', {}))} is not {owner}'s "
                    f"{sorted(group['non_slot'])}"
                )
            fills = set(self._slot_fills(group))
            for name in saved_group["params"]:
                entry = state_dict["state"].get(name, {})
                if entry and set(entry) != fills:
                    raise ValueError(
                        f"{owner}.load_state_dict: saved slots {sorted(entry)} of parameter "
                        f"{name!r} are not {owner}'s {sorted(fills)}"
                    )
        shapes = [[list(p.shape) for p in g["params"]] for g in self.param_groups]
        return {"optimizer": owner, "param_shapes": shapes}


class RowwiseOptimizer(Optimizer):
    """Base for rules whose sparse form is the dense maths applied to the listed rows only.

    A subclass writes ``_rule(w, slots, g, hp, shared, sparse)`` returning the new ``w`` and
    a dict of new slot values, from the rows ``w``/``slots``/``g`` (whole tensors when dense,
    gathered rows when sparse; ``sparse`` lets a rule use TF's sparse-kernel expression form).
    Untouched rows keep their parameter and slot values, as in TF's Sparse* kernels.
    """

    def _rule(self, w, slots, g, hp, shared, sparse):  # pragma: no cover - abstract
        raise NotImplementedError

    def _apply_dense(self, p, g, slots, hp, shared):
        w, new_slots = self._rule(p, slots, g, hp, shared, False)
        for name, value in new_slots.items():
            slots[name].copy_(value)
        p.copy_(w)

    def _apply_sparse(self, p, idx, values, slots, hp, shared):
        rows = {name: s[idx] for name, s in slots.items()}
        w, new_rows = self._rule(p[idx], rows, values, hp, shared, True)
        for name, value in new_rows.items():
            slots[name].index_copy_(0, idx, value)
        p.index_copy_(0, idx, w)


def sparse_rows(g: torch.Tensor, sum_duplicates: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, row values) of a row-sparse COO gradient, duplicates summed if asked."""
    if sum_duplicates:
        g = g.coalesce()
    return g._indices()[0], g._values()


def _same_hyperparameter(a: Any, b: Any, through_float32: bool) -> bool:
    """Whether two hyperparameter values give the same maths (Python floats as TF sees them:
    rounded to float32 unless the class keeps them ``unrounded``)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        try:
            return bool(torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()))
        except (TypeError, RuntimeError):
            return False
    if isinstance(a, bool) or isinstance(b, bool) or callable(a) or callable(b):
        return a == b
    try:
        if through_float32:
            return bool(np.float32(a) == np.float32(b))
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _tf_name(key: str) -> str:
    return "learning_rate" if key == "lr" else key


#: Instance attributes that copies and pickles leave out (see ``Optimizer.__getstate__``).
_NOT_COPIED = frozenset(
    {
        "_step_plan",
        "_scalar_cache",
        "_zero_grad_profile_name",
        "_warned_capturable_if_run_uncaptured",
    }
)


def _check_paths(opt: Optimizer, group: dict[str, Any]) -> None:
    """``RuntimeError`` at construction (and in ``add_param_group``) for ``foreach=True``
    with ``fused=True``, as torch's optimizers raise it, or for a fast path the class does
    not support; ``kernels.resolve_path`` checks again at each step (groups may be edited)."""
    owner = type(opt).__name__
    if group.get("foreach") and group.get("fused"):
        raise RuntimeError(f"{owner}: `fused` and `foreach` cannot be `True` together.")
    for path in ("foreach", "fused"):
        if group.get(path) and path not in opt.fast_paths:
            raise RuntimeError(
                f"{owner} does not support {path}=True (fast_paths={opt.fast_paths})"
            )


def _is_empty_entry(key: Any, value: Any) -> bool:
    """A saved per-parameter state entry with nothing in it (keys of parameters are their
    index or, from ``torch.distributed.checkpoint``, their name)."""
    return isinstance(key, int | str) and isinstance(value, dict) and not value


def _check_global_step(global_step: torch.Tensor | None) -> None:
    if global_step is None:
        return
    if (
        not isinstance(global_step, torch.Tensor)
        or global_step.dtype != torch.int64
        or global_step.dim()
    ):
        raise TypeError("global_step must be a 0-dim torch.int64 tensor")


def _locate(shapes: list[list[Any]], flat_index: int) -> tuple[int, int]:
    rest = flat_index
    for gi, group in enumerate(shapes):
        if 0 <= rest < len(group):
            return gi, rest
        rest -= len(group)
    raise ValueError(f"state dict holds state for parameter {flat_index} beyond the parameter list")


def _is_zero_on_host(lr: Any) -> bool:
    """``lr == 0`` for a number or a CPU tensor.  A learning rate on an accelerator is never
    read back here: a slot-free optimizer keeps ``state`` empty, so this runs every step, and a
    read-back would wait for the device and break CUDA-graph capture."""
    if isinstance(lr, torch.Tensor):
        return lr.is_cpu and bool(lr == 0)
    return not callable(lr) and lr == 0
