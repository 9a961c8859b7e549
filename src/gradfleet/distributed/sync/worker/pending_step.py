"""A step whose token is in: what the links' token request returns, waited on per shard.

:class:`PendingStep` (reading ahead) still has shards' values coming in on the answer taker's
thread: :meth:`~PendingStep.wait` waits for some shards (streamed reads' forward hooks),
:meth:`~PendingStep.finish` for all of them and gives the step's verdict.
:class:`FinishedStep` (TF's protocol, or a bad-input step) read every shard before it was
returned: nothing is left to wait for.  ``ServerExchange`` holds the step and settles its
verdict in the optimizer's books once every value is in (at once, unless reads are streamed).

A finished step's result: ``token`` (the worker's next ``local_step``), ``accepted`` (by the
chief and every shard), ``global_step`` (the step whose values the worker holds) and ``r``
(the R of the update its next gradient may join).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .answer_taker import AnswerTaker, Load
from .shard_clients import ShardClients

__all__ = ["FinishedStep", "PendingStep", "Step"]


class FinishedStep:
    """A step read whole before it was returned: ``result`` is its verdict."""

    def __init__(self, result: dict[str, Any]) -> None:
        self.token = self._result = result
        self.left: list[int] = []  # shards whose values are not final yet: none

    def wait(self, shards: Iterable[int]) -> None:
        """Every shard's values are in already."""

    def finish(self) -> dict[str, Any]:
        return self._result


class PendingStep:
    """One read-ahead step's values still coming in (``shards``, loaded by ``taker``'s thread)
    after its ``token``; ``load(k, values)``: what a shard read again runs on its values."""

    def __init__(
        self,
        clients: ShardClients,
        taker: AnswerTaker,
        token: dict[str, Any],
        shards: Sequence[int],
        load: Load,
    ) -> None:
        self.clients, self.taker, self.token, self.load = clients, taker, token, load
        self.left = list(shards)  # shards whose values are not final yet
        self.timeout = clients.timeout + 10.0
        self._result: dict[str, Any] | None = None
        # the step failed: its error (the answer taker's, kept in the worker's error latch)
        # was raised once; a later wait says only that
        self._failed = False

    def wait(self, shards: Iterable[int]) -> None:
        """Until the values of ``shards`` are final (read again where behind the token)."""
        wanted = set(shards)
        todo = [k for k in self.left if k in wanted]
        if self._failed:
            raise RuntimeError("read-ahead: this step's reads failed (its error was raised before)")
        if not todo:
            return
        answers = {}
        for k in todo:
            control = self.taker.wait_loaded(k, self.timeout)
            if control is None:  # the step failed: the taker's end() raises its error
                self._fail()
            answers[k] = control
        self._read_behind(answers)
        self.left = [k for k in self.left if k not in answers]

    def _read_behind(self, answers: dict[int, dict[str, Any]]) -> None:
        """Shards ``answers`` (their answers to this step's pushes) are loaded: note their
        versions and read again those behind the token."""
        for k, answer in answers.items():
            self.clients.versions[k] = int(answer["version"])
        # a TF worker reads after its token, so it sees at least the token's step: a shard
        # answered before a later update that the token stands for is read again
        behind = [k for k in answers if self.clients.versions[k] < int(self.token["token"])]
        self.clients.read(behind, {k: self.taker.targets(k) for k in behind}, self.load)

    def _fail(self) -> None:
        """A shard's values will not come: raise the taker's error (from the latch), once."""
        self._failed = True
        self.taker.end(self.timeout)
        raise RuntimeError("read-ahead: a shard's answer was lost")

    def finish(self) -> dict[str, Any]:
        """Every shard final: the step's ``token``, ``accepted``, ``global_step`` and ``r``."""
        if self._result is not None:
            return self._result
        self.wait(self.left)
        try:
            answers = self.taker.end(self.timeout)
        except BaseException:
            self._failed = True
            raise
        token = self.token
        # the step this worker has seen is the oldest shard values it holds now: a shard that
        # answered a stale push without values may be past them ("step") while the worker
        # keeps values it need not read again for its token; claiming that shard's step
        # would end a `while opt.global_step < last_step` loop on older values than the
        # other workers'
        held = min(self.clients.versions[k] for k in answers) if answers else -1
        self._result = {
            "token": int(token["token"]),
            "accepted": bool(token["accepted"])
            and all(bool(a["accepted"]) for a in answers.values()),
            "global_step": max(int(token["token"]), held),
            "r": token.get("r"),
        }
        return self._result


Step = FinishedStep | PendingStep
