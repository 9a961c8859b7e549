"""The state every member of the all-reduce holds, and how a member that is behind takes it
from one that is not -- a survivor that missed the update in flight, or a restarted process
(no checkpoint file: the state comes from a live member's memory).

:meth:`LiveState.heal` is one collective sequence that every member of a new generation runs:
each says which ``global_step`` it holds and whether it *continues* (it was a member of the
generation before; one all-reduce).  The first continuing member holding the newest step
among the continuing ones sends its parameters, its wrapped optimizer's ``state_dict()`` and
the exchange's books to every member behind it, point to point
(:func:`~...transport.state_transfer.send_state`), and each loads them: a continuing member
behind, and every member that does not continue, whatever step it holds.  Continuing members
at the newest step keep their own state: it is the same, bit for bit (they made the same
updates from the same all-reduced sums).  A member that comes back -- a restarted process, or
one that hung and was left out -- may hold a step the others also hold but made otherwise (a
collective the others had given up on, completed when it came back), so its own
state never counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...transport.state_transfer import send_state

__all__ = ["LiveState"]

log = logging.getLogger(__name__)


class LiveState:
    """A member's parameters, optimizer and books (``books()`` gives them, ``load_books``
    takes them back), healed from a live member's (module docstring)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        opt: torch.optim.Optimizer,
        books: Callable[[], dict[str, Any]],
        load_books: Callable[[dict[str, Any]], None],
        owner: str,
    ) -> None:
        self.params, self.opt, self.owner = list(params), opt, owner
        self.books, self.load_books = books, load_books

    def heal(self, group: Any, global_step: int) -> int:
        """Run by every member of ``group`` at once; returns the step this member holds after
        it (``global_step``, or the newest a member held).  A fresh process passes -1."""
        me, size = group.index, group.size
        said = torch.zeros(2 * size, dtype=torch.float64, device=group.device)
        said[me] = float(global_step)
        said[size + me] = float(group.continuing)
        if size > 1:
            group.all_reduce(said)
        held = [int(v) for v in said[:size].cpu().tolist()]
        counts = [i for i, c in enumerate(said[size:].cpu().tolist()) if c > 0] or range(size)
        newest = max(held[i] for i in counts)
        src = next(i for i in counts if held[i] == newest)
        behind = [i for i in range(size) if i not in counts or held[i] != newest]
        if not behind:
            return global_step
        state = None
        if me == src:
            state = {
                "params": [p.detach() for p in self.params],
                "optimizer": self.opt.state_dict(),
                "books": self.books(),
            }
        ranks = group.members
        got = send_state(
            group, state, ranks[src], group.rank, [ranks[i] for i in behind], group.device
        )
        if me not in behind:
            return global_step
        theirs = [(list(v.shape), str(v.dtype)) for v in got["params"]]
        mine = [(list(p.shape), str(p.dtype)) for p in self.params]
        if theirs != mine:
            raise ValueError(
                f"{self.owner}: rank {group.rank} has parameters {mine}, the live member rank "
                f"{group.members[src]} {theirs}; every worker must build the same model"
            )
        with torch.no_grad():
            for p, value in zip(self.params, got["params"], strict=True):
                p.copy_(value)
        self.opt.load_state_dict(got["optimizer"])
        self.load_books(got["books"])
        log.info(
            "rank %d: healed from rank %d's live state (global step %d -> %d)",
            group.rank, group.members[src], held[me], newest,
        )  # fmt: skip
        return newest
