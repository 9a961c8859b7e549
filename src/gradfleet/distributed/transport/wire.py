"""Messages as a JSON control part plus one flat byte buffer of tensors (no pickling).

``split(obj)`` walks a message (dicts, lists, ints, floats, strings, None, tensors) and replaces
every tensor by a placeholder ``{"$t": k}`` (a sparse COO tensor by ``{"$sparse": [ki, kv],
"shape": [...]}``, its indices and values), returning the JSON-able skeleton and the tensors.
``join`` puts tensors back.  ``layout(tensors)`` describes them as ``[[dtype, shape, offset],
...]`` in one byte buffer (each tensor 16-byte aligned, so a view of the buffer as its dtype is
legal); the layout travels in the control message, the buffer on the data plane.

``Packer`` owns one grow-only host buffer: ``pack`` copies the tensors in (a CUDA tensor is
copied device-to-host into pinned memory: no ``torch.save``, no Python-level serialisation),
``unpack`` returns views of the buffer -- valid until the next ``pack``/``unpack`` on the same
packer, so callers copy what they keep.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["split", "join", "layout", "Packer", "dumps", "loads", "ALIGN"]

ALIGN = 16
_DTYPES = {
    str(d): d
    for d in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
        torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
        torch.bool,
    )
}  # fmt: skip


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


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[list[Any]], int]:
    """``([[dtype, shape, byte offset], ...], total bytes)`` of the packed buffer."""
    out, offset = [], 0
    for t in tensors:
        if str(t.dtype) not in _DTYPES:
            raise TypeError(f"gradfleet transport: tensors of dtype {t.dtype} are not supported")
        out.append([str(t.dtype), list(t.shape), offset])
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return out, offset


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

    def pack(self, tensors: Sequence[torch.Tensor]) -> tuple[list[list[Any]], torch.Tensor]:
        """Copy ``tensors`` into the buffer: ``(layout, bytes to send)``."""
        spec, total = layout(tensors)
        cuda = any(t.is_cuda for t in tensors)
        data = self.reserve(total, pinned=cuda)
        for t, (_, _, offset) in zip(tensors, spec, strict=True):
            n = t.numel() * t.element_size()
            if n:
                dst = data[offset : offset + n].view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=t.is_cuda)
        if cuda:
            torch.cuda.synchronize()  # the pinned copy must be complete before gloo reads it
        return spec, data

    def unpack(self, spec: Sequence[Sequence[Any]], data: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``data`` (a buffer laid out by ``spec``) as the tensors it holds."""
        out = []
        for dtype_name, shape, offset in spec:
            dtype = _DTYPES[dtype_name]
            numel = 1
            for s in shape:
                numel *= int(s)
            n = numel * torch.empty(0, dtype=dtype).element_size()
            out.append(data[offset : offset + n].view(dtype).view(shape))
        return out

    def receive_buffer(self, spec: Sequence[Sequence[Any]]) -> torch.Tensor:
        """The buffer slice a message of layout ``spec`` is received into."""
        total = 0
        for dtype_name, shape, offset in spec:
            numel = 1
            for s in shape:
                numel *= int(s)
            size = numel * torch.empty(0, dtype=_DTYPES[dtype_name]).element_size()
            total = max(total, offset + -(-size // ALIGN) * ALIGN)
        return self.reserve(total)
