"""Replaying a fused step: ``Optimizer.step``'s per-parameter bookkeeping, done once.

A fused ``step()`` spends most of its Python time on work whose result rarely changes between
steps: which parameters have a gradient, their (device, dtype) buckets, the split of small
parameters, slot lookups, and each kernel's cache key (``fused.signature``).  A ``StepPlan``
records, on a step that took the full path, which compiled kernel ran on which parameters,
and later steps replay that after checking in bulk (``map`` over tensor attributes, a loop
in C rather than Python bytecode) that nothing the recording depended on has changed:

* the param group list, each group's parameter list (same objects) and its path options;
* which parameters have a gradient;
* every parameter's and gradient's type, shape, strides, dtype and device: the gradient's are
  those it had when the full path validated it against its parameter, so this is that
  validation, and the kernels' cache keys with it;
* the slot tensors (the same objects as recorded; a replaced slot, e.g. after
  ``load_state_dict``, goes back to the full path);
* the hyperparameters' Python-valued flags and the shared state's names and dtypes (the rest
  of the kernels' keys); hyperparameter values are read every step as before.

Any difference sends the step to the full path, which validates, raises its errors,
recompiles where a kernel's signature changed and records a new plan.  A replay that finds a
difference returns before anything has changed.  Only steps whose every group takes the fused
path with plain dense tensors are recorded (sparse gradients, DTensors, the loop and foreach
paths and ``check_finite=True`` always take the full path).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress, repeat
from operator import attrgetter, is_, itemgetter
from typing import Any

import torch

from gradfleet.kernels.fused import constants_key

_T = torch.Tensor
_GRAD = attrgetter("grad")
_DTYPE = attrgetter("dtype")
_DEVICE = attrgetter("device")


class _Layout:
    """Shape, strides, dtype and device of a list of tensors, compared in bulk."""

    __slots__ = ("devices", "dtypes", "sizes", "strides")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.sizes = list(map(_T.size, tensors))
        self.strides = list(map(_T.stride, tensors))
        self.dtypes = list(map(_DTYPE, tensors))
        self.devices = list(map(_DEVICE, tensors))

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        try:
            strides = list(map(_T.stride, tensors))  # a sparse tensor raises here
        except RuntimeError:
            return False
        return (
            strides == self.strides
            and list(map(_T.size, tensors)) == self.sizes
            and list(map(_DTYPE, tensors)) == self.dtypes
            and list(map(_DEVICE, tensors)) == self.devices
        )


def _picker(positions: list[int], n: int) -> Callable[[list[Any]], Any]:
    """``f(items)``: the items at ``positions`` (increasing) of an ``n``-item list."""
    if positions == list(range(n)):
        return lambda items: items
    if len(positions) == 1:
        (only,) = positions
        return lambda items: (items[only],)
    return itemgetter(*positions)


class _Call:
    """One recorded kernel call: which of the group's parameters it takes, in which order."""

    __slots__ = ("compiled", "constants", "device", "dtype", "pick", "slot_names")

    def __init__(self, entry, position: dict[int, int], n: int) -> None:
        compiled, params, slot_names, constants, (device, dtype) = entry
        self.compiled, self.slot_names, self.constants = compiled, slot_names, constants
        self.device, self.dtype = device, dtype
        self.pick = _picker([position[id(p)] for p in params], n)


class _GroupPlan:
    """One param group: its parameters, which have gradients, layouts, slots and calls."""

    def __init__(self, opt: Any, group: dict[str, Any], entries: list) -> None:
        self.group = group
        self.param_list = group["params"]
        self.members = list(self.param_list)
        self.options = (group.get("foreach"), group.get("fused"))
        grads = list(map(_GRAD, self.members))
        self.nones = list(map(is_, grads, repeat(None)))
        self.partial = any(self.nones)
        self.present = [not none for none in self.nones]
        self.params = list(compress(self.members, self.present))
        grads = list(compress(grads, self.present))
        self.param_layout = _Layout(self.params)
        self.grad_layout = _Layout(grads)
        self.grad_types = list(map(type, grads))
        position = {id(p): i for i, p in enumerate(self.params)}
        self.calls = [_Call(entry, position, len(self.params)) for entry in entries]
        names = sorted({name for call in self.calls for name in call.slot_names})
        states = [opt.state.get(p) for p in self.params] if names else []
        self.slots = {name: [state[name] for state in states] for name in names}

    def gradients(self, state: dict[Any, Any]) -> list[torch.Tensor] | None:
        """This step's gradients if everything the plan depends on is unchanged, else None."""
        group = self.group
        params = group["params"]
        if (
            params is not self.param_list
            or len(params) != len(self.members)
            or not all(map(is_, params, self.members))
            or (group.get("foreach"), group.get("fused")) != self.options
        ):
            return None
        grads = list(map(_GRAD, params))
        if list(map(is_, grads, repeat(None))) != self.nones:
            return None
        if self.partial:
            grads = list(compress(grads, self.present))
        if list(map(type, grads)) != self.grad_types or not self.grad_layout.matches(grads):
            return None
        if not self.param_layout.matches(self.params):
            return None
        if self.slots:
            states = list(map(state.get, self.params))
            for name, recorded in self.slots.items():
                try:
                    current = list(map(itemgetter(name), states))
                except (KeyError, TypeError):  # a slot or a whole state entry removed
                    return None
                if not all(map(is_, current, recorded)):
                    return None
        return grads


class StepPlan:
    """A recorded fused step of one optimizer; ``replay`` runs it again (see module doc)."""

    def __init__(self, opt: Any, entries: list[list]) -> None:
        self.groups = opt.param_groups
        self.state = opt.state
        self.plans = [_GroupPlan(opt, g, e) for g, e in zip(self.groups, entries)]

    def replay(self, opt: Any) -> bool:
        """Run the recorded kernels on this step's gradients; False, having changed nothing,
        when anything the plan depends on differs (the caller then takes the full path)."""
        if (
            opt.param_groups is not self.groups
            or len(self.groups) != len(self.plans)
            or opt.state is not self.state
            or opt.check_finite
        ):
            return False
        grads = []
        for plan in self.plans:
            gs = plan.gradients(self.state)
            if gs is None:
                return False
            grads.append(gs)
        # Hyperparameters are read and validated for every group before anything changes.
        resolvers = [opt._hyper_resolver(group) for group in self.groups]
        launches = []
        for plan, gs, hp_for in zip(self.plans, grads, resolvers):
            if not plan.calls:
                continue
            hp_for = opt._group_hyper(plan.group, hp_for)
            shared = opt._shared_state(plan.group)
            for call in plan.calls:
                hp = hp_for(call.dtype, call.device)
                if constants_key(hp, shared) != call.constants:
                    return False
                inputs = [*call.pick(plan.params), *call.pick(gs)]
                for name in call.slot_names:
                    inputs.extend(call.pick(plan.slots[name]))
                inputs.extend([v for v in hp.values() if isinstance(v, _T)])
                inputs.extend(shared.values())
                launches.append((call.compiled, inputs))
        for compiled, inputs in launches:
            compiled(inputs)  # takes (and empties) the list
        for group, hp_for in zip(self.groups, resolvers):
            if group["non_slot"]:
                opt._finish(group, group["non_slot"], hp_for)
        return True


def build(opt: Any, entries: list[list | None]) -> StepPlan | None:
    """A plan from one full step's record (``entries[i]``: group i's kernel calls, None where
    the group took another path), or None when that step cannot be replayed."""
    if opt.check_finite or any(e is None or None in e for e in entries):
        return None
    if not any(entries):
        return None
    return StepPlan(opt, entries)
