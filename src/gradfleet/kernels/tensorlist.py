"""``TensorList``: a list of same-device, same-dtype tensors that behaves like one tensor.

An optimizer's ``_apply_dense``/``_rule`` maths runs unchanged on a ``TensorList``: every
operator, tensor method and ``torch.*`` function applied to it is applied to each member.
Where ``torch._foreach_*`` has an exact equivalent (same ATen kernel per tensor, so the
same bits as the per-parameter loop) the whole list goes through one foreach call;
everything else (comparisons, ``where``, reductions...) runs as a per-tensor loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

_T = torch.Tensor


class TensorList:
    """Several tensors treated as one operand; see the module docstring."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tensors: list[torch.Tensor] = list(tensors)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    # The lists are grouped by (device, dtype), so these are uniform.
    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    is_sparse = False

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(_T, name)  # AttributeError for unknown names, as a tensor would
        if not callable(method):
            raise AttributeError(f"TensorList has no uniform attribute {name!r}")
        return lambda *args, **kwargs: dispatch(method, (self, *args), kwargs)

    def __bool__(self) -> bool:
        raise TypeError("a TensorList has no truth value: optimizer maths must not branch on data")

    def __repr__(self) -> str:
        return f"TensorList({len(self.tensors)} x {self.dtype} on {self.device})"


def _operator(name: str) -> Callable[..., Any]:
    method = getattr(_T, name)
    return lambda self, *args: dispatch(method, (self, *args), {})


for _name in (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __pow__ "
    "__rpow__ __neg__ __abs__ __lt__ __le__ __gt__ __ge__ __eq__ __ne__ __and__ __or__ "
    "__invert__ __iadd__ __isub__ __imul__ __itruediv__"
).split():
    setattr(TensorList, _name, _operator(_name))
TensorList.__hash__ = None  # type: ignore[assignment]  # __eq__ is elementwise


