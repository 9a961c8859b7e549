"""The read-ahead half of a SyncReplicas worker's links (several shards): paced pushes, the
token request alone, the shards' answers taken on a thread of their own (a mixin of
:class:`~.links.SyncLinks`; the protocol: :mod:`.read_ahead`).

Per step: every shard's push goes out in the worker's push order, large ones paced by the
servers' receipts (:meth:`ReadAheadLinks._pace`; overlap's pushes through the pushing thread,
:mod:`.early_pushes`), the token request right after the push to shard 0; the
:class:`~.answer_taker.AnswerTaker` takes each shard's answer (its new values) while the worker
waits for its token; :meth:`ReadAheadLinks.token_then_reads` returns the reads still coming in
(:class:`~.streaming.PendingReads`), waited for in ``step()`` or, streamed, by the next forward.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..transport import MailboxClient, ServerUnreachable
from .answer_taker import AnswerTaker
from .early_pushes import EarlyPushes
from .error_latch import ErrorLatch
from .streaming import PendingReads

__all__ = ["ReadAheadLinks", "IN_FLIGHT", "PACED_BYTES"]

log = logging.getLogger(__name__)

Grads = list[torch.Tensor | None]

IN_FLIGHT = 2  # pushes a worker has sent and their servers not yet received (see _pace())
# Smaller pushes are not paced: they cross a link in less time than a receipt costs the
# worker's and the server's threads, and the kernel's socket buffers take them whole anyway.
PACED_BYTES = 1 << 20


class ReadAheadLinks:
    """:class:`~.links.SyncLinks`' methods for reading ahead (module docstring)."""

    worker: int
    timeout: float
    clients: dict[int, MailboxClient]
    versions: dict[int, int]
    _taker: AnswerTaker | None
    _token_link: MailboxClient | None
    _early: EarlyPushes | None
    latch: ErrorLatch
    ahead: bool
    order: list[int]
    _ahead_sent: dict[int, tuple[str, int]]
    _unreceived: deque[tuple[int, int]]
    _taking: bool
    _token_sent: bool
    _sent_lock: threading.Lock
    push_shard: Callable[..., None]
    request_token: Callable[..., None]
    _read: Callable[..., None]

    def _push_paced(self, k: int, job: tuple[int, Grads, dict[str, Any]]) -> None:
        """Reading ahead: push shard ``k`` once fewer than ``IN_FLIGHT`` pushes are
        unconfirmed (large ones ask for a receipt), the token request right after shard 0."""
        tag, grads, extra = job
        self._pace()
        size = sum(g.numel() * g.element_size() for g in grads if g is not None)
        self.push_shard(k, tag, grads, extra, receipt=size >= PACED_BYTES)
        if k == 0:
            self._send_token(tag)

    def _abandon_step(self) -> None:
        """A push of this step failed: release what the shards hold and end the taker's step
        (the failed push's own error names its shard)."""
        sent, self._ahead_sent, self._taking = self._ahead_sent, {}, False
        self._unreceived.clear()
        self._abandon(sent)

    def push_early(self, jobs: dict[int, Grads], tag: int, extra: dict[str, Any]) -> None:
        """Overlap: the gradients of the shards in ``jobs`` are complete.  Reading ahead, they
        go to the pushing thread together (paced, in push order; :mod:`.early_pushes`); else
        out at once (shard 0 with the token request)."""
        if self.ahead and tag >= 0:
            if self._early is None:  # only jobs with overlap need the thread
                self._early = EarlyPushes(self._push_paced, self.order, self.latch)
            self._early.submit({k: (tag, list(g), extra) for k, g in jobs.items()})
            return
        for k, grads in jobs.items():
            if k == 0:
                self.request_token(tag, grads, extra)
            else:
                self.push_shard(k, tag, grads, extra)

    def settle_pushes(self) -> None:
        """Until overlap's pushes are all sent; a failed one fails the step here."""
        if self._early is None:
            return
        try:
            self._early.drain(self.timeout + 10.0)
        except BaseException:
            self._abandon_step()
            raise

    def _pace(self) -> None:
        """Before the next push: until fewer than ``IN_FLIGHT`` pushes are on their way.

        Why: sent all at once, a worker's pushes share its link and each arrives only at the
        end, so no shard can update (and send its values back) before every gradient is out.
        Paced, a worker's pushes follow each other in :func:`push_order`, the shards update
        one after another, and their values travel back while later gradients still go out,
        as BytePS schedules its partitions with a credit of bytes.  Unlike waves (each sent
        once the last one's shards answered), no push waits for another worker, and on the
        emulated cluster pacing is no slower than waves."""
        while len(self._unreceived) >= IN_FLIGHT:
            k, seq = self._unreceived.popleft()
            self.clients[k].wait_receipt(seq, self.timeout + 10.0)

    def _send_token(self, tag: int) -> None:
        """The token request alone, on the control-only link (read-ahead brings the values)."""
        if self._token_sent:
            return
        assert self._token_link is not None
        inc, seq = self._ahead_sent[0]  # the chief serves it once this push to shard 0 is in
        self._token_link.request(
            "step", worker=self.worker, tag=tag, version=-1, values=False,
            after_inc=inc, after_seq=seq,
        )  # fmt: skip
        self._token_sent = True

    def start_taking(self) -> None:
        """From now on the taker takes each push's answer (those sent so far first).  Overlap
        calls it at the start of ``step()``: backward is over, so the values may land in the
        parameters, and the shards pushed during backward answer while the rest go out."""
        with self._sent_lock:  # overlap's pushing thread may be registering a push
            if self._taking:
                return
            assert self._taker is not None
            self._taking = True
            for k in self._ahead_sent:
                self._taker.take(k)

    def _abandon(self, sent: dict[int, tuple[str, int]]) -> ServerUnreachable | None:
        """The step failed (a push or the token): release what the shards hold of ``sent`` and
        let the taker finish the step, so that its thread is not left waiting on a connection
        that :meth:`leave` then uses, for answers that would come only with an update.
        Returns the ``ServerUnreachable`` a shard's own link raised meanwhile, if any."""
        assert self._taker is not None
        self._release(sent)
        try:
            self._taker.end(self.timeout + 10.0)
        except ServerUnreachable as link_error:
            return link_error
        except Exception as exc:  # the step's own error is the one raised
            log.info("worker rank %d: read-ahead after a failed step: %s", self.worker, exc)
        return None

    def _release(self, pushes: dict[int, tuple[str, int]]) -> None:
        """Tell the shards still holding this step's ``pushes`` that the token is here."""
        for k, (inc, seq) in pushes.items():
            try:
                self.clients[k].notify("release", worker=self.worker, of_inc=inc, of_seq=seq)
            except Exception as exc:  # a dead shard: its answer's receive reports it
                log.info("worker rank %d: release to shard %d failed: %s", self.worker, k, exc)

    def _token_and_read_ahead(
        self, tag: int, load: Callable[[int, list[torch.Tensor]], None]
    ) -> dict[str, Any]:
        """:meth:`token_and_read` when reading ahead (module docstring)."""
        return self.token_then_reads(tag, load).finish()

    def token_then_reads(
        self, tag: int, load: Callable[[int, list[torch.Tensor]], None]
    ) -> PendingReads:
        """Reading ahead: wait for the token; the shards' values are loaded as they come
        (``load`` on the taker's thread), and the returned :class:`PendingReads` waits for
        some or all of them."""
        assert self._taker is not None and self._token_link is not None
        self._send_token(tag)
        self._token_sent = False
        self.start_taking()
        sent, self._ahead_sent, self._taking = self._ahead_sent, {}, False
        self._unreceived.clear()  # their receipts are skipped by the next step's waits
        try:
            token = self._token_link.response()
        except BaseException as token_error:
            link_error = self._abandon(sent)
            if link_error is not None:  # a shard's own link saw it die: say so
                raise link_error from token_error
            raise
        if int(token["token"]) <= tag:  # a surplus token: the update may still wait for us
            self._release({k: p for k, p in sent.items() if k not in self._taker.answered})
        # else every shard applied the update our push could join, and answers it
        self._taker.close_step()
        return PendingReads(self, self._taker, token, list(sent), load)

    def finish_reads(
        self,
        answers: dict[int, dict[str, Any]],
        token: dict[str, Any],
        load: Callable[[int, list[torch.Tensor]], None],
    ) -> None:
        """Shards ``answers`` (their answers to this step's pushes) are loaded: note their
        versions and read again those behind the token."""
        assert self._taker is not None
        for k, answer in answers.items():
            self.versions[k] = int(answer["version"])
        # a TF worker reads after its token, so it sees at least the token's step: a shard
        # answered before a later update that the token stands for is read again
        behind = [k for k in answers if self.versions[k] < int(token["token"])]
        self._read(behind, {k: self._taker.targets(k) for k in behind}, load)
