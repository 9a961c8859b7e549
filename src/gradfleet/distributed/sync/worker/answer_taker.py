"""A worker's thread that takes the shards' read-ahead answers while the worker waits for its
token (see :mod:`.read_ahead`).

Why a thread: gloo moves a message only once its receiver has posted the receive, and the
receive can be posted only once the reply's control part (its layout) has come.  The worker's
own thread is busy meanwhile, sending later pushes and waiting for the token; if it took the
answers only after the token, every shard's values would wait for the slowest shard and the
chief.  So this thread posts each answer's receive as soon as its control part is in, in the
order the pushes went out, and loads the values into the parameters as they complete.

It starts in ``step()``, after backward: values received in place into the parameters while
autograd still needed them would corrupt (or fail) the backward pass.  The one exception is
overlap with streamed reads: there it starts with the first shard a gradient hook pushes, since
once every gradient of a shard's parameters has accumulated, every node that saved them has run.

Streamed reads (``SyncReplicasOptimizer.stream_reads``) do not wait for the whole step: they
close the step's list of pushes (:meth:`AnswerTaker.close_step`) and wait for one shard's
values at a time (:meth:`AnswerTaker.wait_loaded`), each set as soon as it is loaded.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from ...transport import MailboxClient
from .error_latch import ErrorLatch

__all__ = ["AnswerTaker"]

log = logging.getLogger(__name__)

_STOP = -1  # on the jobs queue: the thread ends (shards are numbered from 0)

Targets = Callable[[int], list[torch.Tensor]]
Load = Callable[[int, list[torch.Tensor]], None]


class AnswerTaker:
    """Takes the answers of the pushes :meth:`take` names, on one thread for the worker's
    life; :meth:`end` returns ``{shard: answer without tensors}`` once every one is loaded,
    :meth:`wait_loaded` one shard's as soon as its values are."""

    def __init__(
        self, clients: dict[int, MailboxClient], targets: Targets, load: Load, latch: ErrorLatch
    ) -> None:
        self.clients, self.targets, self.load, self.latch = clients, targets, load, latch
        self.answered: set[int] = set()  # shards whose answer's control part is in
        self.lock = threading.Lock()  # guards ``answered``
        self._jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        # a step's answers, or None when it failed (its error is in the latch)
        self._results: queue.SimpleQueue[dict[int, dict[str, Any]] | None] = queue.SimpleQueue()
        # this step's shards: set once the shard's values are loaded (or the step failed)
        self._loaded: dict[int, threading.Event] = {}
        self._controls: dict[int, dict[str, Any]] = {}  # written before its event is set
        self._closed = False  # this step's list of pushes is complete
        self._thread = threading.Thread(target=self._run, name="gradfleet-read-ahead", daemon=True)
        self._thread.start()

    def take(self, k: int) -> None:
        """Take the answer to the request just sent to shard ``k``."""
        self._loaded[k] = threading.Event()  # before the job: the thread sets it
        self._jobs.put(k)

    def close_step(self) -> None:
        """No more pushes this step: the thread goes on to load the answers."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def wait_loaded(self, k: int, timeout: float) -> dict[str, Any] | None:
        """Shard ``k``'s answer (control fields) once its values are loaded; None if the step
        failed (:meth:`end` raises its error).  Needs :meth:`close_step`."""
        if not self._loaded[k].wait(timeout):
            raise TimeoutError(f"read-ahead answer of shard {k} not in after {timeout:g}s")
        return self._controls.get(k)

    def end(self, timeout: float) -> dict[int, dict[str, Any]]:
        """Every answer of this step (each shard's control fields), loaded; raises the first
        error an answer carried or its link raised (from the latch)."""
        self.close_step()
        try:
            result = self._results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"read-ahead answers not in after {timeout:g}s") from None
        with self.lock:
            self.answered = set()
        self._loaded, self._controls, self._closed = {}, {}, False
        if result is None:
            self.latch.raise_if_failed()
            raise RuntimeError("read-ahead: this step's answers failed (reported before)")
        return result

    def stop(self) -> None:
        """End the thread (the worker left: no step follows)."""
        self._jobs.put(_STOP)

    def _run(self) -> None:
        while True:
            started: list[tuple[int, dict[str, Any], Callable[[], dict[str, Any]]]] = []
            error: BaseException | None = None
            while (k := self._jobs.get()) is not None:
                if k == _STOP:
                    return
                if error is not None:
                    continue  # drain this step's shards: the step fails with the first error
                try:
                    control, finish = self.clients[k].begin_response(self.targets(k))
                    with self.lock:
                        self.answered.add(k)
                    started.append((k, control, finish))
                except BaseException as exc:  # raised by end() on the worker's thread
                    self.latch.report(f"taking the read-ahead answer of shard {k}", exc)
                    error = exc
            answers: dict[int, dict[str, Any]] = {}
            for k, control, finish in started:
                try:
                    whole = finish()
                    if error is None and "params" in whole:
                        self.load(k, whole["params"])
                    answers[k] = control
                    if error is None:
                        self._controls[k] = control
                        self._loaded[k].set()
                except BaseException as exc:  # raised by end() on the worker's thread
                    self.latch.report(f"loading the read-ahead values of shard {k}", exc)
                    error = error or exc
            for event in list(self._loaded.values()):  # a failed step: every waiter goes on
                event.set()
            self._results.put(None if error is not None else answers)
