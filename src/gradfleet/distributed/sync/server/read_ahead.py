"""Read-ahead: a shard answers a worker's push with its new values as soon as it has applied
the update that push could join, before the worker's token exists.

TF's worker pushes its gradients, dequeues a token, and only then reads the variables.  Read
one after the other, the three phases leave a link idle while another works: the read waits for
the token, and the token for the slowest shard.  With read-ahead, a push tagged ``tag`` is
*held* by its shard until the shard's step passes ``tag`` (the update that gradient could join
is applied), then answered with the shard's values; the worker waits for its token meanwhile.

This changes no value a worker can observe, compared with some TF interleaving:

* a push that cannot join an update (stale, dropped, past ``last_step``) is answered at once,
  without values: the worker reads after its token, as TF's does (such pushes are a slow or
  backup worker's, whose link would otherwise carry the values twice);
* a held push is answered with the values just after the update it joined.  The worker then
  checks them against its token ``g``: a TF read after the token sees step ``g`` or later, so a
  shard whose answer shows a step below ``g`` is read again (``read``), as before;
* a worker may get its token while a shard still holds its push: with backup workers or
  initial tokens, TF hands out surplus tokens before the update, and its worker goes on with
  the current values (and may push a second gradient to the same update).  Holding that push
  could deadlock (the update may wait for that worker's next gradient), so the worker sends
  ``release`` once it has its token; the shard answers the held push at once with its current
  values.  A release may overtake its push (control travels apart from tensors): it is kept,
  and the push it names is answered as soon as it arrives.

:class:`HeldPushes` is that bookkeeping for one shard, and :func:`push_answers`,
:func:`release_answers`, :func:`read_answer` the answers a shard's state machine gives (``shard``: a
:class:`~.shards.Shard`, its ``step``, ``params`` and ``values_key``): pure, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...common.replies import Answer

__all__ = [
    "Held",
    "HeldPushes",
    "push_answers",
    "read_answer",
    "release_answers",
    "values_answer",
]


@dataclass(frozen=True)
class Held:
    """A push answered later: its ticket, the worker's tag and the shard version it knows."""

    worker: int
    push: tuple[str, int]  # (client incarnation, request number): what a release names
    ticket: Any
    tag: int
    version: int
    accepted: bool


class HeldPushes:
    """The pushes one shard holds until its step passes their tag, and early releases."""

    def __init__(self) -> None:
        self._held: dict[int, Held] = {}  # worker -> its held push (one at a time per worker)
        self._released: dict[int, tuple[str, int]] = {}  # worker -> a push released early

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, push: Held, step: int) -> bool:
        """Keep ``push`` unless it must be answered now: it was not accepted, the shard's
        ``step`` is past its tag already, or its release came first.  True iff kept."""
        if (
            not push.accepted
            or step > push.tag
            or self._released.pop(push.worker, None) == push.push
        ):
            return False
        self._held[push.worker] = push
        return True

    def due(self, step: int) -> list[Held]:
        """The held pushes whose tag ``step`` has passed (after an update), in worker order."""
        out = [h for w, h in sorted(self._held.items()) if step > h.tag]
        for h in out:
            del self._held[h.worker]
        return out

    def release(self, worker: int, push: tuple[str, int]) -> Held | None:
        """``worker`` has its token: its held push ``push``, to answer now; if that push has
        not arrived yet, remember the release for it (a release of an answered push: no-op)."""
        held = self._held.get(worker)
        if held is not None and held.push == push:
            return self._held.pop(worker)
        if held is None:
            self._released[worker] = push
        return None

    def drop(self, worker: int) -> Held | None:
        """Forget ``worker``'s held push (it left or was forgotten); returns it to answer."""
        self._released.pop(worker, None)
        return self._held.pop(worker, None)


def read_answer(shard: Any, ticket: Any, version: int) -> Answer:
    """``read``: the shard's step, and its values unless the worker holds ``version``."""
    payload: dict[str, Any] = {"version": shard.step}
    if version != shard.step:
        payload["params"] = shard.params
    return Answer(ticket, payload, shard.values_key if "params" in payload else None)


def values_answer(shard: Any, held: Held, values: bool = True) -> Answer:
    """The answer to a read-ahead push: accepted or not, the shard's step, and (a
    :func:`read_answer`) its values unless the worker holds that version already; with
    ``values=False`` it names the version the worker holds, and the worker reads after its
    token."""
    answered = {"accepted": held.accepted, "step": shard.step}
    if not values:
        return Answer(held.ticket, {**answered, "version": held.version})
    read = read_answer(shard, held.ticket, held.version)
    return replace(read, payload={**answered, **read.payload})


def push_answers(
    shard: Any, held: HeldPushes, msg: dict[str, Any], ticket: Any, accepted: bool, updated: bool
) -> list[Answer]:
    """Answers after a push was offered to ``shard``: a plain push is answered at once
    (``accepted``, the shard's step); a read-ahead push (``ahead``: the version the worker
    holds) is held until the shard's step passes its tag (:mod:`.read_ahead`), and an update
    answers the held pushes it was waited for."""
    if "ahead" not in msg:
        return [Answer(ticket, {"accepted": accepted, "step": shard.step})]
    push = Held(
        int(msg["worker"]), (str(msg.get("inc", "")), int(msg.get("seq", -1))), ticket,
        int(msg["tag"]), int(msg["ahead"]), accepted,
    )  # fmt: skip
    # a push that joins no update (stale, dropped, past last_step) is a slow or backup
    # worker's: its values would cross its link twice (now, and again after a later token)
    out = [] if held.hold(push, shard.step) else [values_answer(shard, push, accepted)]
    if updated:
        out += [values_answer(shard, h) for h in held.due(shard.step)]
    return out


def release_answers(shard: Any, held: HeldPushes, msg: dict[str, Any]) -> list[Answer]:
    """``release``: the worker has its token; answer its held push now (the release itself is
    never answered: the worker does not wait for it)."""
    push = held.release(int(msg["worker"]), (str(msg["of_inc"]), int(msg["of_seq"])))
    return [] if push is None else [values_answer(shard, push)]
