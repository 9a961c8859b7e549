"""TF's token queue (``sync_token_q``) and its initial fill, shared by the chief's token line
and the all-reduce exchange's replica of it.

``TokenQueue`` is a FIFO of global-step values: the chief enqueues ``max(N, R)`` copies of the
new step after every update; a worker dequeues one after each push and uses it as its next
tag.  :func:`init_tokens` is ``get_init_tokens_op``'s ``num_tokens`` rule.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

__all__ = ["TokenQueue", "init_tokens"]


def init_tokens(num_tokens: int, replicas_to_aggregate: int, total_num_replicas: int) -> int:
    """Initial tokens, TF's ``get_init_tokens_op(num_tokens)`` rule: ``-1`` means ``R``; fewer
    than ``R - N`` cannot finish the first step (``ValueError``, TF's message)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise ValueError(f"num_tokens must be an int, got {num_tokens!r}")
    needed = replicas_to_aggregate - total_num_replicas
    if num_tokens == -1:
        return replicas_to_aggregate
    if num_tokens < needed:
        raise ValueError(
            f"Too few tokens to finish the first step: {num_tokens} (given) vs {needed} (needed)"
        )
    return max(num_tokens, 0)


class TokenQueue:
    """FIFO of global-step values (TF's ``sync_token_q``)."""

    def __init__(self) -> None:
        self._q: collections.deque[int] = collections.deque()

    def put(self, value: int, count: int) -> None:
        self._q.extend([int(value)] * count)

    def get(self) -> int | None:
        """The oldest token, or ``None`` when empty (a TF worker would block)."""
        return self._q.popleft() if self._q else None

    def __len__(self) -> int:
        return len(self._q)

    def state(self) -> list[int]:
        return list(self._q)

    def load(self, values: Sequence[int]) -> None:
        self._q = collections.deque(int(v) for v in values)
