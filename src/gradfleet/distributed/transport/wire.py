"""Messages as a JSON control part plus one flat byte buffer of tensors (no pickling).

``split(obj)`` walks a message (dicts, lists, ints, floats, strings, None, tensors) and replaces
every tensor by a placeholder ``{"$t": k}`` (a sparse COO tensor by ``{"$sparse": [ki, kv],
"shape": [...]}``, its indices and values), returning the JSON-able skeleton and the tensors.
``join`` puts tensors back.  ``layout(tensors)`` places them in the receiver's byte buffer
(each tensor 16-byte aligned, so a view of the buffer as its dtype is legal); the layout
travels in the control message, the bytes on the data plane.

``Packer`` owns one grow-only host buffer.  ``pack`` copies small tensors into it (one message)
and, with ``direct=True``, hands large contiguous host tensors over as they are (one message
each, zero copy); a CUDA tensor is always copied device-to-host into pinned memory.  No
``torch.save``, no Python-level serialisation.  ``receive`` gives the buffers to receive into,
``unpack`` views of them -- valid until the next message on the same packer: copy what you
keep.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "split", "join", "layout", "views", "Packer", "dumps", "loads", "ALIGN",
]  # fmt: skip

ALIGN = 16
_DTYPES = {
    str(d): d
    for d in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
        torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
        torch.bool,
    )
}  # fmt: skip
_SIZES = {name: torch.empty(0, dtype=d).element_size() for name, d in _DTYPES.items()}


def split(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``(skeleton, tensors)``: the message with every tensor replaced by a placeholder."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_sparse:
                x = x.coalesce()
                tensors.extend([x.indices(), x.values()])
                return {"$sparse": [len(tensors) - 2, len(tensors) - 1], "shape": list(x.shape)}
            tensors.append(x.detach())
            return {"$t": len(tensors) - 1}
        if isinstance(x, dict):
            return {str(k): walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    return walk(obj), tensors


def join(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Inverse of :func:`split` (dict keys come back as strings)."""

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "$t" in x:
                return tensors[x["$t"]]
            if "$sparse" in x:
                i, v = x["$sparse"]
                return torch.sparse_coo_tensor(tensors[i], tensors[v], x["shape"]).coalesce()
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(skeleton)


DIRECT = 1 << 16  # tensors this large travel as their own gloo message, never copied


def _nbytes(dtype_name: str, shape: Sequence[int]) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * _SIZES[dtype_name]


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(
    tensors: Sequence[torch.Tensor], direct: bool = False, copy: bool = False
) -> dict[str, Any]:
    """Where each tensor sits in the receiver's buffer: ``{"packed": bytes, "entries":
    [[dtype, shape, byte offset, is_direct], ...]}``.  Packed tensors come first (one message),
    then (``direct=True``: tensors of at least ``DIRECT`` bytes; contiguous host tensors only
    unless ``copy``) one message per direct tensor, received straight into its place (or into
    the receiver's own tensor, see :meth:`Packer.receive`)."""
    for t in tensors:
        if str(t.dtype) not in _SIZES:
            raise TypeError(f"gradfleet transport: tensors of dtype {t.dtype} are not supported")
    alone = [
        direct
        and (copy or (not t.is_cuda and t.is_contiguous()))
        and t.numel() * t.element_size() >= DIRECT
        for t in tensors
    ]
    entries: list[list[Any]] = [[str(t.dtype), list(t.shape), 0, a] for t, a in zip(tensors, alone)]
    offset = 0
    for flag in (False, True):
        for e, t in zip(entries, tensors, strict=True):
            if e[3] == flag:
                e[2] = offset
                offset += _padded(t.numel() * t.element_size())
        if not flag:
            packed = offset
    return {"packed": packed, "entries": entries}


def _total(spec: dict[str, Any]) -> int:
    ends = [e[2] + _padded(_nbytes(e[0], e[1])) for e in spec["entries"]]
    return max([spec["packed"], *ends])


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    return json.loads(data.decode())


