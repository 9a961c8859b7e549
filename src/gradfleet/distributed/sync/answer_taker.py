"""A worker's thread that takes the shards' read-ahead answers while the worker waits for its
token (see :mod:`.read_ahead`).

Why a thread: gloo moves a message only once its receiver has posted the receive, and the
receive can be posted only once the reply's control part (its layout) has come.  The worker's
own thread is busy meanwhile, sending later pushes and waiting for the token; if it took the
answers only after the token, every shard's values would wait for the slowest shard and the
chief.  So this thread posts each answer's receive as soon as its control part is in, in the
order the pushes went out, and loads the values into the parameters as they complete.

It starts only in ``step()``, after backward: values received in place into the parameters
while autograd still needed them would corrupt (or fail) the backward pass.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..transport import MailboxClient

__all__ = ["AnswerTaker"]

log = logging.getLogger(__name__)

Targets = Callable[[int], list[torch.Tensor]]
Load = Callable[[int, list[torch.Tensor]], None]


class AnswerTaker:
    """Takes the answers of the pushes :meth:`take` names, on one thread for the worker's
    life; :meth:`end` returns ``{shard: answer without tensors}`` once every one is loaded."""

    def __init__(self, clients: dict[int, MailboxClient], targets: Targets, load: Load) -> None:
        self.clients, self.targets, self.load = clients, targets, load
        self.answered: set[int] = set()  # shards whose answer's control part is in
        self.lock = threading.Lock()  # guards ``answered``
        self._jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[dict[int, dict[str, Any]] | BaseException] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="gradfleet-read-ahead", daemon=True)
        self._thread.start()

    def take(self, k: int) -> None:
        """Take the answer to the request just sent to shard ``k``."""
        self._jobs.put(k)

    def end(self, timeout: float) -> dict[int, dict[str, Any]]:
        """Every answer of this step (each shard's control fields), loaded; re-raises the
        first error an answer carried or its link raised."""
        self._jobs.put(None)
        try:
            result = self._results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"read-ahead answers not in after {timeout:g}s") from None
        with self.lock:
            self.answered = set()
        if isinstance(result, BaseException):
            raise result
        return result

    def _run(self) -> None:
        while True:
            started: list[tuple[int, dict[str, Any], Callable[[], dict[str, Any]]]] = []
            error: BaseException | None = None
            while (k := self._jobs.get()) is not None:
                if error is not None:
                    continue  # drain this step's shards: the step fails with the first error
                try:
                    control, finish = self.clients[k].begin_response(self.targets(k))
                    with self.lock:
                        self.answered.add(k)
                    started.append((k, control, finish))
                except BaseException as exc:  # reported by end() on the worker's thread
                    log.debug("read-ahead answer of shard %d failed: %s", k, exc)
                    error = exc
            answers: dict[int, dict[str, Any]] = {}
            for k, control, finish in started:
                try:
                    whole = finish()
                    if error is None and "params" in whole:
                        self.load(k, whole["params"])
                    answers[k] = control
                except BaseException as exc:  # reported by end() on the worker's thread
                    log.debug("read-ahead values of shard %d failed: %s", k, exc)
                    error = error or exc
            self._results.put(error if error is not None else answers)
