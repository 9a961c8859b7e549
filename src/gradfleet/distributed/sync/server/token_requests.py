"""Read-ahead's order between a worker's push to shard 0 and its token request.

Reading ahead (:mod:`.read_ahead`), a worker's push to shard 0 and its token request travel
apart (the push with its tensors, the request alone), so the request may overtake the push.
TF dequeues a token after its push, so the chief serves a request only once the push it names
(``after_inc``, ``after_seq``) is in: :meth:`TokenRequests.parked` keeps a request that came
first until :meth:`pushed` says its push arrived.

A push that says its token request follows (``token_follows``) gives its worker a place in the
token line at once (a *placeholder*, ticket None), as if the request had come with it: else the
update that push completes could hand a faster worker's next request the token meant for this
one, which TF allows but which breaks R = N lockstep.  What the line serves to a placeholder (a
token or an error) waits in :meth:`grant` until the request claims it.

Pure bookkeeping, no I/O: the chief (:mod:`.chief`) asks and tells.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TokenRequests"]


class TokenRequests:
    """Per worker: its last push to shard 0, a token request waiting for that push, and what
    was served to its placeholder (module docstring)."""

    def __init__(self) -> None:
        self._last_push: dict[int, tuple[str, int]] = {}
        self._parked: dict[int, tuple[dict[str, Any], Any]] = {}  # worker -> (request, ticket)
        self._granted: dict[int, tuple[str, Any]] = {}  # worker -> (kind, payload)

    def pushed(self, worker: int, msg: dict[str, Any]) -> tuple[dict[str, Any], Any] | None:
        """``worker``'s push reached shard 0: the token request that waited for it, if any."""
        self._last_push[worker] = (str(msg.get("inc", "")), int(msg.get("seq", -1)))
        parked = self._parked.get(worker)
        if parked is not None and self.ready(parked[0]):
            return self._parked.pop(worker)
        return None

    def ready(self, request: dict[str, Any]) -> bool:
        """Has the push this token request names arrived (or does it name none)?"""
        if "after_seq" not in request:
            return True
        named = (str(request["after_inc"]), int(request["after_seq"]))
        return self._last_push.get(int(request["worker"])) == named

    def park(self, request: dict[str, Any], ticket: Any) -> None:
        """Keep a token request that overtook its push."""
        self._parked[int(request["worker"])] = (request, ticket)

    def parked(self, worker: int) -> bool:
        return worker in self._parked

    def take_parked(self) -> list[tuple[dict[str, Any], Any]]:
        """Every parked token request, forgotten here (the chief stops: each is answered
        with its error)."""
        taken, self._parked = list(self._parked.values()), {}
        return taken

    @property
    def any_parked(self) -> bool:
        return bool(self._parked)

    def grant(self, worker: int, kind: str, payload: Any) -> None:
        """What the line served to ``worker``'s placeholder: ``("token", answer)`` or an
        error's ``(type name, message)``."""
        self._granted[worker] = (kind, payload)

    def claim(self, worker: int) -> tuple[str, Any] | None:
        """What ``worker``'s placeholder was given, if anything yet: its token request came,
        or it left (then nobody will ask for it)."""
        return self._granted.pop(worker, None)
