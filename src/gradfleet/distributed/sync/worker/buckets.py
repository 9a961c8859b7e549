"""Parameters laid out in flat buffers for all-reduce, as DDP lays them out.

The parameters go in reverse order (the order backward usually produces their gradients), one
device and dtype per bucket, the first about 1 MiB and the others about 25 MiB (DDP's
defaults: the first bucket leaves early, the others amortise a collective's fixed cost).  A
parameter's slot is a view of its bucket holding its dense gradient, or its sparse gradient's
rows summed into it.

A *tail* of a few more elements may follow the last bucket's slots: the caller's small flags,
summed by the same all-reduce as the gradients instead of one of their own (a collective's
fixed cost, a round trip over the slowest link, paid once per step instead of twice).  Only a
float32 or float64 last bucket takes one, where small counts are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...transport.all_reduce import densify_

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Buckets"]

_TAIL_DTYPES = (torch.float32, torch.float64)  # integers up to 2**24 exact: flags and counts

FIRST_BUCKET_BYTES = 1 << 20  # DDP's defaults
BUCKET_BYTES = 25 << 20


class Buckets:
    """Parameters laid out in flat buffers for all-reduce (module docstring)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        first_bytes: int | None = None,
        bytes_each: int | None = None,
        tail: int = 0,
    ) -> None:
        """``first_bytes``, ``bytes_each``: the buckets' sizes (default: the module's
        :data:`FIRST_BUCKET_BYTES` and :data:`BUCKET_BYTES`, read at each call); ``tail``:
        elements wanted after the last bucket's slots (:attr:`tail` is None where that
        bucket's dtype cannot carry them, module docstring)."""
        first_bytes = FIRST_BUCKET_BYTES if first_bytes is None else first_bytes
        bytes_each = BUCKET_BYTES if bytes_each is None else bytes_each
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
        last = params[self.members[-1][0]].dtype if self.members else None
        extra = tail if tail > 0 and last in _TAIL_DTYPES else 0
        self.flat = [
            torch.zeros(
                sum(params[i].numel() for i in idx) + (extra if b == len(self.members) - 1 else 0),
                dtype=params[idx[0]].dtype,
                device=params[idx[0]].device,
            )
            for b, idx in enumerate(self.members)
        ]
        self.tail: torch.Tensor | None = self.flat[-1][-extra:] if extra else None
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