def dispatch(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Apply ``func`` to ``TensorList`` operands: one foreach call if exact, else a loop."""
    n = _length(args, kwargs)
    fast = _FOREACH.get(func)
    if fast is not None and not kwargs.keys() - fast.kwargs:
        out = fast(args, kwargs)
        if out is not NotImplemented:
            return out
    results = [func(*_pick(args, i), **_pick(kwargs, i)) for i in range(n)]
    if results and all(isinstance(r, _T) for r in results):
        return TensorList(results)
    return results


def _length(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    sizes = {len(a.tensors) for a in (*args, *kwargs.values()) if isinstance(a, TensorList)}
    if len(sizes) != 1:
        raise ValueError(f"TensorList operands of different lengths {sorted(sizes)}")
    return sizes.pop()


def _pick(obj: Any, i: int) -> Any:
    if isinstance(obj, TensorList):
        return obj.tensors[i]
    if isinstance(obj, dict):
        return {k: _pick(v, i) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_pick(v, i) for v in obj)
    return obj


class _Foreach:
    """One ``torch._foreach_*`` mapping: ``arity`` leading operands, the first a list.

    ``scalar``: which non-list operands the op takes besides lists ("none"; "number":
    Python numbers; "tensor": also 0-dim tensors on the list's device).  While a CUDA graph
    is being captured a 0-dim CUDA tensor operand takes the per-tensor loop instead: some
    ``_foreach_*`` ops with a tensor scalar wait for the device (``_foreach_add`` on torch
    2.11, found by tests/kernels/test_cuda.py), which a capture refuses; the loop's kernels read
    the scalar on the device, and a replay is as cheap per launch.  ``inplace``: the
    op returns its first operand.  Reflected operators (``__radd__``) map to the same op
    only where it is commutative bit for bit (IEEE ``+`` and ``*`` are).
    """

    def __init__(self, op, arity=2, scalar="tensor", inplace=False, kwargs=(), plain=False):
        self.op, self.arity, self.scalar = op, arity, scalar
        self.inplace, self.kwargs, self.plain = inplace, frozenset(kwargs), plain

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if len(args) != self.arity or not isinstance(args[0], TensorList):
            return NotImplemented
        if self.plain and not all(_plain(a) for a in args):
            return NotImplemented  # the per-tensor loop: same ATen kernel per member
        ops = [args[0].tensors]
        for other in args[1:]:
            if isinstance(other, TensorList):
                ops.append(other.tensors)
            elif self.scalar != "none" and type(other) in (int, float):
                ops.append(other)
            elif (
                self.scalar == "tensor"
                and self.arity == 2
                and isinstance(other, _T)
                and other.dim() == 0
                and other.device == args[0].device
                and not (other.is_cuda and torch.cuda.is_current_stream_capturing())
            ):
                ops.append(other)
            else:
                return NotImplemented
        out = self.op(*ops, **kwargs)
        return args[0] if self.inplace else TensorList(out)


def _plain(operand: Any) -> bool:
    """No tensor subclass (DTensor...) among ``operand``'s tensors."""
    if isinstance(operand, TensorList):
        return all(type(t) in _PLAIN for t in operand.tensors)
    return not isinstance(operand, _T) or type(operand) in _PLAIN


_PLAIN = (_T, torch.nn.Parameter)


def _table() -> dict[Callable[..., Any], _Foreach]:
    table: dict[Callable[..., Any], _Foreach] = {}

    def put(names, spec):
        for name in names.split():
            owner, attr = (torch, name[6:]) if name.startswith("torch.") else (_T, name)
            table[getattr(owner, attr)] = spec

    f = torch
    put("__add__ __radd__ add torch.add", _Foreach(f._foreach_add, kwargs=("alpha",)))
    put("__mul__ __rmul__ mul torch.mul", _Foreach(f._foreach_mul))
    put("__truediv__ div torch.div", _Foreach(f._foreach_div))
    put("__sub__ sub torch.sub", _Foreach(f._foreach_sub, scalar="number", kwargs=("alpha",)))
    put("add_ __iadd__", _Foreach(f._foreach_add_, inplace=True, kwargs=("alpha",)))
    put("mul_ __imul__", _Foreach(f._foreach_mul_, inplace=True))
    put("div_ __itruediv__", _Foreach(f._foreach_div_, inplace=True))
    sub_ = _Foreach(f._foreach_sub_, scalar="number", inplace=True, kwargs=("alpha",))
    put("sub_ __isub__", sub_)
    # DTensor registers no sharding strategy for _foreach_copy_ (torch 2.13); copy_ does.
    put("copy_", _Foreach(f._foreach_copy_, scalar="none", inplace=True, plain=True))
    put("maximum torch.maximum", _Foreach(f._foreach_maximum, scalar="none"))
    put("minimum torch.minimum", _Foreach(f._foreach_minimum, scalar="none"))
    put("__pow__ pow torch.pow", _Foreach(f._foreach_pow, scalar="number"))
    put("clamp_min torch.clamp_min", _Foreach(f._foreach_clamp_min, scalar="number"))
    put("clamp_max torch.clamp_max", _Foreach(f._foreach_clamp_max, scalar="number"))
    put("addcmul torch.addcmul", _Foreach(f._foreach_addcmul, arity=3, kwargs=("value",)))
    put("addcdiv torch.addcdiv", _Foreach(f._foreach_addcdiv, arity=3, kwargs=("value",)))
    put("addcmul_", _Foreach(f._foreach_addcmul_, arity=3, inplace=True, kwargs=("value",)))
    put("addcdiv_", _Foreach(f._foreach_addcdiv_, arity=3, inplace=True, kwargs=("value",)))
    for unary in "sqrt rsqrt abs sign neg exp log reciprocal sigmoid tanh".split():
        put(f"{unary} torch.{unary}", _Foreach(getattr(f, f"_foreach_{unary}"), arity=1))
        put(f"{unary}_", _Foreach(getattr(f, f"_foreach_{unary}_"), arity=1, inplace=True))
    put("__neg__", _Foreach(f._foreach_neg, arity=1))
    put("__abs__", _Foreach(f._foreach_abs, arity=1))
    return table


_FOREACH = _table()
