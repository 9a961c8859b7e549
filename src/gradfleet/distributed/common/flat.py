"""Flatten a list of tensors into one buffer and copy a buffer back into the tensors.

A collective or a message costs one call per buffer instead of one per parameter; the lock-step
SyncReplicas path and the collectives of every wrapper use these two functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["copy_received", "flatten", "unflatten_"]


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One 1-D tensor holding every tensor's values in order (cast to ``dtype`` if given)."""
    parts = [t.detach().reshape(-1) for t in tensors]
    if dtype is not None:
        parts = [p.to(dtype) for p in parts]
    return torch.cat(parts)


def unflatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (in place, cast to their dtype)."""
    if flat.numel() != sum(t.numel() for t in tensors):
        raise ValueError(
            f"unflatten_: buffer of {flat.numel()} elements for tensors holding "
            f"{sum(t.numel() for t in tensors)}"
        )
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def copy_received(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` unless ``src`` already is ``dst``'s memory (the transport may receive
    a reply tensor in place, into the parameter it is for)."""
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)
