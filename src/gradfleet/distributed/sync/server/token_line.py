"""The chief's token line: which waiting worker gets its next step, and when none ever can.

A worker that pushed its gradient (tagged with the step it was computed at) asks the chief for a
token: the step its next gradient will be computed at.  Two rules decide when it gets one:

* ``"distinct"`` (the default): **one gradient per worker per update**, as backup workers are
  defined (Chen et al. 2016): a worker whose gradient joined the pending update waits until that
  update is made, then gets the new ``global_step``; a worker whose gradient was too late
  (stale) gets the current step at once.  So every update's R gradients come from R different
  workers, each computed on the variables of the step before, and no worker can starve the
  others by asking first.  Rule: serve a worker whose push was tagged ``tag`` once
  ``tag < global_step``, with token ``global_step``.
* ``"shared"``: TF's ``sync_token_q``, a FIFO of step values: ``num_tokens`` at the start,
  ``max(N, R)`` after every update, handed to whoever asks first.  A fast worker may give
  several gradients to one update, and right after the first update the workers holding the
  initial tokens push one stale round (TF's "wasted round").

Pure bookkeeping, no I/O: :class:`~.chief.SyncChief` holds the line and serves it after every
event.  :func:`unfillable` is the one place that decides that the workers still alive can never
complete the pending update (one left after its last step, one was reported dead), so that every
waiting worker hears the cause at once instead of after ``timeout`` seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..common.tokens import TokenQueue

__all__ = ["TOKEN_RULES", "TokenLine", "Waiting", "unfillable"]

TOKEN_RULES = ("distinct", "shared")


@dataclass
class Waiting:
    """A worker in the token line.  ``ticket`` None: a place kept for a token request that is
    still on its way (its push said one follows); ``version``: the shard-0 values it holds
    (None: it reads them apart); ``accepted``: did shard 0 accept the push that preceded it."""

    worker: int
    ticket: Any
    tag: int
    accepted: bool
    version: int | None
    since: float


class TokenLine:
    """The workers waiting for a token, and the rule that serves them (module docstring).

    ``rule``: ``"distinct"`` or ``"shared"``; ``initial``: the shared queue's first tokens (TF's
    ``num_tokens``), each carrying ``global_step``; ``per_update``: tokens the shared queue gets
    after every update (TF: ``max(N, R)``)."""

    def __init__(self, rule: str, global_step: int, initial: int, per_update: int) -> None:
        if rule not in TOKEN_RULES:
            raise ValueError(f"tokens must be one of {TOKEN_RULES}, got {rule!r}")
        self.rule = rule
        self.per_update = per_update
        self.queue = TokenQueue()  # the shared rule's tokens (TF's sync_token_q)
        if rule == "shared":
            self.queue.put(global_step, initial)
        self.waiting: deque[Waiting] = deque()

    def __iter__(self) -> Iterator[Waiting]:
        return iter(self.waiting)

    def __len__(self) -> int:
        return len(self.waiting)

    def join(self, worker: int, ticket: Any, tag: int, accepted: bool, version: int | None) -> None:
        self.waiting.append(Waiting(worker, ticket, tag, accepted, version, time.monotonic()))

    def updated(self, global_step: int) -> None:
        """``global_step`` was just reached: the shared queue gets its tokens."""
        if self.rule == "shared":
            self.queue.put(global_step, self.per_update)

    def give_back(self, token: int) -> None:
        """A token served to a place whose worker left before asking: back to the queue."""
        if self.rule == "shared":
            self.queue.put(token, 1)

    def serve(self, global_step: int, released: bool) -> list[tuple[Waiting, int]]:
        """Take the workers that can go on now, each with its token.  ``released``: training
        is over (``last_step``): everyone gets ``global_step``."""
        out = []
        if released:
            while self.waiting:
                out.append((self.waiting.popleft(), global_step))
        elif self.rule == "shared":  # FIFO: the first in line gets the first token
            while self.waiting and len(self.queue):
                out.append((self.waiting.popleft(), int(self.queue.get())))  # type: ignore[arg-type]
        else:
            keep: deque[Waiting] = deque()
            for entry in self.waiting:
                if entry.tag < global_step:
                    out.append((entry, global_step))
                else:
                    keep.append(entry)
            self.waiting = keep
        return out

    def take_all(self) -> list[Waiting]:
        out, self.waiting = list(self.waiting), deque()
        return out

    def remove(self, keep: Any) -> None:
        """Keep only the entries for which ``keep(entry)`` is true."""
        self.waiting = deque(e for e in self.waiting if keep(e))

    def state(self) -> list[int]:
        return self.queue.state()

    def load(self, tokens: Iterable[int]) -> None:
        self.queue.load(list(tokens) if self.rule == "shared" else [])


def unfillable(
    *,
    rule: str,
    replicas_to_aggregate: int,
    total_num_replicas: int,
    gradients_in: int,
    contributors: set[int],
    left: dict[int, tuple[int, bool]],
    waiting: set[int],
    tokens_left: int,
    others_pending: bool,
    global_step: int,
) -> str | None:
    """Why the pending update can never be made, or None while it still can.

    ``gradients_in`` of R gradients are in, from ``contributors``; ``left``: workers gone,
    each with (``global_step`` when it left, reported dead); ``waiting``: live workers in the
    token line; ``tokens_left``: the shared queue's tokens; ``others_pending``: another
    shard's update is still to be reported, which advances ``global_step`` and so serves the
    line."""
    R, N = replicas_to_aggregate, total_num_replicas
    live = set(range(N)) - set(left)
    if not left or others_pending:
        return None
    if rule == "distinct":
        can_give = live - contributors
        if gradients_in + len(can_give) >= R:
            return None
        why = (
            f"it has {gradients_in} of replicas_to_aggregate={R} gradients (from worker rank(s) "
            f"{sorted(contributors)}), each worker gives one gradient per update, and the live "
            f"worker(s) {sorted(can_give)} can give only {len(can_give)} more"
        )
    else:
        if tokens_left or live - waiting:
            return None
        why = (
            f"it has {gradients_in} of replicas_to_aggregate={R} fresh gradients, every live "
            f"worker ({sorted(live)}) is waiting for a token and none is left (TF's shared "
            "tokens let a worker give several gradients to one update, so the workers that "
            "left used some of the tokens this update needed)"
        )
    gone = "; ".join(
        f"worker rank {w} {'was reported dead' if dead else 'left'} at global step {at}"
        for w, (at, dead) in sorted(left.items())
    )
    return (
        f"SyncReplicasOptimizer: the update at global step {global_step} can never be made: "
        f"{why}; {gone}.  Loop as TF does, until the optimizer's global_step reaches the "
        "number of updates you want (`while opt.global_step < last_step:`), not for a fixed "
        "number of step() calls on each worker, or aggregate fewer replicas "
        "(replicas_to_aggregate at most the workers still running)"
    )
