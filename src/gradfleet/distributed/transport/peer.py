"""A client as a :class:`~.mailbox.MailboxServer` sees it: its link and buffers (:class:`Peer`),
and the answer a handler owes one of its requests (:class:`Reply`).

A reply is split as a request is (:mod:`.wire`): its tensors go out on the client's link, packed
into the peer's outbox (or into one buffer shared by every reply with the same values), and its
JSON part, with the tensors' layout, to the client's reply queue (:meth:`MailboxServer.post`).
A reply that cannot go out because the client is lost drops that client's pair; one that
cannot go out because of a bug (a tensor the wire cannot carry, say) is answered with that
error instead, which the client raises as itself.
"""

from __future__ import annotations

import logging
import queue
from typing import TYPE_CHECKING, Any

from .errors import error_reply, lost_peer
from .pairs import LocalLink, PairLink
from .wire import Packer, split

if TYPE_CHECKING:
    from .mailbox import MailboxServer

__all__ = ["LAYOUT", "Peer", "Reply"]

log = logging.getLogger(__name__)

LAYOUT = "$layout"  # the control field that carries a message's tensor layout


class Peer:
    """Server-side state of one client incarnation: its pair link and buffers.

    Two inboxes, used in turn: a client sends its next request only after the reply to the
    last, which the handler sends while or after handling it, so the message being received
    never lands in the buffer the handler may still be reading."""

    def __init__(self, incarnation: str, link: PairLink | LocalLink) -> None:
        self.incarnation, self.link = incarnation, link
        self.inboxes, self.turn, self.outbox = (Packer(), Packer()), 0, Packer()
        # requests whose tensors are travelling, for this client's waiting thread
        self.arriving: queue.SimpleQueue | None = None

    def next_inbox(self) -> Packer:
        self.turn ^= 1
        return self.inboxes[self.turn]


class Reply:
    """One pending answer to a client request; ``send`` it exactly once."""

    def __init__(self, server: MailboxServer, client: str, seq: int, inc: str) -> None:
        self._server, self.client, self.seq, self.inc, self.done = server, client, seq, inc, False

    def send(self, payload: dict[str, Any], share: Any = None, fresh: bool = False) -> None:
        """Answer with ``payload``; its tensors are copied before this returns (the handler
        may change them afterwards).  ``share``: a key promising that every reply sent with
        the same key carries the same tensor values, so they are copied once for all.
        ``fresh``: the tensors are the answer's own and never changed afterwards (a snapshot
        the handler just took), so large ones travel as they are, without a second copy."""
        if self.done:
            return
        self.done = True
        skeleton, tensors = split(payload)
        message = dict(skeleton, seq=self.seq, inc=self.inc)
        peer = self._server.peers.get(self.client)
        if tensors:
            if peer is None or peer.incarnation != self.inc:
                return  # that incarnation is gone; its successor ignores this reply
            sending = False
            try:
                peer.link.wait_sent()
                message[LAYOUT], messages = (
                    peer.outbox.pack(tensors, direct=True)
                    if fresh
                    else self._server.packed(tensors, share, peer.outbox)
                )
                sending = True
                peer.link.send(messages)
            except Exception as exc:  # a dead client's own pair breaks; a bug goes to it
                if lost_peer(exc):
                    log.warning("server %s: reply to %s failed, peer dropped: %s",
                                self._server.address, self.client, exc)  # fmt: skip
                    self._server.drop(self.client, peer)
                    return
                log.error("server %s: reply to %s failed, the error is its answer",
                          self._server.address, self.client, exc_info=exc)  # fmt: skip
                if sending:  # some messages may be out: the link's state is unknown
                    self._server.drop(self.client, peer)
                message = dict(error_reply(exc), seq=self.seq, inc=self.inc)
        self._server.post(self.client, message)
