"""Parameters laid out in flat buffers for all-reduce, as DDP lays them out.

The parameters go in reverse order (the order backward usually produces their gradients), one
device and dtype per bucket, the first about 1 MiB and the others about 25 MiB (DDP's
defaults: the first bucket leaves early, the others amortise a collective's fixed cost).  A
parameter's slot is a view of its bucket holding its dense gradient, or its sparse gradient's
rows summed into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...transport.all_reduce import densify_

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Buckets"]

FIRST_BUCKET_BYTES = 1 << 20  # DDP's defaults
BUCKET_BYTES = 25 << 20


class Buckets:
    """Parameters laid out in flat buffers for all-reduce (module docstring)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        first_bytes: int = FIRST_BUCKET_BYTES,
        bytes_each: int = BUCKET_BYTES,
    ) -> None:
        self.members: list[list[int]] = []
        open_: dict[tuple[torch.device, torch.dtype], int] = {}  # key -> bucket being filled
        sizes: list[int] = []
        for i in reversed(range(len(params))):
            p = params[i]
            key = (p.device, p.dtype)
            b = open_.get(key)
            if b is None:
                b = open_[key] = len(self.members)
                self.members.append([])
                sizes.append(0)
            self.members[b].append(i)
            sizes[b] += p.numel() * p.element_size()
            if sizes[b] >= (first_bytes if b == 0 else bytes_each):
                del open_[key]
        self.flat = [
            torch.zeros(
                sum(params[i].numel() for i in idx),
                dtype=params[idx[0]].dtype,
                device=params[idx[0]].device,
            )
            for idx in self.members
        ]
        self.bucket_of: dict[int, int] = {}
        self.slot: dict[int, torch.Tensor] = {}  # parameter index -> view of its bucket
        for b, idx in enumerate(self.members):
            offset = 0
            for i in idx:
                n = params[i].numel()
                self.slot[i] = self.flat[b][offset : offset + n].view(params[i].shape)
                self.bucket_of[i] = b
                offset += n

    def __len__(self) -> int:
        return len(self.members)

    def fill(self, i: int, g: torch.Tensor | None) -> None:
        """Parameter ``i``'s slot := its gradient (None: zeros; sparse: its rows summed in)."""
        densify_(self.slot[i], g)