class Packer:
    """One reusable host byte buffer (pinned when CUDA is in use) for packing/unpacking."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def reserve(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """The first ``nbytes`` of the buffer, grown (never shrunk) when too small."""
        if self.buffer.numel() < nbytes or (pinned and not self.buffer.is_pinned()):
            size = max(nbytes, int(self.buffer.numel() * 1.25))
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return self.buffer[:nbytes]

    def pack(
        self, tensors: Sequence[torch.Tensor], direct: bool = False, copy: bool = False
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """``(layout, messages)``: the packed tensors copied into this buffer (the first
        message, if any), then the direct tensors themselves as byte views (zero copy: they
        must stay untouched until sent).  ``copy=True``: direct tensors are copied into the
        buffer too (the caller may change its tensors at once) and still travel alone, so a
        receiver can take them straight into its own tensors."""
        spec = layout(tensors, direct, copy)
        copied = [(t, e) for t, e in zip(tensors, spec["entries"], strict=True) if copy or not e[3]]
        cuda = any(t.is_cuda for t, _ in copied)
        data = self.reserve(_total(spec) if copy else spec["packed"], pinned=cuda)
        typed = _Typed(data)
        for t, e in copied:
            if t.numel():
                typed.at(e[0], e[1], e[2]).copy_(t, non_blocking=t.is_cuda)
        # the pinned copies must be complete before gloo reads them; a server thread's current
        # device is GPU 0 whatever its tensors' device, so synchronise each device in use
        for device in {t.device for t, _ in copied if t.is_cuda}:
            torch.cuda.synchronize(device)
        messages = [data[: spec["packed"]]] if spec["packed"] else []
        for t, e in zip(tensors, spec["entries"], strict=True):
            if e[3] and copy:
                messages.append(data[e[2] : e[2] + t.numel() * t.element_size()])
            elif e[3]:
                messages.append(t.detach().reshape(-1).view(torch.uint8))
        return spec, messages

    def receive(
        self, spec: dict[str, Any], into: Sequence[Any] | None = None
    ) -> list[torch.Tensor]:
        """The buffers a message of layout ``spec`` is received into, in sending order.
        ``into[k]``: a tensor of the receiver's for the message's tensor ``k``; a direct
        tensor whose dtype and shape it matches (contiguous, host memory) is received
        straight into it instead of this buffer."""
        data = self.reserve(_total(spec))
        out = [data[: spec["packed"]]] if spec["packed"] else []
        for k, (dtype_name, shape, offset, alone) in enumerate(spec["entries"]):
            if alone:
                target = _target(into, k, dtype_name, shape)
                n = _nbytes(dtype_name, shape)
                out.append(data[offset : offset + n] if target is None else target)
        return out

    def unpack(self, spec: dict[str, Any], into: Sequence[Any] | None = None) -> list[torch.Tensor]:
        """The tensors of a message received by :meth:`receive` (with the same ``into``):
        views of this buffer, or of the ``into`` tensors that were received into."""
        return views(spec, self.receive(spec, into))


def _target(into: Sequence[Any] | None, k: int, dtype_name: str, shape: Sequence[int]):
    """The bytes of ``into[k]`` if a direct tensor ``(dtype_name, shape)`` can land there."""
    if into is None or k >= len(into) or not isinstance(into[k], torch.Tensor):
        return None
    t = into[k].detach()
    if str(t.dtype) != dtype_name or list(t.shape) != list(shape):
        return None
    if t.is_cuda or not t.is_contiguous() or t.is_sparse:
        return None
    return t.reshape(-1).view(torch.uint8)


def views(spec: dict[str, Any], messages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a message of layout ``spec`` as views of its byte ``messages`` (the
    packed buffer first, if any, then one per direct tensor, as :meth:`Packer.pack` made
    them or :meth:`Packer.receive` received them)."""
    packed = _Typed(messages[0] if spec["packed"] else torch.empty(0, dtype=torch.uint8))
    alone = iter(messages[1:] if spec["packed"] else messages)
    out = []
    for dtype_name, shape, offset, direct in spec["entries"]:
        if direct:
            out.append(_Typed(next(alone)).at(dtype_name, shape, 0))
        else:
            out.append(packed.at(dtype_name, shape, offset))
    return out


class _Typed:
    """A byte buffer's tensors by dtype, shape and byte offset.  Why: a tensor as a slice of
    the bytes, viewed as its dtype, then its shape costs three tensor ops; here one view of
    the buffer per dtype, then one ``as_strided`` per tensor (half the time at the
    9 tensors of a small model's message, where a server builds these on every request)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self._as: dict[str, torch.Tensor] = {}

    def at(self, dtype_name: str, shape: Sequence[int], offset: int) -> torch.Tensor:
        """The contiguous tensor of ``dtype_name`` and ``shape`` at byte ``offset`` (a
        multiple of its element size: :func:`layout` aligns every tensor)."""
        base = self._as.get(dtype_name)
        if base is None:
            base = self._as[dtype_name] = self.data.view(_DTYPES[dtype_name])
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= int(d)
        # as_strided's offset counts from the start of the storage, not of the view
        start = base.storage_offset() + offset // _SIZES[dtype_name]
        return base.as_strided(shape, strides[::-1], start)
